"""What a process's start costs: the same 2-process run started by torchrun and forked by the suite's launcher.

A tiny model's 4-step run is mostly start-up (imports), which the test suite pays at every launch. This times

  torchrun     `torchrun --standalone --nproc_per_node 2 finetune/train.py` (an agent, two fresh interpreters)
  forked       tests/ranks.py: the two ranks forked from a server that imported torch, transformers, peft,
               accelerate and DeepSpeed once; its first launch includes the server's start
  imports      `python -c "import M"` for the modules a rank imports, each alone in a fresh interpreter

on the suite's tiny Llama (2 layers, 64 wide), LoRA under DDP and full fine-tuning under ZeRO-3 offload, and checks
that both launchers give the same losses. Writes bench/results/launch.md.

Usage: python bench/launch.py [--repeats 2]   (make bench-launch, ~2 min here)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, build_model, cpu, head_commit, report

sys.path.insert(0, str(REPO / "tests"))
from ranks import run_ranks  # noqa: E402

IMPORTS = ["torch", "transformers.modeling_utils", "peft", "accelerate", "deepspeed", "finetune.train"]
RUNS = {"ddp lora": ("ddp", "lora"), "zero3_offload full": ("zero3_offload", "full")}


def config(work: Path, model: Path, strategy: str, method: str) -> Path:
    cfg = {"model": {"name_or_path": str(model)}, "adapter": {"method": method, "r": 8, "alpha": 16, "dropout": 0.0},
           "data": {"train": str(REPO / "demo" / "data" / "train.jsonl"), "format": "alpaca", "max_seq_len": 128},
           "train": {"output_dir": str(work / "out"), "max_steps": 4, "micro_batch_size": 2, "lr": 1e-3},
           "distributed": {"strategy": strategy}, "logging": {"report_to": [], "progress_bar": False, "plot": False}}
    path = work / f"{strategy}-{method}.yaml"
    path.write_text(json.dumps(cfg))  # YAML reads JSON
    return path


def timed(launch, out: Path) -> tuple[float, list[float]]:
    shutil.rmtree(out, ignore_errors=True)
    began = time.perf_counter()
    result = launch()
    seconds = time.perf_counter() - began
    assert result.returncode == 0, result.stderr[-3000:]
    return seconds, [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    lines = [f"Start-up of a 2-process run, {cpu()}, commit {head_commit()}, {time.strftime('%Y-%m-%d')} (`python bench/launch.py`):", "",
             "| run | launcher | each launch | losses |", "| --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_model(work / "model", layers=2, hidden=64)
        for name, (strategy, method) in RUNS.items():
            path, out = config(work, work / "model", strategy, method), work / "out"
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "finetune/train.py", "--config", str(path)]
            launchers = {"torchrun": lambda: subprocess.run(torchrun, cwd=REPO, capture_output=True, text=True, env=env, timeout=600),
                         "forked": lambda: run_ranks(2, "finetune/train.py", "--config", str(path), cwd=REPO, env=env)}
            seen = {}
            for launcher, launch in launchers.items():
                runs = [timed(launch, out) for _ in range(args.repeats)]
                seen[launcher] = runs[0][1]
                lines.append(f"| {name} | {launcher} | {', '.join(f'{s:.1f} s' for s, _ in runs)} | {' '.join(f'{x:.4f}' for x in runs[0][1])} |")
            assert seen["torchrun"] == seen["forked"], seen
    lines += ["", "Losses equal to the last bit between the launchers. Each module imported alone in a fresh interpreter (seconds, "
              "what it pulls in included):", "", "| module | seconds |", "| --- | --- |"]
    for module in IMPORTS:
        code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
        lines.append(f"| {module} | {float(done.stdout.strip().splitlines()[-1]):.2f} |")
    report("launch", lines)


if __name__ == "__main__":
    main()
