"""`make docs-check`: the figures in docs/ that a bench or a GPU measured (bench/figures.json: where each is quoted,
the commit it was measured at, the command that measures it, the files that decide it), each with the commits
that changed those files since. A figure with commits since is to be re-measured or marked as older than its code.

Usage: python bench/docs_check.py   (prints a markdown table; exit 0 either way: it informs, it does not judge)
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURES = REPO / "bench" / "figures.json"


def changes_since(commit: str, paths: list[str]) -> list[str]:
    """Newest first; a file's commits from before it moved folders count too (--follow, one path at a time)."""
    seen: dict[str, str] = {}
    for path in paths:
        out = subprocess.run(["git", "log", "--follow", "--format=%ct %h %ad %s", "--date=short", f"{commit}..HEAD", "--", path], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            seen.setdefault(line.split(" ", 2)[1], line)
    return [line.split(" ", 1)[1][:100] for line in sorted(seen.values(), reverse=True)]


def main() -> None:
    print("| figure | quoted in | measured at | commits since on its files | re-measure with |\n| --- | --- | --- | --- | --- |")
    for entry in json.loads(FIGURES.read_text()):
        since = changes_since(entry["measured_at"], entry["paths"])
        print(f"| {entry['figure']} | {entry['doc']} | {entry['measured_at']} | {len(since)}"
              f"{' (latest: ' + since[0] + ')' if since else ''} | `{entry['command']}` |")


if __name__ == "__main__":
    main()
