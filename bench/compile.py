"""What does model.compile (torch.compile of each decoder layer) buy, and what does it cost?

Builds a Llama-architecture model (random weights, the demo tokenizer; kept in .cache/bench-compile)
and trains it on the demo data with `finetune train`, each run in a fresh process, with model.compile
off and on, for LoRA and full fine-tuning in fp32 and bf16. Per run:

  first       seconds to the end of the first optimizer steps (--warm of them): compilation lands here
  s/step      median seconds per step after those (metrics.jsonl's elapsed_s, one row per step)
  speed-up    s/step without compile / s/step with it
  |Δ loss|    the largest difference of a step's loss between the two runs (compile changes the
              order of float operations, not the maths)

Usage: python bench/compile.py [--layers 8] [--hidden 512] [--steps 40] [--warm 5]
Prints a markdown table and writes bench/results/compile.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import DATA, REPO, build_model, report


def train(model: Path, out: Path, method: str, precision: str, compiled: bool, steps: int) -> list[dict]:
    """One run in a fresh process (no compiled code shared between runs); its metrics rows."""
    settings = [f"model.compile={str(compiled).lower()}", f"adapter.method={method}", f"train.mixed_precision={precision}", "train.lr=2e-4",
                "eval.on_start=false", "eval.every=0", "eval.generate_samples=0", "eval.max_batches=1", "logging.log_every=1",
                "logging.report_to=[]", "logging.progress_bar=false", "logging.plot=false", f"data.train={DATA / 'train.jsonl'}",
                f"data.eval={DATA / 'eval.jsonl'}"]
    args = [sys.executable, "-m", "finetune", "train", "--config", str(REPO / "configs" / "demo.yaml"), "--output-dir", str(out),
            "--max-steps", str(steps), "--model", str(model), *(a for s in settings for a in ("--set", s))]
    subprocess.run(args, check=True, cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def timing(rows: list[dict], warm: int) -> tuple[float, float]:
    """Seconds to the end of step `warm`, and the median step after it."""
    elapsed = [r["elapsed_s"] for r in rows]
    return elapsed[warm - 1], statistics.median(b - a for a, b in zip(elapsed[warm - 1:], elapsed[warm:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warm", type=int, default=5, help="steps counted as start-up (compilation)")
    args = parser.parse_args()
    model = REPO / ".cache" / "bench-compile" / f"l{args.layers}-h{args.hidden}"
    if not (model / "config.json").exists():
        build_model(model, args.layers, args.hidden)
    config = json.loads((model / "config.json").read_text())
    params = config["num_hidden_layers"] * (4 * config["hidden_size"] ** 2 + 3 * config["hidden_size"] * config["intermediate_size"])
    lines = [f"Llama {args.layers} layers x {args.hidden} hidden (~{params / 1e6:.0f}M params in the layers), demo data, micro-batch 8 of "
             f"<=256 tokens, {args.steps} steps; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
             f"{__import__('torch').__version__}", "",
             f"| method | precision | first {args.warm} steps, eager (s) | first {args.warm} steps, compiled (s) | eager s/step | "
             "compiled s/step | speed-up | max abs loss diff |", "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("lora", "full"):
            for precision in ("no", "bf16"):
                runs = {c: train(model, Path(tmp) / f"{method}-{precision}-{c}", method, precision, c, args.steps) for c in (False, True)}
                (first0, step0), (first1, step1) = timing(runs[False], args.warm), timing(runs[True], args.warm)
                diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs[False], runs[True]))
                lines.append(f"| {method} | {'fp32' if precision == 'no' else precision} | {first0:.1f} | {first1:.1f} | {step0:.3f} | "
                             f"{step1:.3f} | {step0 / step1:.2f}x | {diff:.1e} |")
                print(lines[-1], flush=True)
    report("compile", lines)


if __name__ == "__main__":
    main()
