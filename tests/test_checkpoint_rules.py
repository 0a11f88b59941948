"""Checkpoint bookkeeping on its own (milliseconds each): manifests, which folders count, which are
kept, which one a rollback goes to, and which config changes a resume accepts. The real runs that
rely on them are in test_checkpoint.py and test_guard.py."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.checkpoint import store
from finetune.checkpoint.resume import config_changes
from finetune.config.schema import validate_config


def _write(root, step: int, good: bool = True, best: list | None = None, keep_last: int = 100):
    """A complete checkpoint as rank 0 writes it (weights, state, manifest, rename)."""
    tmp = root / f".step-{step:06d}.tmp"
    tmp.mkdir(parents=True)
    state = {"step": step, "tokens": 10 * step, "good": good, "guard": {"best": best}}
    files = {store.WEIGHTS: {"w": torch.full((3,), float(step))}, "trainer_state.json": json.dumps(state)}
    return store.complete(tmp, root, step, files, keep_last)


def test_a_complete_checkpoint_verifies_and_each_kind_of_damage_is_named(tmp_path):
    path = _write(tmp_path, 4)
    assert store.verify(path) is None
    weights = path / store.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert store.verify(path) == f"{store.WEIGHTS} fails its checksum"
    assert store.verify(path, checksums=False) is None  # same size: only the checksum sees it
    weights.write_bytes(bytes(data[:-1]))
    assert store.verify(path, checksums=False) == f"{store.WEIGHTS} has {len(data) - 1} bytes, expected {len(data)}"
    weights.unlink()
    assert store.verify(path) == f"{store.WEIGHTS} is missing"
    (path / store.MANIFEST).write_text("{not json")
    assert store.verify(path) == "unreadable manifest"
    (path / store.MANIFEST).write_text(json.dumps({"x": {"size": 1}}))
    assert store.verify(path) == "manifest entry x lacks its size or checksum"
    (path / store.MANIFEST).unlink()
    assert store.verify(path) == "no manifest (an interrupted save)"


def test_only_step_folders_count_and_in_step_order(tmp_path):
    for name in ("step-000010", "step-000002", ".step-000012.tmp", "step-abc", "stepping", "step-1000000"):
        (tmp_path / name).mkdir()
    assert [p.name for p in store.step_dirs(tmp_path)] == ["step-000002", "step-000010", "step-1000000"]
    assert store.step_of(tmp_path / "step-000010") == 10 and store.step_of(tmp_path / "step-abc") is None


def test_the_newest_complete_checkpoint_is_found_and_damaged_newer_ones_are_reported(tmp_path):
    root = store.checkpoint_root(tmp_path)
    _write(root, 2)
    newest = _write(root, 4)
    (root / ".step-000006.tmp").mkdir()  # a save killed midway
    (newest / "trainer_state.json").write_text("{}")  # shorter than its manifest says
    found = store.find_latest(tmp_path)
    assert found.path == root / "step-000002"
    assert found.skipped == [f"checkpoint {newest} skipped: trainer_state.json has 2 bytes, expected "
                             f"{json.loads((newest / store.MANIFEST).read_text())['trainer_state.json']['size']}"]


def test_a_rollback_goes_to_the_newest_good_checkpoint_at_or_before_the_trouble(tmp_path):
    root = store.checkpoint_root(tmp_path)
    for step, good in ((2, True), (4, True), (6, False), (8, True)):
        _write(root, step, good)
    assert store.find_good(tmp_path, 7) == root / "step-000004"  # 6 was saved in an anomalous window
    assert store.find_good(tmp_path, 8) == root / "step-000008"
    assert store.find_good(tmp_path, 1) is None


def test_retention_keeps_the_last_k_the_newest_good_and_the_good_one_before_the_best_loss(tmp_path):
    root = store.checkpoint_root(tmp_path)
    for step, good in ((1, True), (2, True), (3, True), (4, False), (5, False)):
        _write(root, step, good, best=[2, 1.5], keep_last=2)
    assert [p.name for p in store.step_dirs(root)] == ["step-000002", "step-000003", "step-000004", "step-000005"]
    # 4, 5: the last two; 3: the newest good one; 2: the newest good one no later than the best loss (step 2)


def test_retention_never_deletes_the_only_complete_checkpoint(tmp_path):
    root = store.checkpoint_root(tmp_path)
    _write(root, 3, good=False, keep_last=0)
    assert [p.name for p in store.step_dirs(root)] == ["step-000003"]


@pytest.fixture
def run_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n')
    raw = {"model": {"name_or_path": str(model)}, "data": {"train": str(tmp_path / "train.jsonl"), "format": "completion"},
           "train": {"output_dir": str(tmp_path / "out"), "lr": 1e-3}}
    return raw, validate_config(raw, "test")


def test_a_resume_accepts_changes_of_how_the_run_goes_on_and_names_those_of_what_is_trained(run_config):
    raw, cfg = run_config
    saved = cfg.model_dump(mode="json")
    assert config_changes(saved, cfg) == ([], [])
    changed = validate_config({**raw, "train": {**raw["train"], "lr": 5e-4, "max_steps": 50, "seed": 7},
                               "adapter": {"r": 32}, "logging": {"plot": False}}, "test")
    breaking, harmless = config_changes(saved, changed)
    assert breaking == ["adapter.r: 16 -> 32", "train.seed: 42 -> 7"]
    assert harmless == ["logging.plot: true -> false", "train.lr: 0.001 -> 0.0005", "train.max_steps: null -> 50"]
    # A checkpoint of an earlier finetune, without settings added since: they ran as their defaults do
    older = {**saved, "grpo": {k: v for k, v in saved["grpo"].items() if k != "num_iterations"}}
    older.pop("distill")
    assert config_changes(older, cfg) == ([], [])


def test_a_resume_at_another_process_count_keeps_the_global_batch_or_says_why_it_cannot(tmp_path, run_config):
    from finetune.config.files import to_yaml
    from finetune.config.schema import CONFIG_FILE
    from finetune.run.elastic import BatchUnreachable, batch_for_world

    raw, _ = run_config
    config = lambda train=None, **sections: validate_config({**raw, "train": {**raw["train"], "micro_batch_size": 2, "grad_accum": 3, **(train or {})},  # noqa: E731
                                                             **sections}, "test")
    path = _write(tmp_path / "checkpoints", 4)
    (path / CONFIG_FILE).write_text(to_yaml(config()))
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "world_size": 4}))  # 2 x 3 x 4 = 24 rows a step (no batch recorded: an older one)
    batch = {"rows": 24, "configured": [2, 3]}
    resized, message, recorded = batch_for_world(config(), path, 3)
    assert resized.train.grad_accum == 4 and message.endswith("at 3: train.grad_accum 4, 24 rows per step kept") and recorded == batch
    assert batch_for_world(config(), path, 4) == (config(), None, batch)
    # A batch the user set (another micro-batch or accumulation) is theirs from there on, at any count
    assert batch_for_world(config({"grad_accum": 5}), path, 4) == (config({"grad_accum": 5}), None, {"rows": 40, "configured": [2, 5]})
    assert batch_for_world(config({"micro_batch_size": 4}), path, 1) == (config({"micro_batch_size": 4}), None, {"rows": 12, "configured": [4, 3]})
    assert batch_for_world(config(), None, 3) == (config(), None, {"rows": 18, "configured": [2, 3]})  # a fresh start
    with pytest.raises(BatchUnreachable, match=r"by 4 process\(es\) at 24 rows per step; at 5, micro_batch_size 2 x grad_accum N x 5 cannot make 24"):
        batch_for_world(config(), path, 5)
    flexible = batch_for_world(config(distributed={"elastic_batch": "flexible"}), path, 5)
    assert flexible[0].train.grad_accum == 2 and "20 rows per step instead of 24 (distributed.elastic_batch: flexible)" in flexible[1]
    assert flexible[2] == batch  # the run's batch stays the target: back at 4 or 2 processes it is exact again
    # Written at 2 processes after a resize (accumulation 6 in its config, the batch recorded): resumed at 2 again, still 24 rows
    (path / CONFIG_FILE).write_text(to_yaml(config({"grad_accum": 6})))
    (path / "trainer_state.json").write_text(json.dumps({**state, "world_size": 2, "batch": batch}))
    resized, message, _ = batch_for_world(config(), path, 2)
    assert resized.train.grad_accum == 6 and message.endswith("at 2: train.grad_accum 6, 24 rows per step kept")
    # Sequence parallelism: the data world (processes / N) sets the batch. Written by 4 processes in 2 pairs (2 x 3 x 2 = 12 rows),
    # resumed by one pair (accumulation 6) or by 6 processes in 3 pairs (accumulation 2); 3 processes cannot form pairs: one line
    from finetune.config.errors import UserError
    from finetune.run.preflight import check_group

    sp = config(distributed={"sequence_parallel": 2})
    (path / CONFIG_FILE).write_text(to_yaml(sp))
    (path / "trainer_state.json").write_text(json.dumps({**state, "world_size": 4, "batch": {"rows": 12, "configured": [2, 3]}}))
    resized, message, _ = batch_for_world(sp, path, 2)
    assert resized.train.grad_accum == 6 and message.endswith("at 2: train.grad_accum 6, 12 rows per step kept")
    assert batch_for_world(sp, path, 6)[0].train.grad_accum == 2
    with pytest.raises(UserError, match="sequence_parallel: 2 does not divide the 3 processes started; start a multiple of 2"):
        check_group("sequence_parallel", 2, 3)
