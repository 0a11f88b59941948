"""DDP and FSDP2 over gloo with 2 real processes, against one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, base_config, read_jsonl, run_cli, write_config


def _train(tmp_path, name, model_dir, method, nproc, strategy="ddp"):
    out = tmp_path / name
    # Global batch 4 rows either way: 1 process x micro 4, or 2 processes x micro 2 (the same rows).
    cfg = base_config(model_dir, out, adapter={"method": method}, data={"eval": None},
                      train={"max_steps": 4, "micro_batch_size": 4 // nproc, "lr": 1e-2 if method != "full" else 1e-3},
                      distributed={"strategy": strategy})
    config = str(write_config(tmp_path / f"{name}.yaml", cfg))
    if nproc == 1:
        result = run_cli("train", "--config", config)
    else:
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                                 "finetune/train.py", "--config", config], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    return out, losses, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("single")
    return {m: _train(tmp, f"single-{m}", tiny_model_dir, m, 1) for m in ("lora", "full")}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_processes_match_one(tmp_path, tiny_model_dir, single, strategy, method):
    out, losses, summary = _train(tmp_path, "two", tiny_model_dir, method, 2, strategy)
    _, ref_losses, ref = single[method]
    assert summary["world_size"] == 2 and summary["strategy"] == strategy
    assert len(losses) == len(ref_losses) == 4
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5), (losses, ref_losses)
    trainable = ref["param_numel_per_rank"][0]
    shards = summary["param_numel_per_rank"]
    if strategy == "fsdp":  # really sharded: each rank holds about half
        assert all(n <= trainable / 2 + 1024 for n in shards) and sum(shards) >= trainable, (shards, trainable)
    else:
        assert shards == [trainable, trainable] and summary["replicas_identical"] is True


def test_fsdp_gathered_adapter_loads_in_one_process_and_equals_the_trained_one(tmp_path, tiny_model_dir, single):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, _, _ = _train(tmp_path, "fsdp", tiny_model_dir, "lora", 2, "fsdp")
    ids = torch.randint(5, 200, (2, 24))
    logits = []
    for adapter in (out, single["lora"][0]):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids, use_cache=False).logits)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        untuned = base(input_ids=ids, use_cache=False).logits
    assert (logits[0] - logits[1]).abs().max() < 1e-4
    assert (logits[0] - untuned).abs().max() > 1e-3  # not an empty or partial adapter


def test_a_rank_that_raises_stops_the_whole_job_quickly(tmp_path, tiny_model_dir):
    import time

    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"max_steps": 200, "micro_batch_size": 2})
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "FINETUNE_FAULT": "raise@3:rank=1"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "finetune/train.py",
                             "--config", str(write_config(tmp_path / "c.yaml", cfg))], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "injected fault on rank 1 at step 3" in result.stderr
    assert time.monotonic() - started < 60  # no hang in a collective until a timeout
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.parametrize("strategy,ok", [("ddp", False), ("fsdp", True)])
def test_accelerate_fsdp_config_needs_the_run_config_to_agree(tmp_path, tiny_model_dir, strategy, ok):
    cfg = base_config(tiny_model_dir, tmp_path / "out", train={"max_steps": 2, "micro_batch_size": 2}, distributed={"strategy": strategy})
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/fsdp.yaml",
                             "--main_process_port", "29613", "finetune/train.py", "--config", str(write_config(tmp_path / "c.yaml", cfg))],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["strategy"] == "fsdp" and summary["world_size"] == 2
    else:
        assert result.returncode != 0
        assert "accelerate config asks for FSDP but the run config has distributed.strategy: ddp" in result.stderr
