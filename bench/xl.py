"""An 8-billion-parameter model on this 24 GiB box: QLoRA load, training, kill and resume, two
processes, merge and generation, each against the planner or the disk's floor.

The model (built once, cached under $FINETUNE_CACHE/bench-xl, about 16 GB): Llama-3-8B's shape (32
layers, hidden 4096, MLP 14336, 32 heads with 8 key/value heads, vocabulary 128,256, untied), random
bf16 weights written layer by layer into ~5 GB safetensors shards with an index (building never holds
the whole model: 16 GB of bf16 would leave no room), and a byte-level BPE tokenizer trained on the demo
corpus, its vocabulary filled up to 128,256 entries with reserved tokens (as Llama 3 reserves some).

Rows (each a fresh process sampled every 0.25 s for its peak RSS; plan = finetune plan's figure for
the same config against peak - RSS before the model loaded):
  load       the 4-bit load alone (quantized shard by shard as transformers reads them): peak RSS and
             seconds, against the 4-bit model + one shard + 1 GiB
  qlora      NF4, double quantization, LoRA r 16 on all linear layers, gradient checkpointing, rows of
             512 tokens of the demo corpus, micro-batch 1, STEPS optimizer steps, a checkpoint every step
  resume     the same run SIGKILLed after its first checkpoint, then started again: its later losses
             against the uninterrupted run's; checkpoint save and restore seconds against the disk
  zero3 qlora  the same over 2 processes (DeepSpeed ZeRO-3 partitions the 4-bit base)
  lora 2p    bf16 LoRA over 2 processes with whichever of fsdp / zero3 the planner says fits this box
             (or the planner's line saying neither does)
  merge      the QLoRA adapter merged into bf16 shard by shard (peak against one shard in fp32 + 2 GiB),
             reloaded by plain transformers and checked against base + adapter
  generate   `finetune generate` from the adapter and from the merged model: a few tokens, wall time
             and time to the first token

Compute runs in fp32 (compute_dtype float32): bf16 matmuls of these shapes run 2-4x slower than fp32
on this CPU (docs/platform-notes.md). Needs ~50 GB of free disk (the model, and merge's two bf16
variants while it compares them).

usage: python bench/xl.py [--steps 3] [--only load,qlora,resume,zero3,lora2,merge,generate]   (make bench-xl, ~60 min)
Prints a markdown table and writes it to bench/results/xl.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import DATA, REPO, cmdline, report, sample, steps_and_parts
from large import MERGE_TOLERANCE, floor, planned, train

CACHE = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "bench-xl"
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
SHARD_BYTES = 5 * 10**9
SEQ = 512
QLORA = {"model": {"dtype": "bfloat16", "quantization": {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "float32"}}}
ENV = {**os.environ, "ACCELERATE_USE_CPU": "1"}
GiB = 2**30


def build(folder: Path) -> Path:
    """The model, once."""
    if not (folder / "model.safetensors.index.json").is_file():
        from transformers import LlamaConfig

        from finetune.model.tiny import byte_level_bpe, write_random_model

        tok = byte_level_bpe([json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()], SHAPE["vocab_size"])
        config = LlamaConfig(**SHAPE, max_position_embeddings=8192, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
                             tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        write_random_model(folder, config, tok, SHARD_BYTES, say=lambda line: print(f"xl: {line}", flush=True))
    return folder


def config(model: Path, out: Path, strategy: str, sections: dict, steps: int) -> dict:
    cfg = {
        "model": {"name_or_path": str(model), "dtype": "bfloat16"},
        "adapter": {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train": str(DATA / "corpus.jsonl"), "format": "completion", "max_seq_len": SEQ, "eval": None},
        "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 1, "mixed_precision": "no", "gradient_checkpointing": True,
                  "lr": 1e-4},
        "logging": {"report_to": [], "progress_bar": False, "plot": False},
        "checkpoint": {"save_every": 1, "keep_last": 2},
        "distributed": {"strategy": strategy},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


LOAD = """
import json, resource, sys, threading, time
from finetune.config.schema import ModelConfig, QuantizationConfig
from finetune.model.loading import load_model
from finetune.parallel import runtime

def anonymous():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))

peak_anon = [0]
def watch():
    while True:
        peak_anon[0] = max(peak_anon[0], anonymous())
        time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
