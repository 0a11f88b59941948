"""finetune eval: lm-evaluation-harness tasks on a model or base + adapter, through the harness's
Python API; the demo's shipped task rises with training, and equals the harness's own CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, finetune_cli

pytest.importorskip("lm_eval")

TASK = str(REPO / "demo" / "eval" / "word_kind.yaml")


def test_the_demo_task_rises_with_training_and_equals_the_harness_cli(tmp_path, demo_model_dir, demo_run, capsys, monkeypatch):
    """Before the demo's 60 steps (the base) and after (base + adapter), then the adapter merged and
    scored by `lm_eval --model hf` itself: the same accuracy to the last digit. Without --out the results go to the
    current folder under a name not taken, never into the model's folder."""
    out, _ = demo_run
    monkeypatch.chdir(tmp_path)
    (tmp_path / "harness_eval.json").write_text("not ours")
    before = sorted(p.name for p in demo_model_dir.iterdir())
    scores = {}
    for name, source, file in (("base", ["--model", str(demo_model_dir)], "harness_eval-2.json"), ("tuned", ["--adapter", str(out)], "tuned.json")):
        result = finetune_cli(capsys, "eval", *source, "--tasks", TASK, *(["--out", file] if name == "tuned" else []))
        assert result.returncode == 0, result.stderr
        scores[name] = json.loads((tmp_path / file).read_text())["results"]["finetune_word_kind"]
    assert (tmp_path / "harness_eval.json").read_text() == "not ours" and sorted(p.name for p in demo_model_dir.iterdir()) == before
    assert scores["base"]["sample_len"] == scores["tuned"]["sample_len"] == 36
    assert scores["tuned"]["acc"] > scores["base"]["acc"] + 0.2, scores
    merged = tmp_path / "merged"
    assert finetune_cli(capsys, "merge", "--adapter", str(out), "--out", str(merged), "--dtype", "fp32").returncode == 0
    cli = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={merged},dtype=float32",
                          "--tasks", "finetune_word_kind", "--include_path", ".", "--apply_chat_template", "--device", "cpu",
                          "--batch_size", "8", "--output_path", str(tmp_path / "cli")], cwd=REPO / "demo" / "eval",
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    found = json.loads(next((tmp_path / "cli").rglob("results_*.json")).read_text())["results"]["finetune_word_kind"]
    assert found["acc,none"] == pytest.approx(scores["tuned"]["acc"], abs=1e-9), (found, scores)


def test_bad_eval_input_is_one_line(tmp_path, tiny_model_dir, capsys):
    def refused(*args):
        result = finetune_cli(capsys, "eval", *args)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        return result.stderr

    assert "--tasks: file not found: nope.yaml" in refused("--model", str(tiny_model_dir), "--tasks", "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: missing.jsonl\n")
    assert "data file not found" in refused("--model", str(tiny_model_dir), "--tasks", str(bad))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert "expected a task in lm-evaluation-harness's format" in refused("--model", str(tiny_model_dir), "--tasks", str(tmp_path / "list.yaml"))
