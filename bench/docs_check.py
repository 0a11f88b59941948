"""`make docs-check` (and `make lint`): every figure in README.md and docs/ is backed by a file that a command wrote.

A figure is a number with a unit (`97.2%`, `1,911 MiB`, `3 min 2 s`, `2.5x`, `907 passed`) or a number in scientific
notation (`1.3e-6`). Each one must be in a results file the doc cites: a path under bench/results/ named anywhere in
that doc (a link or plain text), written by a bench, a demo run (bench/demos.py) or a test run (bench/suite.py) with
its machine, date and commit. A table row must be one results line, every number of the row in it; a figure in a
sentence must be on a results line, at the doc's precision, that shares a word with the figure's line or the one before
(a table row of numbers takes its header's words). A tolerance (`1e-5`) may instead be backed by a cited test
(tests/test_*.py) that holds a result to it. A figure edited by hand, or one whose results file moved on, fails here
with its file and line.

What a reader types is not a figure: inline code (`--gpu-mem 80GiB`) and fenced blocks of commands or configs
(```bash, ```yaml, ```python, ...) are skipped; a fence without a language, or ```text, is printed output and checked.
Figures quoted before this check whose command's output was not kept are owed (bench/owed-figures.txt).

Usage: python bench/docs_check.py            check; exit 1 naming each figure no cited results file backs
       python bench/docs_check.py --stale    the figures bench/figures.json lists, with the commits on their files since
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURES = REPO / "bench" / "figures.json"
RESULTS = "bench/results/"
OWED = REPO / "bench" / "owed-figures.txt"
DOCS = ("README.md", "docs")

# One spelling per unit: what a doc writes and what a results file writes are compared after this.
UNITS = {"%": "%", "x": "x", "×": "x", "s": "s", "sec": "s", "seconds": "s", "second": "s", "ms": "ms", "min": "min",
         "minutes": "min", "minute": "min", "h": "h", "hours": "h", "hour": "h", "GiB": "GiB", "MiB": "MiB", "KiB": "KiB",
         "GB": "GB", "MB": "MB", "KB": "KB", "TB": "TB", "tok/s": "tok/s", "tokens/s": "tok/s", "samples/s": "samples/s",
         "rows/s": "rows/s", "steps/s": "steps/s", "it/s": "it/s", "s/step": "s/step", "s/it": "s/it", "passed": "passed",
         "skipped": "skipped", "failed": "failed", "points": "points", "nats": "nats"}
_UNIT = "|".join(sorted((re.escape(u) for u in UNITS if u not in "x×"), key=len, reverse=True))
_NUMBER = r"(?<![\w.,/-])[-−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.,/-])[-−]?\d+(?:\.\d+)?(?:[eE][-−+]?\d+(?![\w.]))?"
# A multiple is written against its number (`2.5x`); `4096 x 32000` is a shape, not a figure.
# Hours take a space: `6h + 2kv` is a formula.
FIGURE = re.compile(rf"({_NUMBER})(?:([x×])(?![\w/])|\s(h|hours?)(?![\w/])|\s?((?!h\b|hours?\b){_UNIT})(?![\w/]))?")
# `31 min 51 s` is one figure, 1911 s: its seconds alone are not a figure of their own.
DURATION = re.compile(r"(?<![\w.,/-])(\d+)\s?min\s(\d+)\s?s\b")
SCIENTIFIC = re.compile(r"[eE][-+]?\d+$")
CODE_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
COMMON = {"with", "that", "this", "from", "than", "each", "they", "were", "what", "when", "which", "their", "there", "into",
          "over", "only", "more", "less", "same", "also", "does", "have", "been", "here", "step", "steps", "make"}
CITATION = re.compile(re.escape(RESULTS) + r"[\w./-]+\.(?:md|json|txt)|tests/test_\w+\.py")


def figures(text: str) -> list[tuple[int, str, str | None, str]]:
    """(line, number, unit, the figure with its neighbours) for each figure in a markdown text, outside inline code and
    input blocks."""
    out, fence, checked = [], None, True
    for number, line in enumerate(text.splitlines(), 1):
        opened = CODE_FENCE.match(line)
        if opened and fence is None:
            fence, checked = opened.group(1), opened.group(2) in ("", "text", "console-output")
            continue
        if fence is not None and line.strip().startswith(fence):
            fence, checked = None, True
            continue
        if not checked:
            continue
        prose = line if fence else re.sub(r"`[^`]*`", " ", re.sub(r"\]\([^)]*\)|<!--.*?-->|https?://\S+", " ", line))
        out += [(number, value, unit, " ".join(prose[max(0, start - 30):end + 30].split())) for value, unit, start, end in _pairs(prose)]
    return out


def _pairs(text: str) -> list[tuple[str, str | None, int, int]]:
    pairs = [(str(60 * int(m.group(1)) + int(m.group(2))), "s", m.start(), m.end()) for m in DURATION.finditer(text)]
    text = DURATION.sub(lambda m: " " * len(m.group(0)), text)
    for match in FIGURE.finditer(text):
        value, unit = match.group(1).replace("−", "-").replace(",", ""), match.group(2) or match.group(3) or match.group(4)
        if unit or SCIENTIFIC.search(value):
            pairs.append((value, UNITS[unit] if unit else None, match.start(), match.end()))
    return pairs


def backing_text(text: str, is_json: bool) -> dict[str | None, list[Decimal]]:
    """Every number each unit carries in a results text; in JSON, numbers without units (a fraction backs a percentage,
    a float a tolerance)."""
    seen: dict[str | None, list[Decimal]] = {}
    for value, unit, _, _ in _pairs(text):
        seen.setdefault(unit, []).append(Decimal(value))
    if is_json:
        seen.setdefault(None, []).extend(Decimal(v) for v in re.findall(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", text))
    return seen


def backed(value: str, unit: str | None, seen: dict[str | None, list[Decimal]]) -> bool:
    """The doc's figure is a results value as the doc rounds it: `97%` is backed by 97.2%, `1.3e-6` by 1.27e-06;
    percentages also by fractions (`0.972`, as summary.json holds them)."""
    quoted = Decimal(value)
    candidates = seen.get(unit, []) + ([v * 100 for v in seen.get(None, [])] if unit == "%" else [])
    for measured in candidates:
        try:
            if SCIENTIFIC.search(value):
                digits = len(value.lower().split("e")[0].replace("-", "").replace(".", "").lstrip("0")) or 1
                if measured != 0 and float(f"{float(measured):.{digits - 1}e}") == float(quoted):
                    return True
            elif measured.quantize(quoted) == quoted:
                return True
        except InvalidOperation:
            continue
    return False


def numbers(line: str) -> list[str]:
    return [m.replace("−", "-").replace(",", "") for m in re.findall(_NUMBER, line)]


def table_rows(paths: list[Path]) -> list[tuple[list[Decimal], set[str]]]:
    """The numbers and words of each line of these results files (JSON and tests excepted: they have no table rows)."""
    return [([Decimal(n) for n in numbers(line)], words(line)) for path in paths if path.suffix == ".md" for line in path.read_text().splitlines()]


def row_backed(row: str, rows: list[tuple[list[Decimal], set[str]]]) -> bool:
    """A doc's table row is one results line's: every number of the row, as it is there (tables are copied, not
    rounded), in that same line, so a cell is checked against its own row and not against any number in the file; a
    row of one or two numbers also shares a word with it."""
    wanted, named = [Decimal(n) for n in numbers(row)], words(row)
    return any(all(n in found for n in wanted) and (len(wanted) > 2 or named & found_words) for found, found_words in rows)


def words(text: str) -> set[str]:
    return {w.lower() for w in re.findall(r"[A-Za-z]{4,}", text)} - COMMON


def results_lines(paths: list[Path]) -> list[tuple[dict[str | None, list[Decimal]], set[str], bool]]:
    """Each line of these results files: its figures by unit, its words (a table row's include its table's header and
    the file's name: a row of numbers says what they are there), and whether it is a test's."""
    out = []
    for path in paths:
        lines, header, test = path.read_text().splitlines(), set(), path.suffix == ".py"
        for i, line in enumerate(lines):
            if line.lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"\s*\|\s*:?-{3,}", lines[i + 1]):
                header = words(line) | words(path.stem.replace("-", " ").replace("_", " "))
            named = words(line) | (header if line.lstrip().startswith("|") else set())
            out.append((backing_text(line, path.suffix in (".json", ".py")), named, test))
    return out


def prose_backed(value: str, unit: str | None, near: set[str], lines) -> bool:
    """A figure in a sentence is backed by a results line that holds it (at the doc's precision) and shares a word with
    the figure's line or the one before: a bare `2%` is not backed by any 2% in the file, but by the line that says what
    it is. A tolerance (`1e-5`) is backed by a cited test that holds a result to it."""
    return any((unit is None if test else bool(near & line_words)) and backed(value, unit, seen) for seen, line_words, test in lines)


@functools.lru_cache(maxsize=None)
def results(paths: tuple[Path, ...]) -> tuple[list[list[Decimal]], list]:
    """The cited results files' lines: as table rows (their numbers) and as text (figures by unit, words)."""
    return table_rows(list(paths)), results_lines(list(paths))


def unbacked_figures(text: str, only: int | None = None) -> tuple[list[tuple[int, str, str | None, str]], list[Path]]:
    """The figures of a document's text (of its line `only`, if given) that no results file it cites backs, and the
    files it cites."""
    cited = sorted({REPO / c.rstrip(".") for c in CITATION.findall(text)})
    rows, said = results(tuple(path for path in cited if path.is_file()))
    lines, out = text.splitlines(), []
    for line, value, unit, context in (f for f in figures(text) if only is None or f[0] == only):
        row, near = lines[line - 1], words(" ".join(lines[max(0, line - 2):line]))
        if not (row_backed(row, rows) if row.lstrip().startswith("|") else prose_backed(value, unit, near, said)):
            out.append((line, value, unit, context))
    return out, cited


def unbacked(where: str, text: str, owed: set[str], only: int | None = None) -> tuple[list[str], set[str]]:
    """One line for each figure in `text` (the document `where`; of its line `only`, if given) that neither a results
    file it cites nor the ledger of owed figures holds; and the ledger's entries this text used."""
    figures_left, cited = unbacked_figures(text, only)
    out = [f"{where}: cites {path.relative_to(REPO)}, which is not there" for path in cited if not path.is_file()]
    used = {owed_key(where, context) for _, _, _, context in figures_left} & owed
    source = ", ".join(str(p.relative_to(REPO)) for p in cited) or "no bench/results file"
    out += [f"{where}:{line}: {value}{' ' + unit if unit else ''} ({context!r}) is in none of the results files it cites ({source})"
            for line, value, unit, context in figures_left if owed_key(where, context) not in owed]
    return out, used


def owed_key(where: str, context: str) -> str:
    return f"{where}\t{context}"


def owed() -> set[str]:
    """bench/owed-figures.txt: figures quoted before this check existed whose command's output was not kept, each with
    its neighbours; each is to be re-measured into a results file (or dropped from the doc) and taken off. A figure
    edited by hand no longer has the neighbours its entry names, so it fails like any other."""
    lines = OWED.read_text().splitlines() if OWED.is_file() else []
    return {line for line in lines if line and not line.startswith("#")}


def documents() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def problems() -> list[str]:
    """Every unbacked figure, and every ledger entry no document quotes any more (the ledger only shrinks)."""
    ledger, out, used = owed(), [], set()
    for doc in documents():
        found, quoted = unbacked(str(doc.relative_to(REPO)), doc.read_text(), ledger)
        out, used = out + found, used | quoted
    return out + [f"{OWED.name}: no document quotes {entry!r} any more: take it off" for entry in sorted(ledger - used)]


def check() -> int:
    found = problems()
    print("\n".join(found) or f"docs-check: every figure in {len(documents())} documents is in a results file they cite "
          f"({len(owed())} owed: {OWED.name})")
    if found:
        print(f"docs-check: {len(found)} problems: re-measure (the results file's command), or correct the doc to what the "
              "results file says", file=sys.stderr)
    return 1 if found else 0


def changes_since(commit: str, paths: list[str]) -> list[str]:
    """Newest first; a file's commits from before it moved folders count too (--follow, one path at a time)."""
    seen: dict[str, str] = {}
    for path in paths:
        out = subprocess.run(["git", "log", "--follow", "--format=%ct %h %ad %s", "--date=short", f"{commit}..HEAD", "--", path], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            seen.setdefault(line.split(" ", 2)[1], line)
    return [line.split(" ", 1)[1][:100] for line in sorted(seen.values(), reverse=True)]


def stale() -> int:
    print("| figure | quoted in | measured at | commits since on its files | re-measure with |\n| --- | --- | --- | --- | --- |")
    for entry in json.loads(FIGURES.read_text()):
        since = changes_since(entry["measured_at"], entry["paths"])
        print(f"| {entry['figure']} | {entry['doc']} | {entry['measured_at']} | {len(since)}"
              f"{' (latest: ' + since[0] + ')' if since else ''} | `{entry['command']}` |")
    return 0


if __name__ == "__main__":
    sys.exit(stale() if "--stale" in sys.argv[1:] else check())
