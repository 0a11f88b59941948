"""Data at scale: finetune's data step against `datasets` + the HF Trainer, on a million rows.

Generates once (kept in .cache/bench-data) a synthetic alpaca-style JSONL of --rows rows from the
shipped corpus: instructions with inputs and answers of log-normal lengths, up to a few thousand
tokens. Then, each a fresh process, two LoRA optimizer steps on a small Llama (the model is not what
is measured), packed rows of up to 4,096 tokens:

  finetune, N rows, cold         empty tokenization cache (data.num_proc: every core)
  finetune, N rows, cached
  finetune, 10k rows, cached     the memory baseline: a run on 1M rows must stay within 1.2x of it
  finetune, N rows, 2 processes  torchrun, empty cache: one tokenization per node, node PSS
  peer, cold / cached            load_dataset("json") -> map(tokenize, num_proc=cores) -> Trainer + peft,
                                 DataCollatorWithFlattening (bench/data_peer.py)

Per run: time from process start to the end of the first optimizer step, the data step's own time
(finetune prints it; the peer times load + map), peak RSS per process and peak node PSS (sampled
every 50 ms; MALLOC_MMAP_THRESHOLD_ set so that RSS is live memory), and tokens.

Usage: python bench/data.py [--rows 1000000]   (make bench-data; ~25 min here)
Prints a markdown table and writes it to bench/results/data.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import DATA, REPO, build_model, cmdline, report, watch

WORK = REPO / ".cache" / "bench-data"
MAX_SEQ_LEN = 4096
CORES = len(os.sched_getaffinity(0))


def make_rows(path: Path, n: int, seed: int = 0) -> None:
    """n alpaca rows; input and output lengths log-normal (median 20 and 30 words, ~2 tokens a word
    with the demo tokenizer), capped so a row stays under MAX_SEQ_LEN tokens: most short, a few
    thousand tokens long at the tail."""
    words = " ".join(json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()).split()
    tasks = ["Summarize the passage.", "Continue the story.", "What happens next?", "Rewrite this more simply.", "Answer briefly."]
    rng = random.Random(seed)
    tmp = path.with_suffix(".partial")
    with tmp.open("w") as fh:
        for _ in range(n):
            a, b = (min(int(rng.lognormvariate(mu, 1.0)), 900) for mu in (3.0, 3.4))
            start = rng.randrange(len(words) - a - b)
            fh.write(json.dumps({"instruction": rng.choice(tasks), "input": " ".join(words[start : start + a]),
                                 "output": " ".join(words[start + a : start + a + b]) or "."}) + "\n")
    tmp.rename(path)


def data_file(rows: int) -> Path:
    path = WORK / f"alpaca-{rows}.jsonl"
    if not path.exists():
        WORK.mkdir(parents=True, exist_ok=True)
        print(f"generating {path} ...", flush=True)
        make_rows(path, rows)
    return path


def finetune(name: str, model: Path, data: Path, cache: Path, nproc: int = 1) -> dict:
    import yaml

    out = WORK / "runs" / name.replace(" ", "-").replace(",", "")
    shutil.rmtree(out, ignore_errors=True)
    cfg = {"model": {"name_or_path": str(model)}, "adapter": {"method": "lora", "r": 8},
           "data": {"train": str(data), "format": "alpaca", "max_seq_len": MAX_SEQ_LEN},
           "train": {"output_dir": str(out / "run"), "max_steps": 2, "micro_batch_size": 1},
           "logging": {"report_to": [], "progress_bar": False, "plot": False}, "eval": {"every": 0}}
    out.mkdir(parents=True)
    (out / "run.yaml").write_text(yaml.safe_dump(cfg))
    run = ["finetune/train.py", "--config", str(out / "run.yaml")]
    cmd = [sys.executable, *run] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *run]
    env = {**os.environ, "FINETUNE_CACHE": str(cache), "MALLOC_MMAP_THRESHOLD_": "131072", "ACCELERATE_USE_CPU": "1"}
    started = time.time()
    log = (out / "log.txt").open("w")
    job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    peaks, node = watch(job, lambda pid: "finetune/train.py" in cmdline(pid) and "torch.distributed.run" not in cmdline(pid), every=0.05)
    text = (out / "log.txt").read_text()
    if job.returncode != 0:
        sys.exit(f"{name} failed:\n{text[-3000:]}")
    first = next(json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line)
    data_line = re.search(r"data: (\d+) samples -> (\d+) rows, (\d+) tokens.*\(([\d.]+) s\)", text)
    return {"name": name, "first_step": first["time"] - started, "data_s": float(data_line.group(4)), "rss": peaks[:nproc], "pss": node,
            "rows": int(data_line.group(1)), "packed_rows": int(data_line.group(2)), "tokens": int(data_line.group(3)),
            "waited": text.count("another process is tokenizing")}


def peer(name: str, model: Path, data: Path, cache: Path, batch: int) -> dict:
    out = WORK / "runs" / name.replace(" ", "-")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / "bench" / "data_peer.py"), "--model", str(model), "--data", str(data), "--out", str(out),
           "--num-proc", str(CORES), "--max-len", str(MAX_SEQ_LEN), "--batch", str(batch)]
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "MALLOC_MMAP_THRESHOLD_": "131072"}
    started = time.time()
    log = (out / "log.txt").open("w")
    job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    peaks, node = watch(job, lambda pid: "data_peer.py" in cmdline(pid), every=0.05)
    if job.returncode != 0:
        sys.exit(f"{name} failed:\n{(out / 'log.txt').read_text()[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    return {"name": name, "first_step": result["first_step_time"] - started, "data_s": result["data_s"], "rss": peaks[:1], "pss": node,
            "rows": result["rows"], "tokens": result["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=10_000, help="rows of the memory baseline run")
    args = parser.parse_args()
    model = WORK / "model"
    if not (model / "config.json").exists():
        build_model(model, layers=2, hidden=128, positions=MAX_SEQ_LEN)
    big, small = data_file(args.rows), data_file(args.small)
    caches = {k: WORK / "cache" / k for k in ("finetune", "finetune-2proc", "peer")}
    for cache in caches.values():
        shutil.rmtree(cache, ignore_errors=True)
    n = f"{args.rows / 1e6:g}M" if args.rows >= 1e6 else f"{args.rows // 1000}k"
    cold = finetune(f"finetune, {n} rows, cold", model, big, caches["finetune"])
    cached = finetune(f"finetune, {n} rows, cached", model, big, caches["finetune"])
    finetune("warm-up", model, small, caches["finetune"])  # fills the small file's cache entry
    base = finetune(f"finetune, {args.small // 1000}k rows, cached", model, small, caches["finetune"])
    two = finetune(f"finetune, {n} rows, 2 processes, cold", model, big, caches["finetune-2proc"], nproc=2)
    # The peer's batch flattens as many samples as make one of finetune's packed rows: the same tokens a step.
    batch = max(1, round(cold["tokens"] / cold["packed_rows"] / (cold["tokens"] / cold["rows"])))
    peer_cold = peer(f"peer, {n} rows, cold", model, big, caches["peer"], batch)
    peer_cached = peer(f"peer, {n} rows, cached", model, big, caches["peer"], batch)
    runs = [cold, cached, base, two, peer_cold, peer_cached]
    lines = [f"{args.rows:,} alpaca rows ({big.stat().st_size / 2**20:.0f} MiB JSONL), {CORES} cores, max_seq_len {MAX_SEQ_LEN}, "
             f"2 LoRA steps on a 2-layer Llama (finetune: 1 packed row a step; the peer: {batch} samples flattened a step, the same "
             f"tokens); {time.strftime('%Y-%m-%d')}.", "",
             "| run | samples | tokens | data step (s) | first step done (s) | peak RSS per process (MiB) | node PSS peak (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['rows']:,} | {r['tokens']:,} | {r['data_s']:.1f} | {r['first_step']:.1f} | "
                     f"{' / '.join(f'{p:.0f}' for p in r['rss'])} | {r['pss']:.0f} |")
    lines += ["", "Targets:",
              f"- cached first step <= the peer's: {cached['first_step']:.1f} vs {peer_cached['first_step']:.1f} s -> "
              f"{'met' if cached['first_step'] <= peer_cached['first_step'] else 'NOT met'}",
              f"- cold first step <= the peer's (both {CORES} processes tokenizing): {cold['first_step']:.1f} vs {peer_cold['first_step']:.1f} s -> "
              f"{'met' if cold['first_step'] <= peer_cold['first_step'] else 'NOT met'}",
              f"- peak RSS at {n} rows <= 1.2x at {args.small // 1000}k rows: {cached['rss'][0]:.0f} vs {base['rss'][0]:.0f} MiB "
              f"({cached['rss'][0] / base['rss'][0]:.2f}x) -> {'met' if cached['rss'][0] <= 1.2 * base['rss'][0] else 'NOT met'}",
              f"- peak RSS <= the peer's: {max(cold['rss'][0], cached['rss'][0]):.0f} vs {max(peer_cold['rss'][0], peer_cached['rss'][0]):.0f} MiB -> "
              f"{'met' if max(cold['rss'][0], cached['rss'][0]) <= max(peer_cold['rss'][0], peer_cached['rss'][0]) else 'NOT met'}",
              f"- 2 processes tokenize once: {two['waited']} of 2 waited for the other's tokenization -> {'met' if two['waited'] == 1 else 'NOT met'}"]
    report("data", lines)


if __name__ == "__main__":
    main()