before, before_anon = runtime.current_rss(), anonymous()
began = time.perf_counter()
load_model(ModelConfig(name_or_path=sys.argv[1], dtype="bfloat16", quantization=QuantizationConfig(bits=4, compute_dtype="float32")), say=lambda _: None)
print(json.dumps({"seconds": time.perf_counter() - began, "before": before / 2**20, "before_anon": before_anon / 2**20,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak_anon": peak_anon[0] / 2**20,
                  "after": runtime.current_rss() / 2**20}))
"""


def load_row(model: Path, cfg: dict) -> str:
    """The 4-bit load alone: its peak RSS (the kernel's high-water mark, clean pages of the mapped
    safetensors files included) and its peak anonymous RSS (sampled every 5 ms: what the process holds),
    against the 4-bit model + one shard + 1 GiB."""
    from finetune.config.schema import validate_config
    from finetune.outputs.plan import make_plan

    result = subprocess.run([sys.executable, "-c", LOAD, str(model)], cwd=REPO, capture_output=True, env=ENV, text=True)
    if result.returncode != 0:
        return f"| load (4-bit) | failed: {result.stderr.strip().splitlines()[-1][:160]} | | | | | | |"
    r = json.loads(result.stdout.strip().splitlines()[-1])
    weights = make_plan(validate_config(cfg, "bench")).rows["weights"]  # the 4-bit base and the adapter's weights
    shard = max(p.stat().st_size for p in model.glob("*.safetensors"))
    target = (weights + shard + GiB) / 2**20
    held, mapped = r["peak_anon"] - r["before_anon"], r["peak"] - r["before"]
    return (f"| load (4-bit, shard by shard) | {r['peak']:.0f} | {r['peak_anon']:.0f} | target {target:.0f} (4-bit model {weights / 2**20:.0f} + "
            f"one shard {shard / 2**20:.0f} + 1024) | anonymous {held:.0f}: {'met' if held <= target else 'NOT met'}; RSS {mapped:.0f} with the "
            f"mapped files' pages: {'met' if mapped <= target else 'not met'}; {r['after'] - r['before']:.0f} after | {r['seconds']:.0f} s to load | | |")


def run_row(run: dict, plan: float) -> str:
    if run["code"] != 0 or "summary" not in run:
        lines = [line for line in run["console"].splitlines() if line.strip() and not line.startswith(("=", " "))]
        why = "a rank was SIGKILLed (on this box: the kernel's out-of-memory killer)" if "Signal 9 (SIGKILL)" in run["console"] else \
            (lines[-1:] or ["(no output)"])[0][:160]
        return f"| {run['name']} | failed (exit {run['code']}): {why}; peaks {' / '.join(f'{p:.0f}' for p in run['peaks'])} MiB | | {plan:.0f} | | | | |"
    s, m = run["summary"], run["metrics"]
    used = [peak - s["rss_before_model_mib"] for peak in run["peaks"]]
    held = [peak - s["rss_before_model_mib"] for peak in run["anon"]]
    ratios = "RSS " + " / ".join(f"{u / plan:.3f}" for u in used) + ", anonymous " + " / ".join(f"{u / plan:.3f}" for u in held)
    within = all(0.9 <= u / plan <= 1.1 for u in used)
    per_step = (m[-1]["elapsed_s"] - m[0]["elapsed_s"]) / max(1, len(m) - 1) if len(m) > 1 else m[0]["elapsed_s"]
    saves = [float(x) for x in re.findall(r"training paused ([0-9.]+) s", run["console"])]
    return (f"| {run['name']} | {' / '.join(f'{p:.0f}' for p in run['peaks'])} | {' / '.join(f'{p:.0f}' for p in run['anon'])} | {plan:.0f} | "
            f"{ratios} (RSS {'within' if within else 'outside'} ±10%) | {per_step:.0f} s per step | "
            f"{'save ' + ' / '.join(f'{x:.1f}' for x in saves) + ' s' if saves else ''} | {' '.join(f'{x:.4f}' for x in (r['loss'] for r in m))} |")


def killed_and_resumed(model: Path, work: Path, steps: int, reference: dict) -> str:
    """SIGKILL after the first checkpoint, start again: the losses after it against the uninterrupted run."""
    import yaml

    out = work / "resume-out"
    shutil.rmtree(out, ignore_errors=True)
    cfg = config(model, out, "none", QLORA, steps)
    path = work / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "finetune", "train", "--config", str(path)]
    with (work / "resume-killed.log").open("w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=ENV)
        while job.poll() is None and not (out / "checkpoints" / "step-000001" / "manifest.json").exists():
            time.sleep(0.5)
        job.send_signal(signal.SIGKILL)
        job.wait()
    resumed = train(work, "resume", 1, cfg)
    if resumed["code"] != 0 or "metrics" not in resumed:
        return f"Kill and resume failed: see {work}/resume.log"
    found = re.findall(r"resumed from .* at step (\d+) \(([0-9.]+) s\)", resumed["console"])
    after = {r["step"]: r["loss"] for r in resumed["metrics"]}
    before = {r["step"]: r["loss"] for r in reference["metrics"]}
    same = [after[k] == before.get(k) for k in sorted(after) if k > int(found[-1][0])] if found else []
    size = sum(p.stat().st_size for p in (out / "checkpoints" / "step-000001").rglob("*") if p.is_file()) / 2**20
    return (f"Killed (SIGKILL) after the checkpoint of step 1 ({size:.0f} MiB) and started again: resumed from step {found[-1][0] if found else '?'} "
            f"in {found[-1][1] if found else '?'} s; later losses {'bitwise equal to' if same and all(same) else 'DIFFERENT from'} the "
            f"uninterrupted run's ({', '.join(f'{after[k]:.6f}' for k in sorted(after))}).")


def two_process_lora(model: Path, work: Path, steps: int) -> tuple[str | None, dict | None]:
    """bf16 LoRA over 2 processes with the first of fsdp / zero3 the planner fits in this box's RAM."""
    from finetune.outputs.plan import available_memory

    budget = available_memory()[0]
    for strategy in ("fsdp", "zero3"):
        cfg = config(model, work / f"lora2-{strategy}", strategy, {"train": {"mixed_precision": "bf16"}}, steps)
        per_rank = planned(cfg, 2, strategy)
        if 2 * per_rank * 2**20 <= budget:
            return strategy, cfg
    return f"bf16 LoRA over 2 processes: the planner says neither fits (fsdp/zero3 {2 * per_rank / 1024:.1f} GiB for both ranks, " \
           f"{budget / GiB:.1f} GiB available)", None


