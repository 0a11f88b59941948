"""A 1.1B-parameter model through every path on this machine: memory against the planner, speed,
checkpoints, merge and staged loading.

The model (built once, cached under $FINETUNE_CACHE/bench-large): Llama architecture, 22 layers,
hidden 2048, intermediate 5632, 32 attention heads with 4 key/value heads, a 32k vocabulary, random
weights saved as bf16 safetensors in 500 MB shards, with the demo tokenizer; trained in fp32 (bf16
linear layers of these shapes run 2-4x slower than fp32 on this CPU). Every run is a fresh
`finetune train` process (or a 2-process torchrun) sampled every 0.25 s for its peak RSS and peak
anonymous RSS; the planner's figure is `finetune plan`'s for the same config, compared with (peak -
RSS before the model loaded), per rank for fsdp/zero3.

Rows: LoRA, DoRA, QLoRA (4-bit), full fine-tuning (8-bit AdamW), fsdp and zero3 with 2 processes
(LoRA and full; zero3 full with SGD); a checkpoint of full fine-tuning saved with background writes off and on (the
seconds training waited), the run killed and resumed; the LoRA adapter merged (peak RSS against the
merged model's size); the model staged in RAM and loaded from there against a plain read of its files.

Usage: python bench/large.py [--steps 2] [--only lora,merge,...]   (make bench-large, ~25 min)
Prints a markdown table and writes it to bench/results/large.md.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import DATA, REPO, cmdline, report, sample, steps_and_parts

CACHE = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "bench-large"
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
SEQ = 256
RUNS = {  # name -> (processes, strategy, config sections)
    "lora": (1, "none", {}),
    "dora": (1, "none", {"adapter": {"method": "dora"}}),
    "qlora": (1, "none", {"model": {"quantization": {"bits": 4, "compute_dtype": "float32"}}}),
    "full (adamw_8bit)": (1, "none", {"adapter": {"method": "full"}, "train": {"optimizer": "adamw_8bit"}}),
    # The same with glibc's heap left alone (runtime.keep_freed_memory's tuning off): less memory, slower steps.
    "full (adamw_8bit), heap tuning off": (1, "none", {"adapter": {"method": "full"}, "train": {"optimizer": "adamw_8bit"}}),
    "fsdp lora": (2, "fsdp", {}),
    "fsdp full": (2, "fsdp", {"adapter": {"method": "full"}}),
    "zero3 lora": (2, "zero3", {}),
    # DeepSpeed keeps an fp32 master copy of its partition beside the module's: with fp32 AdamW two ranks
    # need about 2 x 12 GiB by the plan (SGD measured 1.2x its plan), more than 24 GiB, and bitsandbytes' 8-bit optimizers are not offered under ZeRO.
    "zero3 full (sgd)": (2, "zero3", {"adapter": {"method": "full"}, "train": {"optimizer": "sgd"}}),
}
ROW_ENV = {"full (adamw_8bit), heap tuning off": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}  # any MALLOC_* turns the tuning off
MERGE_TOLERANCE = 2.0
# No MALLOC_* here: it would switch off how runtime.keep_freed_memory tunes glibc for speed (QLoRA: 2
# steps in 22 s instead of 30); RSS then includes freed blocks glibc keeps for reuse.
ENV = {**os.environ, "ACCELERATE_USE_CPU": "1"}


def build(folder: Path) -> Path:
    """The 1.1B model, once."""
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.model.tiny import build_tokenizer

    texts = [json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
    tok = build_tokenizer(texts)
    config = LlamaConfig(**SHAPE, max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial, max_shard_size="500MB")
    tok.save_pretrained(partial)
    partial.rename(folder)
    return folder


def config(model: Path, out: Path, strategy: str, sections: dict, steps: int) -> dict:
    cfg = {
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"method": "lora", "r": 16},
        "data": {"train": str(DATA / "train.jsonl"), "format": "alpaca", "max_seq_len": SEQ, "eval": None},
        "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 1, "mixed_precision": "no", "gradient_checkpointing": True},
        "logging": {"report_to": [], "progress_bar": False, "plot": False},
        "checkpoint": {"save_every": 0},
        "distributed": {"strategy": strategy},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def train(work: Path, name: str, nproc: int, cfg: dict, env: dict | None = None) -> dict:
    """One run, sampled: peaks per process, its summary, metrics and console."""
    import yaml

    path = work / f"{re.sub(r'[^a-z0-9]+', '-', name)}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "finetune", "train", "--config", str(path)] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "finetune/train.py", "--config", str(path)]
    log_path = path.with_suffix(".log")
    began = time.perf_counter()
    with log_path.open("w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                               env={**ENV, "OMP_NUM_THREADS": str(2 // nproc), **(env or {})})
        peaks, anon = sample(job, lambda pid: "train" in cmdline(pid) and "torch.distributed.run" not in cmdline(pid))
    out = Path(cfg["train"]["output_dir"])
    console = log_path.read_text()
    result = {"name": name, "code": job.returncode, "wall": time.perf_counter() - began, "peaks": peaks[:nproc], "anon": anon[:nproc], "console": console}
    if (out / "summary.json").is_file():
        result["summary"] = json.loads((out / "summary.json").read_text())
        result["metrics"] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return result


def planned(cfg: dict, nproc: int, strategy: str) -> float:
    """finetune plan's total for this config, MiB (per process when sharded)."""
    from finetune.config.schema import validate_config
    from finetune.outputs.plan import make_plan

    return make_plan(validate_config(cfg, "bench"), devices=nproc, strategy=strategy).total / 2**20


