"""The benchmark harness (bench/compare.py) at tiny sizes: both trainers run, every column is filled."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_compare_runs_both_trainers_and_fills_the_table(tmp_path):
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "compare.py"), "--quick", "--repeats", "1", "--runners", "finetune,hf-bf16-flatten",
         "--work", str(tmp_path / "work"), "--results", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = (tmp_path / "results" / "compare-quick.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ") and not line.startswith("| runner")}
    assert set(rows) == {"finetune", "hf-bf16-flatten"}
    for name, cells in rows.items():
        assert len(cells) == 8 and all(cells), (name, cells)
        tok_s, first_step, rss, eval_loss = float(cells[2]), float(cells[4]), float(cells[5]), float(cells[6])
        assert tok_s > 0 and 0 < first_step < 300 and rss > 100 and 0 < eval_loss < 20, (name, cells)
        assert cells[7].endswith("%")
    assert rows["hf-bf16-flatten"][3] == "1.00x"  # the only peer is the best peer
    assert "bf16" in table and "GFLOP/s" in table and "bare script" in table
    assert (tmp_path / "results" / "compare-quick.png").stat().st_size > 10_000
    # One epoch each: the peer trains every token; finetune may leave out a last odd micro-batch.
    import json

    results = json.loads((tmp_path / "work" / "results.json").read_text())["results"]
    total = json.loads((tmp_path / "work" / "settings.json").read_text())["tokens"]
    assert results["hf-bf16-flatten"][0]["tokens"] == total
    assert 0.7 * total <= results["finetune"][0]["tokens"] <= total
    assert f"{results['finetune'][0]['tokens']:,}" in table
    # The matmuls of finetune's steps, timed alone: forward and backward of every kind. How the bound
    # compares with the steps' speed is the benchmark's figure, not the test's: timings vary with load.
    bound = json.loads((tmp_path / "work" / "results.json").read_text())["matmuls"]
    assert set(bound["kinds"]) == {"base", "lora", "attention", "head"}, bound
    assert all(k["seconds"] > 0 and k["gflop"] > 0 for k in bound["kinds"].values())
    assert "Matmuls alone" in table
