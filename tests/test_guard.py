"""Fault tolerance beyond checkpoints: the divergence guard's ladder, preemption, the hang watchdog,
restart loops, config changes on resume and manual recovery. Real runs, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, base_config, finetune_in_process, once, read_jsonl, run_ranks, step_losses, torchrun, train_forked, wait_for, write_config

from finetune.config.schema import GuardConfig
from finetune.run.guard import DRIFT_STEPS, Guard


def _cfg(tiny_model_dir, out, steps=40, **sections):
    cfg = base_config(tiny_model_dir, out, data={"eval": None}, train={"max_steps": steps, "micro_batch_size": 2, "lr": 5e-3})
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _train(tmp_path, cfg, *extra, env=None, name="c"):
    """`finetune train`: in this process, or a process of its own where the injected fault kills, signals or hangs it."""
    config = str(write_config(tmp_path / f"{name}.yaml", cfg))
    fault = (env or {}).get("FINETUNE_FAULT")
    if fault and fault.split("@")[0] in ("kill", "term", "hang", "hang-saving"):
        return train_forked("--config", config, *extra, env=env)
    return finetune_in_process("train", "--config", config, *extra, fault=fault)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, tiny_model_dir):
    """The 40 steps the fault tests are compared with, run once: nothing injected."""

    def build(folder):
        assert _train(folder, _cfg(tiny_model_dir, folder / "out"), name="healthy").returncode == 0

    return once(tmp_path_factory, "guard-healthy-40", build) / "out"


def _events(out):
    path = out / "events.jsonl"
    return read_jsonl(path) if path.exists() else []



def test_poisoned_batches_are_skipped_then_rolled_back_with_lower_lr(tmp_path, tiny_model_dir, healthy):
    """NaN losses on the batches of data steps 23-25: skip, skip, then roll back to step 20 with half
    the LR and those batches skipped; the run finishes with finite, falling loss."""
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, checkpoint={"save_every": 10})
    result = _train(tmp_path, cfg, env={"FINETUNE_FAULT": "nan@23-25"})
    assert result.returncode == 0, result.stderr[-3000:]
    kinds = [e["event"] for e in _events(out)]
    assert kinds == ["skip", "skip", "rollback"], _events(out)
    rollback = _events(out)[-1]["message"]
    assert "rolled back to step-000020" in rollback and "LR x0.5" in rollback and "steps 21-26 skipped" in rollback
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    after = rows[-20:]  # steps 21-40, trained after the rollback (the abandoned ones stay in the log)
    assert [r["step"] for r in after] == list(range(21, 41))
    assert all(r["loss"] == r["loss"] and r["loss"] < 1e3 for r in after)  # finite
    lr = {r["step"]: r["lr"] for r in after}
    healthy_lr = {r["step"]: r["lr"] for r in read_jsonl(healthy / "metrics.jsonl") if "lr" in r}
    assert lr[30] == pytest.approx(0.5 * healthy_lr[30], rel=1e-6)  # the same schedule at half the peak
    losses = step_losses(out)
    assert losses[40] < losses[1] and len(losses) == 40
    assert not _events(healthy)  # a healthy run triggers nothing


def test_a_single_spike_is_skipped_and_the_run_goes_on(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    result = _train(tmp_path, _cfg(tiny_model_dir, out), env={"FINETUNE_FAULT": "spike@30"})
    assert result.returncode == 0, result.stderr[-3000:]
    events = _events(out)
    assert [e["event"] for e in events] == ["skip"] and "loss spike" in events[0]["message"], events
    assert events[0]["step"] == 30


def test_the_guard_stops_after_its_rollbacks_with_the_checkpoint_to_start_from(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, checkpoint={"save_every": 10}, guard={"max_rollbacks": 1})
    result = _train(tmp_path, cfg, env={"FINETUNE_FAULT": "nan@23-200"})
    assert result.returncode == 3, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step") and "training diverged" in last and "last good checkpoint is" in last, last
    assert [e["event"] for e in _events(out)] == ["skip", "skip", "rollback", "skip", "skip", "stop"]


def test_sigterm_saves_exits_75_and_resumes_exactly(tmp_path, tiny_model_dir, healthy):
    """A real SIGTERM, sent by the process to itself as step 21 begins (FINETUNE_FAULT=term@20): that
    step completes, is saved, and the run exits 75; started again it ends as a run never stopped."""
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out)
    stopped = _train(tmp_path, cfg, env={"FINETUNE_FAULT": "term@20"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step-000000", "step-000021"] and "preempted at step 21" in stopped.stderr  # the start, and the preemption's
    assert [e["event"] for e in _events(out)] == ["preempted"]
    resumed = _train(tmp_path, cfg)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert step_losses(out) == step_losses(healthy)  # bitwise, before and after the preemption


def test_a_hung_step_is_caught_by_the_watchdog_with_stacks(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, watchdog={"min_seconds": 3})
    result = _train(tmp_path, cfg, env={"FINETUNE_FAULT": "hang@15"})  # the step hangs for good: only the watchdog ends it
    assert result.returncode == 4, result.stderr[-3000:]
    assert "watchdog: step 16 has run" in result.stderr
    assert "Thread" in result.stderr and "faults.py" in result.stderr  # every thread's stack, down to the stuck line
    assert [e["event"] for e in _events(out)] == ["hang"]


def test_a_save_that_hangs_is_caught_by_the_watchdog_and_the_checkpoints_before_it_stay(tmp_path, tiny_model_dir):
    """A save waits at barriers as a step waits at collectives (a peer lost mid-save): it is timed as a step is."""
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, steps=20, watchdog={"min_seconds": 3}, checkpoint={"save_every": 5, "async_save": False})
    result = _train(tmp_path, cfg, env={"FINETUNE_FAULT": "hang-saving@10"})
    assert result.returncode == 4, result.stderr[-3000:]
    assert "watchdog: the checkpoint save after step 10 has run" in result.stderr and "faults.py" in result.stderr
    assert [e["event"] for e in _events(out)] == ["hang"]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000000", "step-000005"]


def test_a_restart_loop_without_progress_stops(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, checkpoint={"save_every": 5, "max_restarts_without_progress": 2})
    # The first start saves step 5 and crashes at 7; the next two resume from 5 and crash again.
    codes = [_train(tmp_path, cfg, env={"FINETUNE_FAULT": "raise@7"}).returncode for _ in range(3)]
    assert codes == [1, 1, 1]
    fourth = _train(tmp_path, cfg, env={"FINETUNE_FAULT": "raise@7"})
    assert fourth.returncode == 3
    assert "restart loop: 2 starts in a row resumed from step 5" in fourth.stderr
    assert fourth.stderr.strip().splitlines()[-1].startswith("error: restart loop")


def test_resume_refuses_a_changed_model_setting_but_takes_a_new_lr(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, steps=10, checkpoint={"save_every": 5})
    assert _train(tmp_path, cfg, env={"FINETUNE_FAULT": "raise@7"}).returncode == 1
    changed = _cfg(tiny_model_dir, out, steps=10, checkpoint={"save_every": 5}, adapter={"r": 4})
    result = _train(tmp_path, changed, name="changed")
    assert result.returncode == 2
    assert "was written with a different config: adapter.r: 8 -> 4" in result.stderr
    # Manual recovery, OPT-style: a new LR, and a window of data skipped, from the command line.
    result = _train(tmp_path, cfg, "--set", "train.lr=1e-3", "--set", "train.skip_data=[[5,3]]")
    assert result.returncode == 0, result.stderr[-2000:]
    lrs = {r["step"]: r["lr"] for r in read_jsonl(out / "metrics.jsonl") if "lr" in r}
    assert lrs[6] < 1e-3 < lrs[4]  # the new peak LR took over from the checkpoint's 5e-3
    assert any("train.lr: 0.005 -> 0.001" in e["message"] for e in _events(out))


def test_time_based_saves(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, steps=30, checkpoint={"save_every_minutes": 1e-9, "keep_last": 100})
    result = _train(tmp_path, cfg)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(list((out / "checkpoints").glob("step-*"))) == 1 + 29  # the start, then after every step but the last


def _env(extra: dict | None) -> dict:
    """A 2-process run's environment: gloo on the CPU, one thread a rank, `extra` (a fault) on top."""
    return {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **(extra or {})}


