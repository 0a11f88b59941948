"""finetune against what users would pick instead: HF Trainer + peft, and TRL's SFTTrainer.

Same model (a 58M-parameter Llama built from config: 8 layers, 512 wide, 32k vocabulary), same data
(variable-length instruction samples, loss on the responses), same LoRA (r 16, all linear layers),
sequence length, samples per step, optimizer (AdamW, constant LR) and one epoch. Every run is a fresh
process, repeated; medians are reported. Per run:

  real tok/s        non-padding tokens trained per second, from the end of step 1 to the last step
  first step (s)    from process start to the end of the first optimizer step
  peak RSS          of the whole process (os.wait4)
  eval loss         of the saved adapter on held-out samples, all scored by the same code here:
                    the same real tokens seen, so speed is never bought with a worse model
  MFU               model FLOPs per second over the measured bf16 matmul ceiling on the model's shapes

Also measured: that ceiling, import + load + first step of a bare script (what start-up costs at the
least), and what finetune's steps would take doing nothing but their matmuls (bench/matmuls.py: a
bound on its throughput with torch's kernels here). Writes bench/results/compare.md and compare.png.

Usage: python bench/compare.py [--repeats 3] [--runners finetune,hf-bf16-flatten,...] [--quick]   (make bench)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from common import DATA, REPO, build_model, cpu_name, report, spawn

RESULTS = REPO / "bench" / "results"


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int = 8
    hidden: int = 512
    vocab: int = 32000
    train_samples: int = 128
    eval_samples: int = 32
    max_seq_len: int = 512
    samples_per_step: int = 10
    lr: float = 1e-3


QUICK = Sizes(layers=2, hidden=64, vocab=2048, train_samples=24, eval_samples=4, max_seq_len=128, samples_per_step=4)
# --device cuda: a 1.1B Llama shape and rows of 2,048 tokens, so that a step is compute-bound on a GPU.
# Its LR is 2e-4: at 1e-3 the peer's eval loss varied 2.75-3.02 between runs of the same settings
# (finetune's 2.84-2.86), too wide to tell whether speed cost quality (bench/results/compare-cuda.md).
CUDA = Sizes(layers=22, hidden=2048, vocab=32000, train_samples=3072, eval_samples=16, max_seq_len=2048, samples_per_step=64, lr=2e-4)

# name -> (trainer, precision, collator, how it is set up)
PEERS = {
    "hf-fp32-padded": ("hf", "fp32", "padded", "Trainer, fp32, DataCollatorForSeq2Seq (pad to longest)"),
    "hf-bf16-padded": ("hf", "bf16", "padded", "Trainer, bf16 weights + bf16=True, pad to longest"),
    "hf-bf16-flatten": ("hf", "bf16", "flatten", "Trainer, bf16 weights + bf16=True, DataCollatorWithFlattening (padding-free)"),
    "trl-bf16-flatten": ("trl", "bf16", "flatten", "SFTTrainer, bf16 weights + bf16=True, padding_free, completion_only_loss"),
}
OURS = {
    "finetune": "finetune train: bf16 base, fp32 LoRA, bf16 autocast, packed rows, attention within each sample, loss on trained tokens only",
    "finetune-compiled": "the same with model.compile: each decoder layer through torch.compile (on a GPU, fewer kernel launches a layer)",
}
RUNNERS = [*OURS, *PEERS]
DEFAULT = {"cpu": ["finetune", *PEERS], "cuda": ["finetune", "finetune-compiled", "hf-bf16-flatten", "trl-bf16-flatten"]}  # CPU: make bench-compile


# ------------------------------------------------------------------------------------------------
# Inputs: the model, the data (raw for finetune, tokenized identically for the peers), the settings


def make_samples(n: int, seed: int, max_words: int) -> list[dict]:
    """Instruction samples of very different lengths (log-normal, like real instruction data)."""
    texts = [json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()]
    words = " ".join(texts).split(" ")
    tasks = ["Continue the text.", "Summarize the passage.", "Rewrite the passage in your own words.", "What happens next?"]
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt_len = min(max_words, int(rng.lognormvariate(3.6, 0.8)))
        answer_len = min(max_words, int(rng.lognormvariate(3.3, 0.7)) + 2)
        start = rng.randrange(len(words) - prompt_len - answer_len)
        rows.append({"instruction": rng.choice(tasks), "input": " ".join(words[start : start + prompt_len]),
                     "output": " ".join(words[start + prompt_len : start + prompt_len + answer_len])})
    return rows


def prepare(work: Path, sizes: Sizes) -> dict:
    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from finetune.data.encoding import tokenize_row
    from finetune.data.packing import pack
    from finetune.data.rows import IGNORE

    model = work / "model"
    if not (model / "config.json").exists():
        build_model(model, sizes.layers, sizes.hidden, "bfloat16", vocab=sizes.vocab, positions=max(512, sizes.max_seq_len))
    tokenizer = AutoTokenizer.from_pretrained(model)
    max_words = sizes.max_seq_len // 3
    for name, n, seed in (("train", sizes.train_samples, 1), ("eval", sizes.eval_samples, 2)):
        rows = make_samples(n, seed, max_words)
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        tokenized = [tokenize_row(r, tokenizer, "alpaca", train_on_prompt=False) for r in rows]
        # As finetune's data step cuts them: to max_seq_len, first label masked, none without a trained token.
        samples = [(t["input_ids"][: sizes.max_seq_len], [IGNORE] + t["labels"][1 : sizes.max_seq_len]) for t in tokenized]
        samples = [s for s in samples if any(x != IGNORE for x in s[1])]
        name = "tokens" if name == "train" else "eval_tokens"
        (work / f"{name}.jsonl").write_text("".join(json.dumps({"input_ids": i, "labels": l}) + "\n" for i, l in samples))
    samples = [json.loads(line) for line in (work / "tokens.jsonl").read_text().splitlines()]
    lengths = [len(r["input_ids"]) for r in samples]
    # The peers take samples_per_step samples a step (2 micro-batches of half). finetune packs the
    # samples into rows of max_seq_len and takes as many rows a step as make the same number of steps
    # (the same tokens per step on average, the same schedule), in micro-batches that leave no
    # remainder (finetune drops a last incomplete step, the peers do not): both see every token.
    rows = len(pack(lengths, sizes.max_seq_len)[1]) - 1
    peer_micro = sizes.samples_per_step // 2
    peer_steps = -(-len(samples) // peer_micro) // 2
    fits = [(m, a) for a in (2, 1) for m in range(1, 9) if -(-rows // m) % a == 0]
    micro, accum = min(fits, key=lambda ma: abs(-(-rows // ma[0]) // ma[1] - peer_steps))
    settings = {
        "lora_r": 16, "lora_alpha": 32, "lr": sizes.lr, "seed": 0, "max_seq_len": sizes.max_seq_len,
        "peer_micro_batch": peer_micro, "peer_grad_accum": 2, "ft_micro_batch": micro, "ft_grad_accum": accum,
        "samples": len(lengths), "rows": rows, "tokens": sum(lengths), "mean_len": statistics.mean(lengths), "min_len": min(lengths),
        "max_len": max(lengths), "trained_tokens": sum(sum(1 for x in r["labels"] if x != -100) for r in samples),
    }
    (work / "settings.json").write_text(json.dumps(settings, indent=1))
    return settings


def finetune_config(work: Path, out: Path, settings: dict, compiled: bool = False) -> Path:
    import yaml

    cfg = {
        "model": {"name_or_path": str(work / "model"), "dtype": "bfloat16", "compile": compiled},
        "adapter": {"method": "lora", "r": settings["lora_r"], "alpha": settings["lora_alpha"], "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train": str(work / "train.jsonl"), "format": "alpaca", "max_seq_len": settings["max_seq_len"], "packing": True,
                 "cache_dir": str(work / "cache")},
        "train": {"output_dir": str(out), "epochs": 1, "micro_batch_size": settings["ft_micro_batch"], "grad_accum": settings["ft_grad_accum"],
                  "lr": settings["lr"], "scheduler": "constant", "optimizer": "adamw", "max_grad_norm": 1.0, "seed": settings["seed"],
                  "mixed_precision": "bf16"},
        "logging": {"progress_bar": False, "plot": False},
        "checkpoint": {"resume": "never"},
    }
    path = work / ("finetune-compiled.yaml" if compiled else "finetune.yaml")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------------
# Runs



def run_once(name: str, work: Path, settings: dict, repeat: int, device: str) -> dict:
    out = work / "runs" / f"{name}-{repeat}"
    shutil.rmtree(out, ignore_errors=True)  # this benchmark's own run of an earlier `make bench` (finetune refuses a finished run's folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    if name in OURS:
        config = finetune_config(work, out, settings, compiled=name == "finetune-compiled")
        start, rss = spawn([sys.executable, "-m", "finetune", "train", "--config", str(config)], log)
        steps = [{"time": r["time"], "tokens": r["tokens"]} for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                 if "loss" in r]
        gpu = json.loads((out / "summary.json").read_text()).get("peak_gpu_mib")
    else:
        trainer, precision, collator, _ = PEERS[name]
        result = out.with_suffix(".json")
        start, rss = spawn([sys.executable, str(REPO / "bench" / "peer.py"), "--trainer", trainer, "--precision", precision,
                            "--collator", collator, "--work", str(work), "--out", str(out), "--result", str(result), "--device", device], log)
        steps, gpu = json.loads(result.read_text())["steps"], json.loads(result.read_text()).get("peak_gpu_mib")
    first, last = steps[0], steps[-1]
    return {
        "runner": name,
        "steps": len(steps),
        "first_step_s": first["time"] - start,
        "tok_s": (last["tokens"] - first["tokens"]) / max(last["time"] - first["time"], 1e-9),
        "tokens": last["tokens"],
        "peak_rss_mib": rss / 2**20,
        "peak_gpu_mib": gpu or 0.0,
        "adapter": str(out),
    }


def eval_loss(work: Path, adapter: str, device: str) -> float:
    """Mean loss per trained token of base + adapter on the held-out samples, fp32, one code for all."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    model = PeftModel.from_pretrained(base.to(device), adapter).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for line in (work / "eval_tokens.jsonl").read_text().splitlines():
            row = json.loads(line)
            ids, labels = torch.tensor([row["input_ids"]], device=device), torch.tensor(row["labels"], device=device)
            logits = model(input_ids=ids).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum").item()
            count += int((labels[1:] != -100).sum())
    return total / count