def floor(folder: Path, work: Path) -> dict:
    """The disk's sequential write speed here (bytes/s, fsync'd) through the page cache and past it
    (O_DIRECT, as checkpoints are written), and its read speed, with a file the size of a shard set."""
    probe = work / "floor.bin"
    size, block = 2 << 30, mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(len(block)))
    speeds = {}
    for mode, flags in (("write", 0), ("write_direct", os.O_DIRECT)):
        probe.unlink(missing_ok=True)
        began = time.perf_counter()
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)
        for _ in range(size // len(block)):
            os.write(fd, block)
        os.fsync(fd)
        os.close(fd)
        speeds[mode] = size / (time.perf_counter() - began)
    speeds["read"] = _read_speed([probe])
    probe.unlink()
    return {**speeds, "model_read": _read_speed(sorted(folder.glob("*.safetensors")))}


def _read_speed(files: list[Path]) -> float:
    """Bytes/s reading the files start to end (after asking the kernel to drop them from its cache)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    began, total = time.perf_counter(), 0
    for path in files:
        with path.open("rb") as f:
            while chunk := f.read(16 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - began)


def checkpoints(model: Path, work: Path, steps: int) -> dict:
    """Full fine-tuning (8-bit AdamW) saving every step, background writes off then on: the seconds
    training waited per save; then the second run killed mid-way and resumed: its restore seconds."""
    out = {}
    subprocess.run(["rm", "-rf", str(work / "ckpt-false"), str(work / "ckpt-true")], check=True)
    nproc, strategy, sections = RUNS["full (adamw_8bit)"]
    for mode in ("false", "true"):
        cfg = config(model, work / f"ckpt-{mode}", strategy, sections, steps)
        cfg["checkpoint"] = {"save_every": 1, "keep_last": 1, "async_save": mode == "true"}
        run = train(work, f"checkpoint async {mode}", nproc, cfg)
        # training pauses in the save, and (background) before the next optimizer step if the copy is not done
        saves = len(re.findall(r"step \d+: checkpoint (?:saved|being written)", run["console"]))
        paused = sum(float(x) for x in re.findall(r"training paused ([0-9.]+) s", run["console"]))
        out[mode] = paused / saves if saves else None
        out.setdefault("bytes", sum(p.stat().st_size for p in (work / f"ckpt-{mode}" / "checkpoints").rglob("*") if p.is_file()))
    cfg = config(model, work / "ckpt-true", strategy, sections, steps + 1)
    newest = max((work / "ckpt-true" / "checkpoints").glob("step-*"))  # a finished run goes on only from a checkpoint named on purpose
    cfg["checkpoint"] = {"save_every": 0, "resume": str(newest)}
    resumed = train(work, "resume", nproc, cfg)
    found = re.findall(r"resumed from .* at step \d+ \(([0-9.]+) s\)", resumed["console"])
    out["resume"] = float(found[0]) if found else None
    return out


def restored(seconds: float | None, size: float, disk: dict) -> str:
    if seconds is None:
        return "the resumed run did not report its restore"
    return f"resume restored it in {seconds} s ({size / seconds:.0f} MiB/s, {size / seconds / (disk['read'] / 2**20):.0%} of the disk's read speed)"


def merge_row(model: Path, work: Path) -> dict:
    """The LoRA run's adapter merged in bf16: peak RSS, seconds, the merged model's size."""
    adapter = work / "lora-out"
    merged = work / "merged"
    subprocess.run(["rm", "-rf", str(merged)], check=True)
    began = time.perf_counter()
    with (work / "merge.log").open("w") as log:
        # Two steps on random weights leave updates mostly under half a bf16 step of W: rounding W + BA
        # to bf16 loses much of them (the check measures how much), so the check is widened here.
        job = subprocess.Popen([sys.executable, "-m", "finetune", "merge", "--adapter", str(adapter), "--out", str(merged), "--dtype", "bf16",
                                "--tolerance", str(MERGE_TOLERANCE)],
                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=ENV)
        peaks, anon = sample(job, lambda pid: "merge" in cmdline(pid))
    size = sum(p.stat().st_size for p in merged.glob("*.safetensors")) if job.returncode == 0 else 0
    report = json.loads((merged / "merge_report.json").read_text()) if job.returncode == 0 else {}
    return {"code": job.returncode, "peak": peaks[0] if peaks else 0, "anon": anon[0] if anon else 0, "seconds": time.perf_counter() - began,
            "size": size / 2**20, "check": report.get("merged_vs_tuned"), "effect": report.get("adapter_effect")}


def staged_row(model: Path) -> dict:
    """`finetune stage` to /dev/shm, then finetune's own load from the staged copy until every weight
    was read once, against a plain read of its files (bench/load.py's probes: fresh processes, imports
    before the clock; transformers imports modules lazily inside the first from_pretrained, 1.5 s here)."""
    from load import probe

    root = Path("/dev/shm/finetune-bench-large")
    subprocess.run([sys.executable, "-m", "finetune", "stage", "--model", str(model), "--root", str(root)], cwd=REPO, env=ENV, check=True,
                   capture_output=True)
    staged = next(p for p in root.iterdir() if p.is_dir())
    runs = [(probe("floor", staged)["ready"], probe("load", staged)["ready"]) for _ in range(3)]
    subprocess.run(["rm", "-rf", str(root)], check=True)
    return {"read": statistics.median(r for r, _ in runs), "load": statistics.median(lo for _, lo in runs)}


def row(run: dict, plan: float, params: int) -> str:
    if run["code"] != 0 or "summary" not in run:
        last = [line for line in run["console"].splitlines() if line.strip()][-1:] or ["(no output)"]
        return f"| {run['name']} | failed (exit {run['code']}): {last[0][:120]} | | | | | | | |"
    s, m = run["summary"], run["metrics"]
    used = [peak - s["rss_before_model_mib"] for peak in run["peaks"]]
    held = [peak - s["rss_before_model_mib"] for peak in run["anon"]]
    per_step = (m[-1]["elapsed_s"] - m[0]["elapsed_s"]) / max(1, len(m) - 1)
    tok_s = m[-1]["tokens_per_s"]  # all ranks' tokens
    # 6N per token for full fine-tuning, 4N for a frozen base (no weight gradients); attention left out.
    flops = (6 if "full" in run["name"] else 4) * params * tok_s
    return (f"| {run['name']} | {' / '.join(f'{p:.0f}' for p in run['peaks'])} | {' / '.join(f'{p:.0f}' for p in run['anon'])} | {plan:.0f} | "
            f"{' / '.join(f'{plan / u:.2f}' for u in used)} | {' / '.join(f'{plan / u:.2f}' for u in held)} | {per_step:.1f} | {tok_s:.0f} | "
            f"{flops / CEILING_FP32:.0%} |")


# fp32 everywhere: bf16 linear layers at 231 x 2048 x 5632 ran at 34-58 GFLOP/s here against fp32's
# 127 (docs/platform-notes.md); this is the fp32 ceiling measured on that shape.
CEILING_FP32 = 127e9


def main() -> None:
    args, want = steps_and_parts(__doc__, 2, "names of RUNS, checkpoint, merge, staged")
    model = build(CACHE / "llama-1.1b")
    h, kv = SHAPE["hidden_size"], SHAPE["hidden_size"] // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    params = 2 * SHAPE["vocab_size"] * h + SHAPE["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * SHAPE["intermediate_size"] + 2 * h) + h
    work = CACHE / "work"
    if not args.only:  # with --only, the other rows' outputs stay (merge reads the LoRA run's adapter)
        subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True, exist_ok=True)
    lines = [f"Model: Llama 1.1B ({params / 1e9:.2f}B parameters, bf16 safetensors in 500 MB shards), sequence {SEQ}, micro batch 1, "
             f"gradient checkpointing, fp32 weights and compute, {args.steps} optimizer steps per run. Peak RSS per process sampled every 0.25 s; "
             "planner ratio = finetune plan / (peak - RSS before the model loaded).", "",
             "| run | peak RSS per process (MiB) | peak anonymous RSS (MiB) | plan (MiB per process) | plan / RSS | plan / anonymous "
             "| s per step | tokens/s | MFU (fp32 ceiling) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, (nproc, strategy, sections) in RUNS.items():
        if want(name):
            out = work / ("lora-out" if name == "lora" else re.sub(r"[^a-z0-9]+", "-", name))
            subprocess.run(["rm", "-rf", str(out)], check=True)  # a fresh run, not the finished one of an earlier --only
            cfg = config(model, out, strategy, sections, args.steps)
            run = train(work, name, nproc, cfg, env=ROW_ENV.get(name))
            lines.append(row(run, planned(cfg, nproc, strategy), params))
            print(lines[-1], flush=True)
    lines.append("")
    disk = floor(model, work)
    lines.append(f"Disk here: sequential write {disk['write'] / 2**20:.0f} MiB/s through the page cache, {disk['write_direct'] / 2**20:.0f} MiB/s "
                 f"past it (O_DIRECT; both fsync'd), read {disk['read'] / 2**20:.0f} MiB/s; "
                 f"the model's files read cold at {disk['model_read'] / 2**20:.0f} MiB/s.")
    print(lines[-1], flush=True)
    if want("checkpoint"):
        c = checkpoints(model, work, args.steps)
        sync, background = c["false"], c["true"]
        if sync and background is not None:
            size, fastest = c["bytes"] / 2**20, max(disk["write"], disk["write_direct"])
            mean_sync, mean_bg = sync, background
            lines.append(f"Checkpoint of full fine-tuning ({size:.0f} MiB): training waited {mean_sync:.1f} s per save written synchronously "
                         f"({size / mean_sync:.0f} MiB/s, {size / mean_sync / (fastest / 2**20):.0%} of the disk's faster write speed), "
                         f"{mean_bg:.2f} s with background writes ({mean_bg / mean_sync:.0%} of the synchronous save); "
                         f"{restored(c['resume'], size, disk)}.")
        else:
            lines.append(f"Checkpoint runs failed: see {work}/checkpoint-async-*.log")
        print(lines[-1], flush=True)
    if want("merge"):
        m = merge_row(model, work)
        lines.append(f"Merge of the LoRA adapter into bf16 ({m['size']:.0f} MiB merged): peak RSS {m['peak']:.0f} MiB = {m['peak'] / max(m['size'], 1):.2f}x "
                     f"the merged model, anonymous {m['anon']:.0f} MiB = {m['anon'] / max(m['size'], 1):.2f}x (the rest: pages of the base's and the "
                     f"merged model's files while mapped), {m['seconds']:.0f} s. Merged logits vs base + adapter: max {m['check']['max']:.3g}, "
                     f"mean {m['check']['mean']:.3g}, against the adapter's own effect max {m['effect']['max']:.3g}, mean {m['effect']['mean']:.3g} "
                     f"(bf16 rounding of W + BA; checked with --tolerance {MERGE_TOLERANCE})" if m["code"] == 0 else f"Merge failed: see {work}/merge.log")
        print(lines[-1], flush=True)
    if want("staged"):
        st = staged_row(model)
        lines.append(f"Load from a staged RAM copy (finetune's load_model in the stored dtype, until every weight was read once; median of 3): "
                     f"{st['load']:.2f} s, against {st['read']:.2f} s to read its files = {st['load'] / st['read']:.2f}x (target 1.5x).")
    report("large", lines)


if __name__ == "__main__":
    main()
