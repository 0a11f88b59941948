"""`make bench-suite`: the test suite on a clean clone, as CI runs it (`.ci/run`), kept in bench/results/suite.md.

It clones this repository's HEAD into a new folder, runs `.ci/run` there (`make test`: install, lint, the tests),
and keeps the pytest summary, the wall time with the install, and the slowest tests pytest listed, with the CPU, date
and commit. `--log FILE --commit C --date D` records a run made earlier the same way (its output, with `time`'s
`real` line) instead of running one.

Usage: python bench/suite.py [--target test|test-fast] [--log FILE --commit C --date YYYY-MM-DD]
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, cpu, head_commit

RESULTS = REPO / "bench" / "results"


def run(target: str) -> tuple[str, str]:
    """A clean clone's `make TARGET` output, with its wall time in `time`'s words; and the commit."""
    commit = head_commit(marked=False)  # the clone holds the commit, whatever the working tree
    clone = Path(tempfile.mkdtemp(prefix="finetune-suite-")) / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    start = time.perf_counter()
    done = subprocess.run(["make", target], cwd=clone, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return done.stdout + done.stderr + f"\nreal\t{int(seconds // 60)}m{seconds % 60:.3f}s\nEXIT {done.returncode}\n", commit


def summarize(log: str, target: str, commit: str, date: str) -> list[str]:
    summary = [line.strip("= ") for line in log.splitlines() if re.search(r"\d+ (passed|failed)", line) and " in " in line][-1:]
    real = re.findall(r"^real\s+(\d+)m([\d.]+)s", log, re.M)
    slowest = re.findall(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)", log, re.M)
    tests = re.search(r" in ([\d.]+)s", summary[0]) if summary else None
    lines = [f"`make {target}` on a clean clone at {commit}, {date}, {cpu()}:", "",
             f"- pytest: {summary[0] if summary else 'no summary line (the run did not reach the tests)'}"]
    if tests:
        lines.append(f"- tests: {_minutes(float(tests.group(1)))}")
    if real:
        lines.append(f"- wall time with the install and lint: {_minutes(60 * int(real[-1][0]) + float(real[-1][1]))}")
    lines += ["", "| time | phase | test |", "| --- | --- | --- |"] + [f"| {float(s):.0f} s | {p} | {t} |" for s, p, t in slowest]
    return lines


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=("test", "test-fast"), default="test")
    parser.add_argument("--log", type=Path, help="an earlier run's output, instead of running one")
    parser.add_argument("--commit", help="the commit --log's run was of")
    parser.add_argument("--date", default=str(datetime.date.today()), help="the day --log's run was made")
    args = parser.parse_args()
    if args.log and not args.commit:
        sys.exit("--log needs --commit: the commit its run was of")
    log, commit = (args.log.read_text(), args.commit) if args.log else run(args.target)
    lines = summarize(log, args.target, commit, args.date)
    (RESULTS / f"suite-{args.target}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