# ------------------------------------------------------------------------------------------------
# The machine's ceiling, the start-up floor, model FLOPs

CEILING = r"""
import json, sys, time, torch
shapes, device = json.loads(sys.argv[1]), sys.argv[2]
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
out = {}
for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        for _ in range(3):
            a @ b
        reps = 10 if device == "cpu" else 50
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        seconds += time.perf_counter() - t
        flops += 2 * m * k * n * reps
    out[name] = flops / seconds
print(json.dumps(out))
"""

FIRST_STEP = r"""
import json, sys, time
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
work, rows, device = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
s = json.load(open(work + "/settings.json"))
model = AutoModelForCausalLM.from_pretrained(work + "/model", dtype=torch.bfloat16).to(device)
model = get_peft_model(model, LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, target_modules="all-linear"))
samples = [json.loads(line) for line in open(work + "/tokens.jsonl")][:rows]
width = max(len(r["input_ids"]) for r in samples)
ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in samples], device=device)
labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in samples], device=device)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
model(input_ids=ids, labels=labels).loss.backward()
opt.step()
if device == "cuda":
    torch.cuda.synchronize()
print(json.dumps({"time": time.time()}))
"""


def machine_ceiling(sizes: Sizes, device: str) -> dict:
    """Dense matmul FLOP/s of torch here, on the model's own shapes (tokens x in -> out)."""
    t, d, ff = 2048 if device == "cpu" else 8192, sizes.hidden, sizes.hidden * 11 // 4
    shapes = [(t, d, d), (t, d, ff), (t, ff, d), (t, d, sizes.vocab)]
    out = subprocess.run([sys.executable, "-c", CEILING, json.dumps(shapes), device], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bare_first_step(work: Path, rows: int, device: str) -> float:
    """Seconds from process start to the first optimizer step of a bare script: import, load, one step."""
    log = work / "first_step.log"
    start, _ = spawn([sys.executable, "-c", FIRST_STEP, str(work), str(rows), device], log)
    return json.loads(log.read_text().strip().splitlines()[-1])["time"] - start


def matmul_bound(work: Path, steps: int) -> dict:
    """finetune's matmuls alone, timed one by one here (bench/matmuls.py): tokens, seconds, per kind."""
    log = work / "matmuls.log"
    spawn([sys.executable, str(REPO / "bench" / "matmuls.py"), "--config", str(work / "finetune.yaml"), "--steps", str(steps)], log)
    return json.loads(log.read_text().strip().splitlines()[-1])


def flops_per_token(sizes: Sizes, settings: dict) -> float:
    """Model FLOPs per real token for LoRA on a frozen base: 2N forward + 2N for the input gradients
    of each frozen linear layer (no weight gradients), 6 per adapter parameter; the lm_head counts for
    trained tokens only (no other token needs logits). Attention scores and embeddings are left out."""
    d, ff, L, r = sizes.hidden, sizes.hidden * 11 // 4, sizes.layers, settings["lora_r"]
    linear = L * (4 * d * d + 3 * d * ff)
    lora = L * r * (4 * (d + d) + 2 * (d + ff) + (ff + d))
    head = d * sizes.vocab * settings["trained_tokens"] / settings["tokens"]
    return 4 * (linear + head) + 6 * lora


# ------------------------------------------------------------------------------------------------
# Report


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_name()


def table(results: dict[str, list[dict]], settings: dict, sizes: Sizes, ceiling: dict, bare: float, bound: dict | None, repeats: int,
          device: str) -> list[str]:
    med = {name: {k: statistics.median(r[k] for r in runs) for k in ("tok_s", "first_step_s", "peak_rss_mib", "peak_gpu_mib", "eval_loss")}
           for name, runs in results.items()}
    peers = [n for n in med if n not in OURS]
    best = max(peers, key=lambda n: med[n]["tok_s"]) if peers else None
    fpt = flops_per_token(sizes, settings)
    params = sizes.layers * (4 * sizes.hidden**2 + 3 * sizes.hidden * sizes.hidden * 11 // 4) + 2 * sizes.vocab * sizes.hidden
    lines = [
        "# finetune vs HF Trainer + peft" + (" and TRL SFTTrainer" if "trl-bf16-flatten" in med else "") + f" ({datetime.date.today()}, "
        + (f"{device_name(device)}, torch {__import__('torch').__version__}" if device == "cuda" else
           f"{device_name(device)}, {os.cpu_count()} CPUs, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}") + ")",
        "",
        f"Llama {params / 1e6:.3g}M params ({sizes.layers} layers x {sizes.hidden}, vocab {sizes.vocab}); LoRA r {settings['lora_r']} on all "
        f"linear layers; {settings['samples']} samples of {settings['min_len']}-{settings['max_len']} tokens (mean {settings['mean_len']:.0f}, "
        f"{settings['trained_tokens'] / settings['tokens']:.0%} of tokens trained), 1 epoch, AdamW lr {settings['lr']} constant; "
        f"median of {repeats} fresh processes.",
        "",
        "| runner | settings | real tok/s | vs best peer | first step (s) | peak RSS (MiB) |" + (" peak GPU (MiB) |" if device == "cuda" else "")
        + " eval loss | MFU (bf16 ceiling) |",
        "|---|---|---|---|---|---|" + ("---|" if device == "cuda" else "") + "---|---|",
    ]
    for name, m in med.items():
        how = OURS[name] if name in OURS else PEERS[name][3]
        vs = f"{m['tok_s'] / med[best]['tok_s']:.2f}x" if best else "-"
        gpu = f"{m['peak_gpu_mib']:.0f} | " if device == "cuda" else ""
        lines.append(f"| {name} | {how} | {m['tok_s']:.0f} | {vs} | {m['first_step_s']:.1f} | {m['peak_rss_mib']:.0f} | {gpu}"
                     f"{m['eval_loss']:.4f} | {fpt * m['tok_s'] / ceiling['bf16']:.0%} |")
    lines += [
        "",
        f"Ceiling, dense matmul on the model's shapes: bf16 {ceiling['bf16'] / 1e9:.0f} GFLOP/s, fp32 {ceiling['fp32'] / 1e9:.0f} GFLOP/s"
        + (" (peak GPU: torch.cuda.max_memory_allocated over the training steps). " if device == "cuda" else ". ")
        + f"Model FLOPs per real token: {fpt / 1e6:.0f}M (see flops_per_token).",
        f"Import + load + first step of a bare script (transformers + peft, bf16, one batch): {bare:.1f} s; "
        + (f"finetune's first step: {med['finetune']['first_step_s'] / bare:.2f}x that." if "finetune" in med else ""),
        f"Steps per epoch: finetune {results['finetune'][0]['steps'] if 'finetune' in results else '-'} "
        f"({settings['ft_micro_batch']} packed rows x {settings['ft_grad_accum']}), peers "
        f"{next((r[0]['steps'] for n, r in results.items() if n not in OURS), '-')} "
        f"({settings['peer_micro_batch']} samples x {settings['peer_grad_accum']}). Real tokens trained: "
        + ", ".join(f"{n} {r[0]['tokens']:,}" for n, r in results.items()) + ".",
    ]
    if bound:
        per_k = 1000 / bound["tokens"]
        bound_tok_s = bound["tokens"] / bound["seconds"]
        kinds = ", ".join(f"{k} {v['seconds'] * per_k:.3f} s at {v['gflop'] / v['seconds']:.0f} GFLOP/s" for k, v in bound["kinds"].items())
        lines.append(
            f"Matmuls alone (bench/matmuls.py): per 1,000 real tokens finetune's steps do "
            f"{sum(v['gflop'] for v in bound['kinds'].values()) * per_k:.0f} GFLOP of matmuls, forward and backward; timed one by "
            f"one here they take {bound['seconds'] * per_k:.3f} s ({kinds}). A step doing nothing else would reach {bound_tok_s:.0f} tok/s"
            + (f", {bound_tok_s / med[best]['tok_s']:.2f}x the best peer; finetune reaches {med['finetune']['tok_s'] / bound_tok_s:.0%} "
               "of that." if best and "finetune" in med else "."))
    return lines


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("tok_s", "peak_rss_mib", "first_step_s"), ("real tokens / s (higher is better)",
                                                                            "peak RSS, MiB", "seconds to first step")):
        values = [statistics.median(r[key] for r in results[n]) for n in names]
        ax.barh(names, values, color=["tab:green" if n in OURS else "tab:gray" for n in names])
        ax.set_title(title)
        ax.invert_yaxis()
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.0f}" if v >= 10 else f" {v:.1f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runners", default=None, help=f"comma-separated, of: {', '.join(RUNNERS)} (default: {', '.join(DEFAULT['cpu'])}; "
                   f"on cuda {', '.join(DEFAULT['cuda'])})")
    p.add_argument("--quick", action="store_true", help="tiny model and data, 1 repeat: checks the harness in seconds")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: a 1.1B Llama shape, rows of 2,048 tokens, finetune vs HF Trainer + peft on the GPU (results compare-cuda)")
    p.add_argument("--lr", type=float, default=None, help="the constant learning rate of every runner (default 1e-3; on cuda 2e-4)")
    p.add_argument("--work", type=Path, help="working folder (default .cache/bench/compare or compare-quick)")
    p.add_argument("--name", default=None, help="results file name (default compare, or compare-quick)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where NAME.md and NAME.png go (default bench/results)")
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else CUDA if args.device == "cuda" else Sizes()
    name = args.name or ("compare-quick" if args.quick else f"compare-{args.device}" if args.device == "cuda" else "compare")
    work = args.work or REPO / ".cache" / "bench" / name
    work.mkdir(parents=True, exist_ok=True)
    runners = [r for r in (args.runners or ",".join(DEFAULT[args.device])).split(",") if r]
    unknown = set(runners) - set(RUNNERS)
    if unknown:
        p.error(f"--runners: unknown {', '.join(sorted(unknown))}; choose from {', '.join(RUNNERS)}")

    if args.lr:
        sizes = dataclasses.replace(sizes, lr=args.lr)
    settings = prepare(work, sizes)
    results: dict[str, list[dict]] = {r: [] for r in runners}
    for repeat in range(args.repeats):  # interleaved, so a slow spell of the machine hits every runner alike
        for runner in runners:
            result = run_once(runner, work, settings, repeat, args.device)
            result["eval_loss"] = eval_loss(work, result["adapter"], args.device)
            results[runner].append(result)
            print(f"[{repeat + 1}/{args.repeats}] {runner}: {result['tok_s']:.0f} tok/s, first step {result['first_step_s']:.1f} s, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB, peak GPU {result['peak_gpu_mib']:.0f} MiB, eval loss {result['eval_loss']:.4f}", flush=True)
    ceiling = machine_ceiling(sizes, args.device)
    bare = statistics.median(bare_first_step(work, settings["peer_micro_batch"], args.device) for _ in range(args.repeats))
    # bench/matmuls.py times CPU kernels one by one; on a GPU the MFU column says the same.
    bound = matmul_bound(work, steps=2 if args.quick else 4) if "finetune" in results and args.device == "cpu" else None
    (work / "results.json").write_text(json.dumps({"results": results, "settings": settings, "ceiling": ceiling, "bare": bare,
                                                   "matmuls": bound}, indent=1))
    report(name, table(results, settings, sizes, ceiling, bare, bound, args.repeats, args.device), args.results)
    plot(results, args.results / f"{name}.png")


if __name__ == "__main__":
    main()
