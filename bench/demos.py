"""`make bench-demos`: what the demos reach on this machine, kept in bench/results/demos.md beside other machines' rows.

Each demo runs in a fresh folder under --work with its shipped config; the demo model (and the vision demo's base) is
built there first, so the base is this machine's too, as on a fresh clone. A row names the CPU (model name and whether
it has avx512-bf16 / AMX), the kernels (`native`, or `avx2`: ATen, MKL and oneDNN held to AVX2, the arithmetic of an
AVX2-only CPU) and threads (--threads: another order of the same sums), the commit and date. Rows of other machines
and settings are kept; a rerun replaces its own.

Usage: python bench/demos.py [--only demo,vision,dpo,orpo,kto,reward] [--kernels native|avx2] [--threads N] [--work DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, cpu, head_commit

RESULTS = REPO / "bench" / "results" / "demos.md"
FINETUNE = [sys.executable, "-m", "finetune.cli"]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
HEADER = ["| demo | CPU | kernels | commit, date | outcome | wall |", "| --- | --- | --- | --- | --- | --- |"]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _exact(s: dict) -> str:
    return f"exact match {_pct(s['exact_match_before'])} → {_pct(s['exact_match_after'])}; eval loss {s['start_eval_loss']:.2f} → {s['eval_loss']:.2f}"


def _pairs(s: dict) -> str:
    return (f"reward accuracy {_pct(s['eval_reward_accuracy'])}, margin {s['eval_reward_margin']:.3f}"
            + (f", choice accuracy {_pct(s['eval_choice_accuracy'])}" if "eval_choice_accuracy" in s else ""))


def _reward(s: dict) -> str:
    return f"held-out pair accuracy {_pct(s['eval_accuracy'])}; eval loss {s['eval_loss']:.3f}"


def _kto(s: dict) -> str:
    return (f"eval loss {s['start_eval_loss']:.3f} → {s['eval_loss']:.3f}; rewards: desirable {s['eval_rewards_desirable']:.3f}, "
            f"undesirable {s['eval_rewards_undesirable']:.3f}; reference point kl {s['eval_kl']:.3f}")


# demo: (what it needs built first, its config, the summary's figures)
DEMOS = {"demo": ("model", "configs/demo.yaml", _exact), "vision": ("vision", "configs/vision.yaml", _exact),
         "dpo": ("model", "configs/dpo.yaml", _pairs), "orpo": ("model", "configs/orpo.yaml", _pairs),
         "kto": ("model", "configs/kto.yaml", _kto), "reward": ("model", "configs/reward.yaml", _reward)}


def build(base: str, work: Path, env: dict) -> list[str]:
    """The base a demo trains, built once per run in WORK; the overrides that point a config at it."""
    if base == "model":
        if not (work / "model" / "config.json").is_file():
            subprocess.run(FINETUNE + ["make-demo-model", "--out", str(work / "model")], cwd=REPO, env=env, check=True)
        return ["--set", f"model.name_or_path={work / 'model'}"]
    if not (work / "vision" / "model" / "config.json").is_file():
        subprocess.run(FINETUNE + ["make-vision-demo", "--out", str(work / "vision")], cwd=REPO, env=env, check=True)
    data = work / "vision" / "data"
    return ["--set", f"model.name_or_path={work / 'vision' / 'model'}", "--set", f"data.train={data / 'train.jsonl'}",
            "--set", f"data.eval={data / 'eval.jsonl'}"]


def run_demo(name: str, work: Path, env: dict) -> tuple[str, list[str], float]:
    """The demo's outcome (one line), its evals step by step (a table) and its wall time, building its base included."""
    base, config, outcome = DEMOS[name]
    start = time.perf_counter()
    overrides = build(base, work, env)
    out = work / f"out-{name}"
    subprocess.run(FINETUNE + ["train", "--config", config, "--output-dir", str(out)] + overrides, cwd=REPO, env=env, check=True)
    seconds = time.perf_counter() - start
    return outcome(json.loads((out / "summary.json").read_text())), evals(out / "metrics.jsonl"), seconds


def evals(metrics: Path) -> list[str]:
    """The run's evals, one row a step: every eval_* figure it logged (accuracies as percentages)."""
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if any(k.startswith("eval_") for k in r)]
    keys = [k for k in rows[0] if k.startswith("eval_") and isinstance(rows[0][k], float)] if rows else []
    show = {k: (lambda v: _pct(v)) if "accuracy" in k else (lambda v: f"{v:.3f}") for k in keys}
    return ([f"| step | {' | '.join(keys)} |", "|" + " --- |" * (len(keys) + 1)]
            + [f"| {r['step']} | {' | '.join(show[k](r[k]) if k in r else '' for k in keys)} |" for r in rows])


def slug(text: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())[:60]


def keep(rows: list[str]) -> None:
    """Write RESULTS with these rows, replacing earlier rows of the same demo, CPU and kernels."""
    mine = {tuple(r.split(" | ")[:3]) for r in rows}
    old = RESULTS.read_text().splitlines()[len(HEADER):] if RESULTS.is_file() else []
    kept = [r for r in old if r.startswith("| ") and tuple(r.split(" | ")[:3]) not in mine]
    RESULTS.write_text("\n".join(HEADER + sorted(kept + rows)) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(DEMOS), help=f"comma-separated demos: {', '.join(DEMOS)}")
    parser.add_argument("--kernels", choices=("native", "avx2"), default="native")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the runs (default: torch's own, the cores)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a new temporary folder)")
    args = parser.parse_args()
    env = {**os.environ, **(AVX2 if args.kernels == "avx2" else {}), "PYTHONPATH": str(REPO)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    kernels = f"{args.kernels}, {args.threads or os.cpu_count()} thread{'s' if (args.threads or os.cpu_count()) > 1 else ''}"
    work = args.work or Path(tempfile.mkdtemp(prefix="finetune-demos-"))
    commit = head_commit()
    stamp = f"{commit}, {datetime.date.today()}"
    rows = []
    for name in [n for n in args.only.split(",") if n]:
        if name not in DEMOS:
            sys.exit(f"--only: unknown demo {name!r}; expected some of {', '.join(DEMOS)}")
        outcome, steps, seconds = run_demo(name, work, env)
        rows.append(f"| {name} | {cpu()} | {kernels} | {stamp} | {outcome} | {seconds / 60:.1f} min |")
        detail = RESULTS.with_suffix("") / f"{name}-{slug(cpu() + ' ' + kernels)}.md"
        detail.parent.mkdir(parents=True, exist_ok=True)
        detail.write_text(f"`python bench/demos.py --only {name} --kernels {args.kernels}{f' --threads {args.threads}' if args.threads else ''}` on "
                          f"{cpu()}, {kernels}, {stamp}: {outcome}\n\n"
                          + "\n".join(steps) + "\n")
        keep(rows[-1:])  # row by row: a later demo that fails loses nothing measured before it
        print(rows[-1], flush=True)
    print("\n".join(HEADER + rows))


if __name__ == "__main__":
    main()