def _torchrun(tmp_path, cfg, name, *flags, env=None):
    config = write_config(tmp_path / f"{name}.yaml", cfg)
    return subprocess.Popen([*torchrun(2), *flags,
                             "finetune/train.py", "--config", str(config)], cwd=REPO, env=_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _ranks(tmp_path, cfg, name, env=None):
    """The 2-process run of `cfg` where torchrun's agent has nothing to do (no restart, no signal): ranks.run_ranks."""
    config = write_config(tmp_path / f"{name}.yaml", cfg)
    return run_ranks(2, "finetune/train.py", "--config", str(config), cwd=REPO, env=_env(env))


def test_torchrun_restarts_a_killed_rank_and_the_job_resumes_by_itself(tmp_path, tiny_model_dir):
    """Rank 1 is SIGKILLed at step 7; torchrun's elastic agent restarts both workers, which resume
    from the checkpoint of step 5 and finish with the uninterrupted run's losses."""
    cfg = _cfg(tiny_model_dir, tmp_path / "reference", steps=20, checkpoint={"save_every": 5})
    reference = _ranks(tmp_path, cfg, "reference")  # uninterrupted: torchrun's workers without its agent
    assert reference.returncode == 0, reference.stderr[-3000:]
    cfg = _cfg(tiny_model_dir, tmp_path / "out", steps=20, checkpoint={"save_every": 5})
    job = _torchrun(tmp_path, cfg, "restarted", "--max-restarts", "1", env={"FINETUNE_FAULT": "kill@7:rank=1"})
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout and "step-000005 at step 5" in stdout
    assert step_losses(tmp_path / "out") == pytest.approx(step_losses(tmp_path / "reference"), rel=1e-6)



def test_under_zero_a_spike_has_moved_the_weights_already_and_is_recorded_as_an_anomaly(tmp_path, tiny_model_dir):
    """DeepSpeed steps inside backward, before the guard has seen the step's loss: a spike the guard
    would skip is an anomaly (only a rollback could undo it), and the LR schedule keeps pace with the
    optimizer (its LR at the last step is a healthy one-process run's)."""
    cfg = _cfg(tiny_model_dir, tmp_path / "out", steps=24, distributed={"strategy": "zero2"})
    job = _ranks(tmp_path, cfg, "zero2", env={"FINETUNE_FAULT": "spike@22"})
    assert job.returncode == 0, job.stderr[-3000:]
    events = _events(tmp_path / "out")
    assert [(e["event"], e["step"]) for e in events] == [("anomaly", 22)], events
    assert "loss spike" in events[0]["message"] and "only rollbacks help" in events[0]["message"]
    healthy = _cfg(tiny_model_dir, tmp_path / "healthy", steps=24)
    assert _train(tmp_path, healthy, name="healthy").returncode == 0
    lr = [{r["step"]: r["lr"] for r in read_jsonl(out / "metrics.jsonl") if "lr" in r} for out in (tmp_path / "out", tmp_path / "healthy")]
    assert lr[0][24] == pytest.approx(lr[1][24], rel=1e-9) and lr[0][24] != lr[1][20]


def test_sigterm_to_torchrun_makes_every_rank_save_the_same_step(tmp_path, tiny_model_dir):
    cfg = _cfg(tiny_model_dir, tmp_path / "out", steps=2000, distributed={"strategy": "fsdp"})
    job = _torchrun(tmp_path, cfg, "c")
    metrics = tmp_path / "out" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 10, job, "10 logged steps")
    job.send_signal(signal.SIGTERM)  # torchrun passes it on to both workers
    _, stderr = job.communicate(timeout=120)
    assert stderr.count("error: preempted at step") == 2, stderr[-3000:]
    saved = sorted((tmp_path / "out" / "checkpoints").iterdir())  # the start's and the preemption's
    assert len(saved) == 2 and sorted(p.name for p in (saved[1] / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


# ----------------------------------------------------------------------------------------------
# Real divergences (not injected values): each is caught within the guard's stated bound and the run
# ends recovered (final eval loss within 5% of the healthy run's) or stopped with exit 3.




def _scenario_cfg(tiny_model_dir, out, steps=80, **sections):
    cfg = _cfg(tiny_model_dir, out, steps=steps, checkpoint={"save_every": 10, "keep_last": 2}, **sections)
    cfg["data"]["eval"] = str(REPO / "demo" / "data" / "eval.jsonl")
    cfg["eval"] = {"max_batches": 8}
    return cfg


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory, tiny_model_dir):
    tmp_path = tmp_path_factory.mktemp("healthy")
    out = tmp_path / "out"
    result = _train(tmp_path, _scenario_cfg(tiny_model_dir, out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _summary(out):
    import json

    return json.loads((out / "summary.json").read_text())


def test_a_healthy_run_triggers_nothing_and_ends_on_its_best_weights(healthy_run):
    assert not _events(healthy_run)
    summary = _summary(healthy_run)
    assert summary["final_is_best"] is True and summary["rollbacks"] == 0
    assert summary["final_loss_level"] <= 1.05 * summary["best_loss_level"]


def test_scoring_the_last_good_checkpoint_puts_the_final_weights_back(healthy_run, tiny_model_dir):
    """What a run that ended worse than its best does before saving: load the last good checkpoint's
    weights, evaluate them, and restore the final ones (on a CPU the parameters are the state dict's
    tensors, so the final weights must be copied first)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.checkpoint.checkpointers import last_good

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(healthy_run), is_trainable=True)
    final = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    changed = []

    def evaluate():
        changed.append(any(not torch.equal(p, final[n]) for n, p in model.named_parameters() if p.requires_grad))
        return {"eval_loss": 1.0}

    result = last_good(healthy_run, 75, evaluate, model)
    assert result == {"last_good_checkpoint": str(healthy_run / "checkpoints" / "step-000070"), "last_good_eval_loss": 1.0}
    assert changed == [True]  # the checkpoint's weights were the ones evaluated
    assert all(torch.equal(p, final[n]) for n, p in model.named_parameters() if p.requires_grad)


def test_the_lr_raised_100x_on_resume_is_caught_after_every_rollback(tmp_path, tiny_model_dir, healthy_run):
    """The issue's bad day: a run stopped at step 30 is resumed with 100x its learning rate. The loss
    climbs 10-15% above its level at step 30 each time: rolled back to step 30 with the LR halved,
    twice, and the third climb (at 25x) stops the run (guard.max_rollbacks: 2), exit 3."""
    out = tmp_path / "out"
    cfg = _scenario_cfg(tiny_model_dir, out, guard={"max_rollbacks": 2})
    assert _train(tmp_path, cfg, env={"FINETUNE_FAULT": "raise@30"}).returncode == 1
    result = _train(tmp_path, cfg, "--set", "train.lr=0.5")
    events = [e for e in _events(out) if e["event"] in ("skip", "rollback", "stop")]
    print([(e["step"], e["event"], e["message"][:120]) for e in events])
    assert [e["event"] for e in events] == ["rollback", "rollback", "stop"], events
    assert all("drifted up" in e["message"] and e["step"] - 30 <= 2 * DRIFT_STEPS for e in events), events  # within 20 steps of each restart
    assert result.returncode == 3 and "last good checkpoint is" in result.stderr, result.stderr[-2000:]
    assert "LR x0.25" in events[1]["message"]


def test_a_learning_rate_too_high_from_the_start_stops_within_the_window(tmp_path, tiny_model_dir, healthy_run):
    """LoRA at 100x the healthy run's LR: the loss never rises (it stalls near its start while the
    gradient norm collapses 100x), so no spike or drift rule sees it; the collapse rule stops the run
    with exit 3 within `guard.window` steps, before a checkpoint trained at that LR can be mistaken for good."""
    out = tmp_path / "out"
    cfg = _scenario_cfg(tiny_model_dir, out)
    cfg["train"]["lr"] = 0.5
    result = _train(tmp_path, cfg)
    assert result.returncode == 3, result.stderr[-3000:]
    stop = _events(out)[-1]
    assert stop["event"] == "stop" and stop["step"] < 50 and "too high from the start" in stop["message"], stop
    assert f"only the start is good ({out / 'checkpoints' / 'step-000000'}, the adapter as initialised)" in result.stderr
    assert not (out / "summary.json").exists()


def test_pathological_rows_do_no_harm(tmp_path, tiny_model_dir, healthy_run):
    """Rows of random bytes and of one token repeated, among the real ones: the run is not rolled back
    and ends within 5% of the healthy run's eval loss."""
    import json
    import random

    rng = random.Random(0)
    rows = (REPO / "demo" / "data" / "train.jsonl").read_text().splitlines()
    garbage = [json.dumps({"instruction": "".join(chr(rng.randrange(33, 0x2FFF)) for _ in range(60)),
                           "output": "".join(chr(rng.randrange(33, 0x2FFF)) for _ in range(200))}) for _ in range(40)]
    garbage += [json.dumps({"instruction": "repeat", "output": "zq " * 150}) for _ in range(20)]
    data = tmp_path / "poisoned.jsonl"
    data.write_text("\n".join(rows + garbage) + "\n")
    out = tmp_path / "out"
    cfg = _scenario_cfg(tiny_model_dir, out)
    cfg["data"]["train"] = str(data)
    result = _train(tmp_path, cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [e for e in _events(out) if e["event"] in ("rollback", "stop")], _events(out)
    summary = _summary(out)
    assert summary["eval_loss"] < 1.05 * _summary(healthy_run)["eval_loss"] and summary["final_is_best"] is True, summary


# ----------------------------------------------------------------------------------------------
# Events that must reach events.jsonl and exit codes that must reach the scheduler.


def test_a_restart_from_scratch_is_an_event(tmp_path, tiny_model_dir):
    """Killed before its first save completed: the next start has nothing to resume from and says so."""
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, steps=8, checkpoint={"save_every": 5})
    assert _train(tmp_path, cfg, env={"FINETUNE_FAULT": "kill@3"}).returncode == -signal.SIGKILL
    assert _train(tmp_path, cfg).returncode == 0
    assert [(e["event"], e["message"]) for e in _events(out)] == [("restart", "no complete checkpoint to resume from: starting afresh")]


def test_sigterm_before_the_loop_exits_75_with_an_event(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", _cfg(tiny_model_dir, out))
    job = subprocess.Popen([sys.executable, "-m", "finetune", "train", "--config", str(config)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for((out / "finetune_config.yaml").exists, job, "the run's set-up", every=0.01)  # the config is written as set-up starts
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr[-2000:]
    assert "nothing to save yet" in stderr.strip().splitlines()[-1]
    assert [e["event"] for e in _events(out)] == ["preempted"] and not (out / "checkpoints").exists()


def test_a_collective_past_its_timeout_ends_the_run_in_one_line_with_the_hang_code(tmp_path):
    """distributed.collective_timeout: gloo's words for a collective that gave up become the run's one line (exit 4, a hang
    event), any other error stays as it was. bench/chaos_network.py measures it on a cut link (docs/running.md)."""
    from accelerate import Accelerator

    from finetune.config.errors import EXIT_HUNG
    from finetune.parallel import runtime
    from finetune.run.metrics import RunLog

    log = RunLog(tmp_path, 10, Accelerator(cpu=True), enabled=True, progress_bar=False)
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete")
    hung = runtime.timed_out(gloo, 15, log, 26)
    assert hung is not None and hung.exit_code == EXIT_HUNG == 4
    assert str(hung).startswith("a collective waited over distributed.collective_timeout (15 s) for another process at step 27 (a stuck "
                                "peer or a lost link: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms")
    assert [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["hang"]
    nccl = RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, "
                        "NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.")
    assert runtime.timed_out(nccl, 600, log, 26) is not None
    for other in ("CUDA error: an illegal memory access was encountered", "DataLoader worker (pid 123) timed out after 30 seconds",
                  "The client socket has timed out after 60s while trying to connect to (10.0.0.1, 29500)."):
        assert runtime.timed_out(RuntimeError(other), 15, log, 26) is None


def test_a_hang_on_another_rank_reaches_the_events(tmp_path, tiny_model_dir):
    """Rank 1 hangs at step 6: its watchdog writes the event to a file of its own, the job restarts,
    and the new main process folds it into events.jsonl."""
    out = tmp_path / "out"
    cfg = _cfg(tiny_model_dir, out, steps=10, watchdog={"min_seconds": 3})
    job = _torchrun(tmp_path, cfg, "hang", "--max-restarts", "1", env={"FINETUNE_FAULT": "hang@5:rank=1"})
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    hangs = [e for e in _events(out) if e["event"] == "hang"]
    assert any(e["message"].startswith("rank 1: watchdog: step 6 has run") for e in hangs), _events(out)
    assert not list(out.glob("events.rank*.jsonl"))


# ----------------------------------------------------------------------------------------------
# The start as a reference, on a pretrained model with a real BPE tokenizer: LoRA on text it has the
# style of (its loss starts where a healthy run stays), at a healthy LR and at 250x it.


def _bpe_cfg(model_dir, rows, out, lr, **sections):
    cfg = {"model": {"name_or_path": str(model_dir)}, "adapter": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
           "data": {"train": str(rows), "format": "completion", "max_seq_len": 128, "eval_fraction": 0.1},
           "train": {"output_dir": str(out), "max_steps": 80, "micro_batch_size": 4, "lr": lr, "warmup_steps": 5},
           "checkpoint": {"save_every": 10, "keep_last": 2}, "eval": {"max_batches": 8},
           "logging": {"report_to": [], "progress_bar": False, "plot": False}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _main_train(tmp_path, cfg) -> int:
    from finetune.cli import main

    return main(["train", "--config", str(write_config(tmp_path / f"{Path(cfg['train']['output_dir']).name}.yaml", cfg))])


def test_lora_that_starts_where_a_healthy_run_stays_raises_nothing(tmp_path, bpe_model_dir, bpe_finetune_rows):
    out = tmp_path / "healthy"
    assert _main_train(tmp_path, _bpe_cfg(bpe_model_dir, bpe_finetune_rows, out, 2e-3)) == 0
    assert not _events(out)
    summary = _summary(out)
    assert summary["final_is_best"] is True and "worse_than_start" not in summary
    assert summary["eval_loss"] == pytest.approx(summary["start_eval_loss"], rel=0.03)  # flat: it knew the text
    assert summary["final_loss_level"] == pytest.approx(summary["start_loss_level"], rel=0.05)


def test_a_learning_rate_250x_too_high_from_the_first_step_rolls_back_to_the_start_then_stops(tmp_path, bpe_model_dir, bpe_finetune_rows, capsys):
    """The issue's case: the loss rises well above its start in the warmup, then settles on a
    plateau 2.6x the start (recorded in tests/data/guard_series.json). Each level above the start rolls
    back to step 0 with the LR halved; at 31x the LR it still rises, and the guard stops (exit 3)."""
    out = tmp_path / "hot"
    assert _main_train(tmp_path, _bpe_cfg(bpe_model_dir, bpe_finetune_rows, out, 0.5)) == 3
    events = _events(out)
    assert [e["event"] for e in events] == ["rollback"] * 3 + ["stop"], events
    for event, scale in zip(events, ("x0.5", "x0.25", "x0.125")):
        assert "where the run started" in event["message"] and f"rolled back to step-000000, LR {scale} " in event["message"]
    assert f"only the start is good ({out / 'checkpoints' / 'step-000000'}" in capsys.readouterr().err
    assert not (out / "summary.json").exists()


def test_a_run_that_ends_worse_than_it_started_is_saved_and_exits_3(tmp_path, bpe_model_dir, bpe_finetune_rows, capsys):
    """The same LR with the early rules out of reach (a 2-step window: the start is judged from the
    10th step on; no collapse rule): the run trains to the end on its plateau. Its eval loss ended 2.6x
    its start: saved, named, exit 3."""
    out = tmp_path / "worse"
    cfg = _bpe_cfg(bpe_model_dir, bpe_finetune_rows, out, 0.5, guard={"window": 2, "grad_collapse": 0})
    assert _main_train(tmp_path, cfg) == 3
    summary = _summary(out)
    assert summary["final_is_best"] is False and summary["eval_loss"] > 2 * summary["start_eval_loss"], summary
    assert summary["worse_than_start"].startswith(f"the eval loss ended at {summary['eval_loss']:.4g}, above its {summary['start_eval_loss']:.4g}")
    assert summary["start_checkpoint"] == str(out / "checkpoints" / "step-000000") and (out / "adapter_model.safetensors").is_file()
    assert _events(out)[-1]["event"] == "stop" and "ended worse than it started" in _events(out)[-1]["message"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the run ended worse than it started: the eval loss ended at") and "Lower train.lr" in err[-1]


def test_a_kl_above_max_kl_rolls_back_to_the_last_step_within_half_of_it_then_stops():
    """GRPO's KL to the reference has a bound of its own (guard.max_kl): a step above it is not applied but rolled back,
    to the last step whose KL was at most half the bound (a checkpoint from no later), and after max_rollbacks it stops."""
    guard = Guard(GuardConfig(max_kl=0.1, max_rollbacks=1))
    kls = [0.0, 0.02, 0.05, 0.07, 0.09, 0.12]
    verdicts = [guard.check(step, -1.0, 1.0, kl) for step, kl in enumerate(kls)]
    assert [v.action for v in verdicts] == ["apply"] * 5 + ["rollback"]
    assert verdicts[-1].before_step == 2 and "KL to the reference reached 0.12, above guard.max_kl=0.1" in verdicts[-1].reason
    guard.rolled_back(2, 5, saved={"calm_kl_step": 2})
    assert guard.check(3, -1.0, 1.0, 0.04).action == "apply" and guard.check(4, -1.0, 1.0, 0.2).action == "stop"
    assert Guard(GuardConfig()).check(0, -1.0, 1.0, 5.0).action == "apply"  # no bound set: the KL is not judged
