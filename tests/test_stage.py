"""Ramdisk staging: real copies on /dev/shm, real file locks, a stager really killed mid-copy."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

from conftest import REPO, base_config, finetune_cli, finetune_in_process, read_jsonl, run_cli

from finetune.config.schema import validate_config
from finetune.model.stage import MANIFEST, PARTIAL, source_files, staged_name
from finetune.train import run


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_files(src, dest) -> None:
    manifest = json.loads((dest / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in source_files(src)} >= {"model.safetensors", "config.json", "tokenizer.json"}
    for name, want in manifest["files"].items():
        assert want["sha256"] == _sha(src / name) == _sha(dest / name), name


def test_stage_verifies_reuses_and_restages_when_the_source_changes(tmp_path, tiny_model_dir, ram_root, capsys):
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir, src)
    (src / "checkpoints").mkdir()  # a run's sub-folders stay behind
    (src / "checkpoints" / "big.bin").write_bytes(b"x" * 1000)
    root = ram_root / "reuse"
    dest = root / staged_name(src)

    first = finetune_cli(capsys, "stage", "--model", str(src), "--root", str(root))
    assert first.returncode == 0 and "staged in" in first.stdout, first.stderr
    _same_files(src, dest)
    assert not (dest / "checkpoints").exists()
    inode = (dest / "model.safetensors").stat().st_ino

    again = finetune_cli(capsys, "stage", "--model", str(src), "--root", str(root))
    assert "already staged and current" in again.stdout
    assert (dest / "model.safetensors").stat().st_ino == inode  # reused, not copied
    assert "current" in finetune_cli(capsys, "stage", "--list", "--root", str(root)).stdout

    # A changed source (size and mtime) is noticed by the listing and re-staged by the next stager.
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "note": "edited"}, indent=2))
    assert "stale (source changed)" in finetune_cli(capsys, "stage", "--list", "--root", str(root)).stdout
    assert "staged in" in finetune_cli(capsys, "stage", "--model", str(src), "--root", str(root)).stdout
    _same_files(src, dest)

    # Same size and mtime but other bytes: only a checksum sees it (--verify).
    weights = src / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "already staged" in finetune_cli(capsys, "stage", "--model", str(src), "--root", str(root)).stdout
    verified = finetune_cli(capsys, "stage", "--model", str(src), "--root", str(root), "--verify")
    assert "staged in" in verified.stdout, verified.stderr
    _same_files(src, dest)

    # A damaged copy (truncated in RAM) is not trusted either.
    with open(dest / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert "staged in" in finetune_cli(capsys, "stage", "--model", str(src), "--root", str(root)).stdout
    _same_files(src, dest)

    evicted = finetune_cli(capsys, "stage", "--evict", str(src), "--root", str(root))
    assert evicted.returncode == 0 and not dest.exists()
    assert "nothing staged" in finetune_cli(capsys, "stage", "--list", "--root", str(root)).stdout
    missing = finetune_cli(capsys, "stage", "--evict", "no-such-model", "--root", str(root))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


def test_a_stager_killed_mid_copy_leaves_nothing_trusted_and_the_next_one_redoes_it(tmp_path, demo_model_dir, ram_root):
    root = ram_root / "killed"
    # Chunks of 8 MiB: the 4th is the first half of the 13 MiB weights file (after three small files).
    killed = run_cli("stage", "--model", str(demo_model_dir), "--root", str(root), env={"FINETUNE_FAULT": "kill-staging@4"})
    assert killed.returncode == -9
    partial = [p for p in root.iterdir() if p.name.startswith(PARTIAL)]
    assert len(partial) == 1 and not (partial[0] / MANIFEST).exists()
    assert 0 < (partial[0] / "model.safetensors").stat().st_size < (demo_model_dir / "model.safetensors").stat().st_size
    assert not (root / staged_name(demo_model_dir)).exists()
    assert "partial" in run_cli("stage", "--list", "--root", str(root)).stdout

    redone = run_cli("stage", "--model", str(demo_model_dir), "--root", str(root))
    assert redone.returncode == 0 and "staged in" in redone.stdout, redone.stderr
    assert not any(p.name.startswith(PARTIAL) for p in root.iterdir())
    _same_files(demo_model_dir, root / staged_name(demo_model_dir))


def _until(job, words: str, seconds: float = 120) -> str:
    """The job's output up to the line holding `words` (a deadline, not a sleep, is what bounds the wait)."""
    deadline, seen = time.monotonic() + seconds, ""
    while words not in seen:
        assert time.monotonic() < deadline and job.poll() is None, f"no {words!r} from the job: {seen}"
        seen += job.stdout.readline()
    return seen


def test_concurrent_stagers_make_one_copy(tmp_path, demo_model_dir, ram_root):
    """Two stagers start while a third process holds the lock: both wait; then one copies, one reuses."""
    root = ram_root / "concurrent"
    root.mkdir(parents=True)
    name = staged_name(demo_model_dir)
    cmd = [sys.executable, "-m", "finetune", "stage", "--model", str(demo_model_dir), "--root", str(root)]
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as it is printed
        jobs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
        said = [_until(job, "waiting for it") for job in jobs]  # both found the lock held, and wait on it
        assert all(job.poll() is None for job in jobs)
    outputs = [(before + out, err) for before, (out, err) in zip(said, (job.communicate(timeout=120) for job in jobs))]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    assert sorted("staged in" in out for out, _ in outputs) == [False, True]
    assert sorted("already staged" in out for out, _ in outputs) == [False, True]
    assert [p.name for p in root.iterdir() if p.is_dir()] == [name]
    _same_files(demo_model_dir, root / name)


def test_runs_load_from_the_staged_copy_or_fall_back_when_it_does_not_fit(tmp_path, tiny_model_dir, ram_root, capsys):
    root = ram_root / "runs"
    refused = finetune_in_process("stage", "--model", str(tiny_model_dir), "--root", str(root), "--reserve-gib", "100000")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "less than model.ramdisk_reserve_gib=100000" in refused.stderr
    assert not [p for p in root.iterdir() if p.is_dir()]  # nothing half-made

    losses = {}
    for name, reserve in (("fallback", 100000), ("staged", 0)):
        cfg = validate_config(base_config(tiny_model_dir, tmp_path / name, model={"ramdisk": str(root), "ramdisk_reserve_gib": reserve},
                                          data={"eval": None}, train={"max_steps": 3, "lr": 1e-2}), "test")
        summary = run(cfg).summary
        losses[name] = [r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r]
        adapter = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str(tiny_model_dir)  # the source, never the RAM copy
        if name == "fallback":
            assert summary["model_loaded_from"] == str(tiny_model_dir)
            assert "warning: model.ramdisk: staging" in capsys.readouterr().err
        else:
            assert summary["model_loaded_from"] == str(root / staged_name(tiny_model_dir))
    assert losses["staged"] == losses["fallback"]  # bit for bit: the same weights
