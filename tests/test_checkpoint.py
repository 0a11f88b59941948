"""Checkpoints: kill -9 and resume with identical losses; corrupted checkpoints are skipped."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import base_config, finetune_in_process, step_losses, train_forked, write_config


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir):
    """An uninterrupted run: 12 steps with dropout (so RNG state matters) and AdamW."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = base_config(tiny_model_dir, tmp / "out", adapter={"dropout": 0.1}, data={"eval": None}, train={"max_steps": 12})
    result = finetune_in_process("train", "--config", str(write_config(tmp / "c.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    return cfg, step_losses(tmp / "out")


def _run(tmp_path, cfg, *extra, env=None):
    """`finetune train`: in this process, or a fresh one where the injected fault kills it."""
    config = str(write_config(tmp_path / "c.yaml", cfg))
    if env:
        return train_forked("--config", config, *extra, env=env)
    return finetune_in_process("train", "--config", config, *extra)


@pytest.fixture(scope="module")
def killed_at_9(tmp_path_factory, reference):
    """The reference's config in a fresh process, SIGKILLed at the start of step 9 (after the step-8 checkpoint):
    its output folder, which each test copies before resuming (or damaging) it."""
    cfg, _ = reference
    tmp = tmp_path_factory.mktemp("killed")
    killed = _run(tmp, {**cfg, "train": {**cfg["train"], "output_dir": str(tmp / "out")}}, "--save-every", "4", env={"FINETUNE_FAULT": "kill@9"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    return tmp / "out"


def _killed_copy(tmp_path, killed_at_9, reference) -> tuple[dict, Path]:
    """A copy of the killed run's folder, and the config that resumes it."""
    shutil.copytree(killed_at_9, tmp_path / "out")
    cfg, _ = reference
    return {**cfg, "train": {**cfg["train"], "output_dir": str(tmp_path / "out")}}, tmp_path / "out"


def test_kill_9_then_resume_gives_the_same_losses(tmp_path, reference, killed_at_9):
    cfg, out = _killed_copy(tmp_path, killed_at_9, reference)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000000", "step-000004", "step-000008"]  # the start too
    resumed = _run(tmp_path, cfg, "--save-every", "4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "step-000008 at step 8" in resumed.stdout
    assert step_losses(out) == reference[1]  # bitwise: the same floats, step for step
    assert json.loads((out / "summary.json").read_text())["steps"] == 12


@pytest.mark.parametrize("damage", ["truncate", "delete", "no-manifest"])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, reference, killed_at_9, damage):
    cfg, out = _killed_copy(tmp_path, killed_at_9, reference)
    newest = out / "checkpoints" / "step-000008"
    if damage == "truncate":
        path = newest / "optimizer.pt"
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "delete":
        os.remove(newest / "trainable.safetensors")
    else:
        os.remove(newest / "manifest.json")
    resumed = _run(tmp_path, cfg, "--save-every", "4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"checkpoint {newest} skipped" in resumed.stdout
    assert "step-000004 at step 4" in resumed.stdout
    assert step_losses(out) == reference[1]


def test_retention_keeps_the_last_k(tmp_path, tiny_model_dir):
    cfg = base_config(tiny_model_dir, tmp_path / "out", data={"eval": None}, train={"max_steps": 10},
                      checkpoint={"save_every": 2, "keep_last": 2})
    assert _run(tmp_path, cfg).returncode == 0
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["step-000006", "step-000008"]


def test_resume_from_a_bad_path_is_one_line(tmp_path, tiny_model_dir):
    cfg = base_config(tiny_model_dir, tmp_path / "out", checkpoint={"resume": str(tmp_path / "nope")})
    result = _run(tmp_path, cfg)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'c.yaml'}: checkpoint.resume: expected auto, never or a checkpoint folder; "
        f"no folder {tmp_path / 'nope'} (got \"{tmp_path / 'nope'}\")"
    ]  # refused before anything is tokenized or loaded


def test_resume_from_a_damaged_checkpoint_path_is_refused(tmp_path, tiny_model_dir):
    (tmp_path / "ckpt").mkdir()
    cfg = base_config(tiny_model_dir, tmp_path / "out", checkpoint={"resume": str(tmp_path / "ckpt")})
    result = _run(tmp_path, cfg)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint.resume: {tmp_path / 'ckpt'}: no manifest (an interrupted save)")



def test_after_a_resume_the_next_batches_are_bit_identical(tmp_path, tiny_model_dir):
    """The batches of every step are a function of the step alone: computed afresh (as a resumed
    process does) they equal, token for token, those of the uninterrupted run, across epochs and
    around a skipped data window."""
    import torch

    from finetune.config.schema import validate_config
    from finetune.data import datasets
    from finetune.data.datasets import batches_at, load_data, plan_steps
    from finetune.model.loading import load_tokenizer
    from finetune.run.guard import data_step

    cfg = validate_config(base_config(tiny_model_dir, tmp_path / "out", data={"eval": None}, train={"micro_batch_size": 16, "grad_accum": 2}), "test")
    tok = load_tokenizer(cfg.model)
    data = load_data(cfg.data, tok, cfg.train.seed)
    schedule = plan_steps(cfg, len(data.train), world=1)
    windows = [[5, 3]]
    steps = range(0, 2 * schedule.steps_per_epoch + 2)

    def ids(step):
        _, batches, _ = batches_at(data, cfg, schedule, data_step(step, windows), 0, 1, tok.pad_token_id)
        return [b["input_ids"] for b in batches]

    uninterrupted = [ids(s) for s in steps]
    datasets._epoch_batches.cache_clear()  # a resumed process starts with nothing cached
    resumed = [ids(s) for s in steps[7:]]
    assert all(torch.equal(a, b) for x, y in zip(uninterrupted[7:], resumed) for a, b in zip(x, y))
    assert not torch.equal(uninterrupted[4][0], uninterrupted[5][0])
    assert torch.equal(uninterrupted[5][0], batches_at(data, cfg, schedule, 8, 0, 1, tok.pad_token_id)[1][0]["input_ids"])


def test_a_background_save_writes_the_same_bytes_as_a_synchronous_one(tmp_path, reference):
    cfg, expected = reference
    manifests = {}
    for mode in ("true", "false"):
        out = tmp_path / mode
        run = {**cfg, "train": {**cfg["train"], "output_dir": str(out)}}
        result = _run(tmp_path, run, "--save-every", "4", "--set", f"checkpoint.async_save={mode}")
        assert result.returncode == 0, result.stderr[-2000:]
        assert step_losses(out) == expected
        manifests[mode] = {p.name: json.loads((p / "manifest.json").read_text()) for p in (out / "checkpoints").iterdir()}
        for files in manifests[mode].values():
            assert files.pop("finetune_config.yaml")  # differs by the output_dir and async_save
    assert sorted(manifests["true"]) == ["step-000000", "step-000004", "step-000008"]
    assert manifests["true"] == manifests["false"]  # every other file's size and sha256


def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, reference):
    cfg, expected = reference
    out = tmp_path / "out"
    cfg = {**cfg, "train": {**cfg["train"], "output_dir": str(out)}}
    killed = _run(tmp_path, cfg, "--save-every", "4", "--set", "checkpoint.async_save=true", env={"FINETUNE_FAULT": "kill-saving@8"})
    assert killed.returncode == -9  # SIGKILL from the writer thread, once the first file of step 8's checkpoint is written
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".step-000008.tmp", "step-000000", "step-000004"]
    assert not (out / "checkpoints" / ".step-000008.tmp" / "manifest.json").exists()
    resumed = _run(tmp_path, cfg, "--save-every", "4", "--set", "checkpoint.async_save=true")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-000004 at step 4" in resumed.stdout
    assert step_losses(out) == expected


def test_a_background_save_holds_the_weights_of_its_step_once_staged(tmp_path):
    """The writer copies the state after save() returns; an optimizer step may change it in place only
    after staged(). The change below comes at once, before a copy of 64 MB could be done by itself."""
    import torch
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from finetune.checkpoint import store
    from finetune.checkpoint.checkpointers import Checkpointer

    model = torch.nn.Linear(4096, 4096)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 4096)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    momentum = optimizer.state[model.weight]["momentum_buffer"].clone()
    checkpointer = Checkpointer(model, optimizer, scheduler, Accelerator(cpu=True))
    path = checkpointer.save(tmp_path, {"step": 1, "tokens": 0}, "x: 1\n", keep_last=1, background=True)
    checkpointer.staged()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        optimizer.state[model.weight]["momentum_buffer"].add_(1.0)
    checkpointer.wait()
    assert store.verify(path) is None
    saved = load_file(path / store.WEIGHTS)
    assert all(torch.equal(saved[name], before[name]) for name in before)
    state = torch.load(path / "optimizer.pt", weights_only=True)["state"]
    assert torch.equal(state[0]["momentum_buffer"], momentum)