def merge_row(model: Path, work: Path) -> str:
    merged = work / "merged"
    shutil.rmtree(merged, ignore_errors=True)
    began = time.perf_counter()
    with (work / "merge.log").open("w") as log:
        # Three steps on random weights leave updates mostly under half a bf16 step of W: rounding W + BA to
        # bf16 loses much of them (the check measures how much), so the check is widened as in bench/large.py.
        job = subprocess.Popen([sys.executable, "-m", "finetune", "merge", "--adapter", str(work / "qlora-out"), "--out", str(merged), "--dtype", "bf16",
                                "--tolerance", str(MERGE_TOLERANCE)],
                               cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=ENV)
        peaks, anon = sample(job, lambda pid: "merge" in cmdline(pid))
    seconds = time.perf_counter() - began
    if job.returncode != 0:
        return f"Merge failed (exit {job.returncode}): {(work / 'merge.log').read_text().strip().splitlines()[-1][:200]}"
    r = json.loads((merged / "merge_report.json").read_text())
    shard = max(p.stat().st_size for p in model.glob("*.safetensors"))
    target = (2 * shard + 2 * GiB) / 2**20  # one shard in fp32 + 2 GiB
    return (f"Merge of the QLoRA adapter into bf16 ({'shard by shard' if r['by_shard'] else 'whole'}; base chosen: {r['qlora_base']}): "
            f"peak RSS {peaks[0]:.0f} MiB, anonymous {anon[0]:.0f} MiB, target one shard in fp32 + 2 GiB = {target:.0f} "
            f"({'met' if anon[0] <= target else 'NOT met'}), {seconds:.0f} s. Merged model reloaded by plain transformers vs 4-bit base + adapter: "
            f"max {r['merged_vs_tuned']['max']:.3g}, mean {r['merged_vs_tuned']['mean']:.3g} (tolerance {r['tolerance_max']:g}; the adapter's "
            f"own effect max {r['adapter_effect']['max']:.3g}).")


