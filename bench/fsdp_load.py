"""How much CPU RAM does loading take when N processes share one node?

Builds a Llama-architecture model of about 0.8 GB (fp32, random weights, the demo tokenizer), then
runs one LoRA step three ways. While each runs, every process of the job is sampled every 20 ms:
the peak of its own resident memory (RSS) and the peak of the node total, counted as PSS (pages
shared between processes, such as a memory-mapped weights file, are split among them, not counted
twice):

  1 process                       the baseline: one full copy
  2 processes, distributed.strategy: ddp    every process loads a full replica
  2 processes, distributed.strategy: fsdp   rank 0 loads, the others build a meta-device skeleton
                                            and receive only their shards

Usage: python bench/fsdp_load.py [--layers 16] [--hidden 1024]   (make bench-fsdp-load)
Prints a markdown table and writes it to bench/results/fsdp_load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import DATA, REPO, build_model, cmdline, report, watch


def run(model_dir: Path, work: Path, name: str, nproc: int, strategy: str) -> dict:
    import yaml

    out = work / name
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "adapter": {"method": "lora", "r": 8},
        "data": {"train": str(DATA / "train.jsonl"), "format": "alpaca", "max_seq_len": 64},
        "train": {"output_dir": str(out), "max_steps": 1, "micro_batch_size": 1},
        "logging": {"report_to": [], "progress_bar": False, "plot": False},
        "distributed": {"strategy": strategy},
    }
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    # glibc keeps freed large blocks mapped otherwise, and RSS would count them (docs/platform-notes.md).
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "finetune", "train", "--config", str(config)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "finetune/train.py", "--config", str(config)]
    log = (work / f"{name}.log").open("w")
    job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    peaks, node_peak = watch(job, lambda pid: "train" in cmdline(pid))
    if job.returncode != 0:
        sys.exit(f"{name} failed; see {log.name}")
    # torchrun's own agent process is small and not a worker: only processes that ran the training count.
    ranked = peaks[:nproc]
    before = json.loads((out / "summary.json").read_text())["rss_before_model_mib"]
    return {"name": name, "peaks": ranked, "node": node_peak, "before": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fsdp-load-") as tmp:
        work = Path(tmp)
        size = build_model(work / "model", args.layers, args.hidden)
        rows = [run(work / "model", work, "1 process", 1, "ddp"),
                run(work / "model", work, "2 processes, ddp", 2, "ddp"),
                run(work / "model", work, "2 processes, fsdp", 2, "fsdp")]
    lines = [f"Model: {size:.0f} MiB of fp32 weights ({args.layers} layers, hidden {args.hidden}). "
             "One LoRA step; peaks over the whole run, sampled every 20 ms.", "",
             "| run | RSS before loading, rank 0 (MiB) | peak RSS per process (MiB) | node peak, PSS (MiB) | node peak / 1 process |", "|---|---|---|---|---|"]
    base = rows[0]["node"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['before']:.0f} | {' / '.join(f'{p:.0f}' for p in r['peaks'])} | {r['node']:.0f} | {r['node'] / base:.2f} |")
    report("fsdp_load", lines)


if __name__ == "__main__":
    main()
