"""The benchmark harness (bench/compare.py) at tiny sizes: both trainers run, every column is filled."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, bench_module


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
    # "vs best peer" is each runner's real tokens/s over the fastest peer's (the one peer here), as the cells print them
    ours, peer = float(rows["finetune"][2]), float(rows["hf-bf16-flatten"][2])
    slack = 0.005 + ours / peer * (0.5 / ours + 0.5 / peer)  # the ratio's rounding, and the tokens/s cells' (whole numbers)
    assert abs(float(rows["finetune"][3].rstrip("x")) - ours / peer) <= slack, (rows, ours / peer)
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


def test_the_gpu_path_syncs_the_host_once_a_step_whatever_the_samples_in_a_row(tmp_path, tiny_model_dir):
    """bench/host.py's counters on finetune's own step with the CUDA branch selected on CPU (make
    bench-host measures the 1.1B shape): one host sync a step (the step's numbers read back), and the
    same operators whether a row holds a few samples or many."""
    import json

    host = bench_module("host")

    words = " ".join(json.loads(line)["text"] for line in (REPO / "demo" / "data" / "corpus.jsonl").read_text().splitlines()[:300]).split()
    runs = {}
    for name, size in (("long", 40), ("short", 6)):
        work = tmp_path / name
        work.mkdir()
        (work / "model").symlink_to(tiny_model_dir)
        rows = [{"instruction": "Continue.", "input": " ".join(words[i : i + size]), "output": " ".join(words[i + size : i + 2 * size])}
                for i in range(0, 60 * size, size)]
        (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        counter = host.Counter()
        calls = host.Calls(counter)
        with counter, calls:
            result = host.finetune_steps(work, 4, counter, seq=256)
        runs[name] = (result["samples_per_row"], sum(counter.ops.values()) / 3, dict(host.syncs(counter, calls)))
    (long_samples, long_ops, long_syncs), (short_samples, short_ops, short_syncs) = runs["long"], runs["short"]
    assert short_samples > 2 * long_samples, runs
    assert long_syncs == short_syncs == {".tolist()": 3}, runs  # 3 counted steps
    assert long_ops == short_ops, runs


def test_the_grpo_benchmark_runs_trl_with_our_settings(tmp_path):
    """A peer runs with the same settings or the table is no comparison: TRL's defaults that differ from ours
    (gradient checkpointing on in TRL 1.16) are set to ours."""
    grpo = bench_module("grpo")
    our_config, trl_args = grpo.our_config, grpo.trl_args

    from finetune.config.schema import validate_config

    ours = validate_config(our_config(tmp_path / "model", 12, tmp_path / "out"), "bench")
    theirs = trl_args(12, tmp_path / "trl")
    assert theirs.gradient_checkpointing is ours.train.gradient_checkpointing is False
    pairs = [(ours.grpo.temperature, theirs.temperature), (ours.grpo.top_k, theirs.top_k), (ours.grpo.top_p, theirs.top_p),
             (ours.grpo.num_generations, theirs.num_generations), (ours.grpo.max_completion_length, theirs.max_completion_length),
             (ours.grpo.loss_type, theirs.loss_type), (ours.grpo.beta, theirs.beta), (ours.grpo.epsilon, theirs.epsilon),
             (ours.grpo.num_iterations if hasattr(ours.grpo, "num_iterations") else 1, theirs.num_iterations),
             (ours.grpo.scale_rewards, theirs.scale_rewards), (ours.grpo.ratio, theirs.importance_sampling_level), (ours.train.lr, theirs.learning_rate),
             (ours.train.micro_batch_size * ours.grpo.num_generations, theirs.per_device_train_batch_size)]
    assert all(a == b for a, b in pairs), pairs
