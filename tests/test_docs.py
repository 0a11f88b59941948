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