def generate_row(what: list[str], work: Path, name: str) -> str:
    """Wall time, and the time to the first streamed character of the answer, of a few tokens."""
    cmd = [sys.executable, "-m", "finetune", "generate", *what, "--prompt", "The river", "--max-new-tokens", "4"]
    began = time.perf_counter()
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=ENV)
    first = None
    while job.stdout.read(1):  # the answer streams to stdout token by token (the prompt is not echoed)
        first = first or time.perf_counter() - began
    job.wait()
    total = time.perf_counter() - began
    return (f"Generate from {name}: {total:.0f} s in all, first token after {first:.0f} s (the load included)" if job.returncode == 0 and first
            else f"Generate from {name} failed (exit {job.returncode})")


def main() -> None:
    args, want = steps_and_parts(__doc__, 3, "load, qlora, resume, zero3, lora2, merge, generate")
    free = shutil.disk_usage(CACHE.parent if CACHE.parent.exists() else REPO).free
    if not (CACHE / "llama-8b" / "model.safetensors.index.json").is_file() and free < 50e9:
        sys.exit(f"bench-xl: {free / 1e9:.0f} GB free on the disk; the model needs 16 GB and merge 32 GB more")
    began = time.perf_counter()
    model = build(CACHE / "llama-8b")
    print(f"xl: model ready ({time.perf_counter() - began:.0f} s)", flush=True)
    work = CACHE / "work"
    work.mkdir(parents=True, exist_ok=True)
    params = json.loads((model / "model.safetensors.index.json").read_text())["metadata"]["total_size"] // 2
    lines = [f"Model: Llama-3-8B's shape ({params / 1e9:.2f}B parameters, bf16 safetensors in 5 GB shards, random weights), rows of {SEQ} "
             f"tokens of the demo corpus, micro-batch 1, gradient checkpointing, LoRA r 16 on all linear layers, fp32 compute, {args.steps} "
             "optimizer steps. Peak RSS per process sampled every 0.25 s; plan ratio = (peak - RSS before the model loaded) / finetune plan.", "",
             "| run | peak RSS per process (MiB) | peak anonymous (MiB) | plan (MiB per process) | measured / plan | speed | checkpoint | losses |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    qlora_cfg = config(model, work / "qlora-out", "none", QLORA, args.steps)
    if want("load"):
        lines.append(load_row(model, qlora_cfg))
        print(lines[-1], flush=True)
    reference = None
    runs = [("qlora", 1, "none", QLORA), ("zero3 qlora", 2, "zero3", QLORA)]
    for name, nproc, strategy, sections in runs:
        if want(name.split()[0]):
            cfg = config(model, work / f"{name.replace(' ', '-')}-out", strategy, sections, args.steps)
            shutil.rmtree(cfg["train"]["output_dir"], ignore_errors=True)
            run = train(work, name, nproc, cfg)
            reference = run if name == "qlora" else reference
            lines.append(run_row(run, planned(cfg, nproc, strategy)))
            print(lines[-1], flush=True)
    if want("lora2"):
        strategy, cfg = two_process_lora(model, work, args.steps)
        if cfg is None:
            lines.append(f"| lora 2p | {strategy} | | | | | | |")
        else:
            shutil.rmtree(cfg["train"]["output_dir"], ignore_errors=True)
            lines.append(run_row(train(work, f"{strategy} lora bf16", 2, cfg), planned(cfg, 2, strategy)))
        print(lines[-1], flush=True)
    lines.append("")
    disk = floor(model, work)
    lines.append(f"Disk here: write {disk['write'] / 2**20:.0f} MiB/s through the page cache, {disk['write_direct'] / 2**20:.0f} MiB/s past it; "
                 f"read {disk['read'] / 2**20:.0f} MiB/s; the model's files read cold at {disk['model_read'] / 2**20:.0f} MiB/s.")
    if want("resume") and reference and "metrics" in reference:
        lines.append(killed_and_resumed(model, work, args.steps, reference))
        print(lines[-1], flush=True)
    if want("merge"):
        lines.append(merge_row(model, work))
        print(lines[-1], flush=True)
    if want("generate"):
        lines.append(generate_row(["--adapter", str(work / "qlora-out")], work, "the adapter (4-bit base)"))
        if (work / "merged").is_dir():
            lines.append(generate_row(["--model", str(work / "merged")], work, "the merged bf16 model"))
        print("\n".join(lines[-2:]), flush=True)
    report("xl" if not args.only else "xl-" + args.only.replace(",", "-"), lines)  # a part alone keeps the whole run's table


if __name__ == "__main__":
    main()
