"""Hardening with real processes: one run per output directory, workers that outlive their launcher
stop, and no command deletes or overwrites files it did not write."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, base_config, finetune_in_process, read_jsonl, torchrun, write_config

from finetune.checkpoint.locks import LOCK_FILE
from finetune.checkpoint.store import verify


def _cfg(model_dir, out, steps=400):
    return base_config(model_dir, out, train={"max_steps": steps, "lr": 1e-3}, data={"eval": None}, watchdog={"enabled": False})


def _wait_for_rows(metrics: Path, job, rows: int, seconds: float = 600) -> None:
    """Until the job has logged `rows` rows; a job that ends first, or logs nothing for `seconds` (a hang), fails the test."""
    deadline = time.monotonic() + seconds
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, f"{metrics}: fewer than {rows} rows after {seconds:g} s"
        time.sleep(0.05)


def test_a_second_run_on_the_same_output_dir_is_refused(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", _cfg(tiny_model_dir, out))
    first = subprocess.Popen([sys.executable, "-m", "finetune", "train", "--config", str(config)], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_rows(out / "metrics.jsonl", first, 2)
        second = finetune_in_process("train", "--config", str(config))
        assert second.returncode == 2 and "Traceback" not in second.stderr
        holder = json.loads((out / LOCK_FILE).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        assert second.stderr.strip() == (f"error: train.output_dir: {out} is in use by another run (pid {first.pid} on {holder['host']}, "
                                         f"started {holder['started']}); wait for it to end, or choose another train.output_dir")
        assert first.poll() is None  # the first run goes on, its files untouched by the second
    finally:
        first.kill()
        first.communicate()
    rows = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert rows == sorted(rows) and len(rows) == len(set(rows))


def test_the_lock_of_a_run_that_died_is_taken_over(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 999999, "started": "2026-01-01 00:00:00"}))
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", _cfg(tiny_model_dir, out, steps=2))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"taking over the lock of a run that has ended (pid 999999 on {socket.gethostname()}, started 2026-01-01 00:00:00)" in result.stdout
    assert (out / LOCK_FILE).read_text() == ""  # released at the end


def test_workers_stop_when_their_launcher_is_killed(tmp_path, tiny_model_dir):
    """SIGKILL to the torchrun agent: both workers get SIGTERM (parent-death signal), save one complete
    checkpoint together and exit within seconds; the output directory is free again."""
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", _cfg(tiny_model_dir, out, steps=3000))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen([*torchrun(2), "finetune/train.py",
                              "--config", str(config)], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for_rows(out / "metrics.jsonl", agent, 5)
    workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == agent.pid]
    assert len(workers) == 2
    agent.kill()
    agent.communicate()
    killed = time.monotonic()
    while any(Path(f"/proc/{pid}").exists() and _parent(pid) != 0 and _state(pid) != "Z" for pid in workers):
        # a deadline, not a speed: orphans live until someone kills them, a stopping worker saves a checkpoint first
        assert time.monotonic() - killed < 600, "orphaned workers are still running"
        time.sleep(0.1)
    saved = sorted((out / "checkpoints").iterdir())  # the start's and the preemption's
    assert len(saved) == 2 and all(verify(p) is None for p in saved) and not [p for p in saved if p.name.startswith(".")]
    assert [e["event"] for e in read_jsonl(out / "events.jsonl")] == ["preempted"]
    assert (out / LOCK_FILE).read_text() == ""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return 0


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_train_refuses_a_folder_of_someone_elses_files(tmp_path, tiny_model_dir):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", _cfg(tiny_model_dir, out, steps=2))))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"train.output_dir: {out} holds files that are not a finetune run's (README.md)" in result.stderr
    assert [p.name for p in out.iterdir()] == ["README.md"] and (out / "README.md").read_text() == "my notes"


def test_make_demo_model_keeps_what_the_folder_held(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    refused = finetune_in_process("make-demo-model", "--out", str(out), "--steps", "2")
    assert refused.returncode == 2 and "holds files (notes.txt)" in refused.stderr and "--overwrite" in refused.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    built = finetune_in_process("make-demo-model", "--out", str(out), "--steps", "2", "--overwrite")
    assert built.returncode == 0, built.stderr[-2000:]
    assert (out / "notes.txt").read_text() == "keep me" and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not (out / LOCK_FILE).exists()


def test_an_adapter_loads_from_anywhere(tmp_path, tiny_model_dir, monkeypatch):
    """The config names the base relatively (as users write it); the saved adapter names it by its
    absolute path, so AutoPeftModelForCausalLM loads it from any directory, and the summary says so."""
    import torch
    from peft import AutoPeftModelForCausalLM

    work = tmp_path / "project"
    shutil.copytree(tiny_model_dir, work / "models" / "base")
    cfg = _cfg("models/base", "runs/out", steps=2)
    monkeypatch.chdir(work)
    result = finetune_in_process("train", "--config", str(write_config(work / "c.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-2000:]
    base = str((work / "models" / "base").resolve())
    assert json.loads((work / "runs" / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    assert json.loads((work / "runs" / "out" / "summary.json").read_text())["base_model"] == base
    assert f"(an adapter for {base})" in result.stdout
    monkeypatch.chdir(tmp_path)  # away from the folder the config named the base from
    model = AutoPeftModelForCausalLM.from_pretrained(work / "runs" / "out")
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == model.config.vocab_size


def test_a_run_in_a_program_gives_its_signal_handlers_back(tmp_path, tiny_model_dir):
    """train.run listens for SIGTERM/SIGUSR1 (preemption) while it runs; a program that calls it has its own handlers
    back afterwards."""
    import signal

    from finetune.config.schema import validate_config
    from finetune.train import run

    def mine(signum, frame):
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        run(validate_config(base_config(tiny_model_dir, tmp_path / "out", data={"eval": None}, train={"max_steps": 1}), "test"))
        assert all(signal.getsignal(sig) is mine for sig in before)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
