"""The divergence guard's false alarms and detection, replayed (no training: seconds).

  flat runs   a run whose loss starts where it stays (a model that already knows the task, a tiny LR):
              each batch's loss log-normally off its level by the noise given; the start measured on
              10 batches of its own, as train does. Every event is a false alarm: a skip (a batch
              3x the median and 6 deviations above it, harmless) or a rollback. RUNS runs of 80
              steps per noise level, warmup 5.
  recorded    the runs of tests/data/guard_series.json, with the start they measured (the demo's,
              recorded before the start was measured: its first 10 losses stand in): the first event.

usage: python bench/guard.py [--runs 2000]   (results: bench/results/guard.md)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

from common import REPO, report

sys.path.insert(0, str(REPO))
from finetune.config.schema import GuardConfig  # noqa: E402
from finetune.run.guard import DRIFT_STEPS, Guard, _median_and_spread  # noqa: E402

NOISES = (0.02, 0.05, 0.1, 0.2, 0.3)


def flat_run(rng: random.Random, noise: float, steps: int = 80) -> str:
    """The rule that fired on one flat run ("" for none)."""
    level = rng.uniform(0.5, 6.0)
    guard = Guard(GuardConfig(), warmup=5)
    guard.set_start([level * math.exp(noise * rng.gauss(0, 1)) for _ in range(DRIFT_STEPS)])
    for step in range(steps):
        verdict = guard.check(step, level * math.exp(noise * rng.gauss(0, 1)), 1.0)
        if verdict.action != "apply":
            rule = next(name for words, name in (("where the run started", "start"), ("drifted", "drift"), ("spike", "spike"),
                                                 ("non-finite", "non-finite"), ("", verdict.reason[:20])) if words in verdict.reason)
            return f"{rule} ({verdict.action})"
    return "end" if guard.worse_than_start() else ""


def recorded(name: str, record: dict) -> str:
    start = record.get("start_level") or list(_median_and_spread([loss for loss, _ in record["steps"][:DRIFT_STEPS]]))
    guard = Guard(GuardConfig(), warmup=5 if "start_level" in record else 10)
    guard.state.start_level, guard.state.start_eval = start, record.get("start_eval")
    for step, (loss, grad) in enumerate(record["steps"]):
        verdict = guard.check(step, loss, grad)
        if verdict.action != "apply":
            return f"{verdict.action} at step {step + 1}: {verdict.reason[:90]}..."
    worse = guard.worse_than_start(record.get("final_eval"))
    return f"ends worse than it started: {worse}" if worse else "no event"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000, help="flat runs per noise level")
    args = parser.parse_args()
    rng = random.Random(0)
    lines = [f"Flat runs: {args.runs} per noise level, 80 steps each (python bench/guard.py --runs {args.runs})", "",
             "| batch noise | false alarms | rate | by rule |", "| --- | --- | --- | --- |"]
    for noise in NOISES:
        fired = [flat_run(rng, noise) for _ in range(args.runs)]
        alarms = [f for f in fired if f]
        rules = ", ".join(f"{rule} {alarms.count(rule)}" for rule in sorted(set(alarms))) or "-"
        lines.append(f"| {noise:.0%} | {len(alarms)} | {len(alarms) / args.runs:.2%} | {rules} |")
    lines += ["", "| recorded run | guard |", "| --- | --- |"]
    series = json.loads((REPO / "tests" / "data" / "guard_series.json").read_text())
    lines += [f"| {name} | {recorded(name, record)} |" for name, record in series.items()]
    report("guard", lines)


if __name__ == "__main__":
    main()
