"""Figures in docs/ that a cheap command produces are held to it: a figure edited by hand, or left behind by a
change to the code that produces it, fails here (`make test-fast` runs this). Figures from benches that take
minutes or a GPU name their date and commit beside them instead."""

from __future__ import annotations

import re

from conftest import REPO, bench_module


def test_the_plan_table_in_planning_md_is_what_bench_plan_table_prints():
    table = bench_module("plan_table").table

    docs = (REPO / "docs" / "planning.md").read_text()
    for line in table():
        assert line in docs, f"docs/planning.md lacks, or has another version of: {line}"


def test_the_scale_table_in_planning_md_is_the_simulations_kept_beside_todays_plan():
    """bench/results/scale.json keeps `make bench-scale`'s simulations (an hour and more); the plan beside them is
    computed now: a change to the planner that moves a row fails here until the table is printed again."""
    docs = (REPO / "docs" / "planning.md").read_text()
    for line in bench_module("scale").table():
        assert line in docs, f"docs/planning.md lacks, or has another version of: {line}"


def test_the_count_of_bad_input_cases_is_the_tests():
    from test_bad_input import _cases

    said = re.search(r"runs (\d+) such cases", (REPO / "docs" / "checkpoints.md").read_text())
    assert said and int(said.group(1)) == len(_cases()), (said and said.group(1), len(_cases()))


def test_every_figure_in_the_docs_is_in_a_results_file_they_cite():
    """`make lint` runs bench/docs_check.py: a figure (a number with a unit) in README.md or docs/ that no cited results
    file holds, and no ledger entry owes, fails it."""
    assert bench_module("docs_check").problems() == []


def _edited(text: str, line: int, value: str, unit: str | None, pairs) -> str | None:
    """TEXT with the figure's last digit moved by 3, as a hand edit would change it (None: not found on its line)."""
    lines = text.splitlines()
    for found, found_unit, start, end in pairs(lines[line - 1]):
        if (found, found_unit) == (value, unit):
            raw = lines[line - 1][start:end]
            digits = [i for i, c in enumerate(raw.lower().split("e")[0]) if c.isdigit()]
            raw = raw[:digits[-1]] + str((int(raw[digits[-1]]) + 3) % 10) + raw[digits[-1] + 1:]
            lines[line - 1] = lines[line - 1][:start] + raw + lines[line - 1][end:]
            return "\n".join(lines)
    return None


def test_a_figure_edited_by_hand_fails_docs_check():
    """Every figure of README.md and docs/, backed or owed, edited alone: docs-check names its line. A changed number
    can by chance be another figure of a results line that shares a word with its sentence (a 2% that became 5%
    beside another 5% of the same bench); at most 5% get through that way."""
    docs_check = bench_module("docs_check")
    ledger, caught, through = docs_check.owed(), 0, []
    for doc in docs_check.documents():
        where, text = str(doc.relative_to(REPO)), doc.read_text()
        for line, value, unit, _ in docs_check.figures(text):
            edited = _edited(text, line, value, unit, docs_check._pairs)
            if edited is None:  # inside inline code on its line: figures() read the line without it
                continue
            if any(p.startswith(f"{where}:{line}:") for p in docs_check.unbacked(where, edited, ledger, only=line)[0]):
                caught += 1
            else:
                through.append(f"{where}:{line}: {value} {unit}")
    assert caught > 800 and len(through) <= 0.05 * (caught + len(through)), through


def test_a_ledger_entry_no_doc_quotes_fails_docs_check(tmp_path, monkeypatch):
    docs_check = bench_module("docs_check")
    ledger = tmp_path / "owed.txt"
    ledger.write_text((docs_check.OWED.read_text() if docs_check.OWED.is_file() else "") + "docs/running.md\tno such figure 9.9 GiB\n")
    monkeypatch.setattr(docs_check, "OWED", ledger)
    assert docs_check.problems() == ["owed.txt: no document quotes 'docs/running.md\\tno such figure 9.9 GiB' any more: take it off"]


def test_each_measured_figure_names_the_commit_it_was_measured_at():
    """bench/figures.json lists the figures a bench or a GPU measured; `make docs-check` counts the commits on their
    files since. Each doc quotes its figure's commit, and the commit is in this repository's history."""
    import json
    import subprocess

    for entry in json.loads((REPO / "bench" / "figures.json").read_text()):
        assert entry["measured_at"] in (REPO / entry["doc"]).read_text(), entry
        assert subprocess.run(["git", "cat-file", "-e", f"{entry['measured_at']}^{{commit}}"], cwd=REPO).returncode == 0, entry
        assert all((REPO / path).exists() for path in entry["paths"]), entry


def test_the_layer_diagram_in_architecture_md_is_the_contracts():
    diagram = bench_module("layers").diagram

    assert diagram() in (REPO / "docs" / "architecture.md").read_text(), "docs/architecture.md: paste `python bench/layers.py`"
