"""Where a run stands, and where a start of it begins: the `Progress` every checkpoint records, the
resume policy (which checkpoint, which config changes it allows) and the restart-loop record.

>>> p = Progress(step=7, tokens=3500, epoch=1)
>>> Progress.from_state_dict({**p.state_dict(), "world_size": 2}) == p  # what a checkpoint's trainer_state.json holds
True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from finetune.checkpoint import store
from finetune.config.errors import EXIT_DIVERGED, Stopped, UserError
from finetune.config.files import to_yaml
from finetune.config.schema import CONFIG_FILE, RunConfig, flatten


@dataclass
class Progress:
    """Optimizer steps done, the tokens they trained on, the epoch the last one was in; the guard's
    state and whether it called this point healthy, as a checkpoint records them."""

    step: int = 0
    tokens: int = 0
    epoch: int = 0
    guard: dict | None = None  # Guard.state_dict()
    batch: dict | None = None  # rows per step and the configured micro-batch and accumulation (run/elastic.batch_for_world)
    good: bool = True  # a rollback may come back here

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict) -> Progress:
        return cls(**{f.name: state[f.name] for f in dataclasses.fields(cls) if f.name in state})


@dataclass
class Start:
    """The checkpoint a start of the run resumes from (None: from the beginning), with the events to log
    ((kind, message) for events.jsonl)."""

    path: Path | None
    events: list[tuple[str, str]]


def starting_point(cfg: RunConfig) -> Start:
    """Which checkpoint to resume (checkpoint.resume; auto: the newest complete one). Read before the
    engine is built: its process count decides the gradient accumulation (run/elastic.batch_for_world)."""
    events = []
    choice = cfg.checkpoint.resume
    path = None
    if choice == "auto":
        found = store.find_latest(cfg.train.output_dir)
        if found is not None:
            events += [("checkpoint_skipped", line) for line in found.skipped]
            path = found.path
        if path is None and (found is not None or starts_file(cfg.train.output_dir).exists()):
            # an earlier start of this run ended (killed, crashed) before it saved a complete checkpoint
            events.append(("restart", "no complete checkpoint to resume from: starting afresh"))
    elif choice != "never":
        path = Path(choice)
        problem = store.verify(path) if path.is_dir() else "not a folder"
        if problem:
            raise UserError(f"checkpoint.resume: {choice}: {problem}")
    return Start(path, events)


def resume(cfg: RunConfig, start: Start, checkpointer, accelerator) -> tuple[Progress, list[tuple[str, str]]]:
    """Restore the start's checkpoint, if any: where the run stands, with the events to log."""
    path, events = start.path, list(start.events)
    if path is not None:
        events += config_change(path, cfg)
    check_restart_loop(cfg, path, accelerator)
    if path is None:
        return Progress(), events
    began = time.perf_counter()
    try:
        progress = Progress.from_state_dict(checkpointer.restore(path, Path(cfg.train.output_dir)))
    except ValueError as err:
        raise UserError(f"checkpoint.resume: {err}") from None
    events.append(("restart", f"resumed from {path} at step {progress.step} ({time.perf_counter() - began:.1f} s)"))
    return progress, events


def config_change(path: Path, cfg: RunConfig) -> list[tuple[str, str]]:
    """Settings that change what is trained must match the checkpoint's; the rest may change (and a
    new LR or clipping then wins over the checkpoint's). The event saying what changed, if anything."""
    import yaml

    breaking, harmless = config_changes(yaml.safe_load((path / CONFIG_FILE).read_text()) or {}, cfg)
    if breaking and not cfg.checkpoint.allow_config_change:
        raise UserError(f"checkpoint.resume: {path} was written with a different config: {'; '.join(breaking[:4])}. "
                        "Start in a new train.output_dir, or set checkpoint.allow_config_change: true to resume anyway")
    return [("config_change", "resuming with changed settings: " + "; ".join(breaking + harmless))] if breaking or harmless else []


# ----------------------------------------------------------------------------------------------
# Restart-loop detection: how many starts in a row resumed from the same place with the same config.


def check_restart_loop(cfg: RunConfig, path: Path | None, accelerator) -> None:
    """Refuse to start for the N+1-th time in a row from the same checkpoint with the same config:
    each of those starts crashed before saving anything newer."""
    if cfg.checkpoint.resume == "never":
        return
    step = (path and store.step_of(path)) or 0
    starts = count_starts(cfg.train.output_dir, step, to_yaml(cfg))
    accelerator.wait_for_everyone()  # every rank has read the record before it changes
    if starts > cfg.checkpoint.max_restarts_without_progress:
        raise Stopped(
            f"restart loop: {starts - 1} starts in a row resumed from {'step ' + str(step) if step else 'the beginning'} and "
            f"crashed before saving a newer checkpoint (checkpoint.max_restarts_without_progress: "
            f"{cfg.checkpoint.max_restarts_without_progress}); find the cause in the logs, then delete "
            f"{starts_file(cfg.train.output_dir)} to try again", EXIT_DIVERGED)
    if accelerator.is_main_process:
        record_start(cfg.train.output_dir, step, to_yaml(cfg), starts)


def starts_file(output_dir: str | Path) -> Path:
    return Path(output_dir) / "starts.json"


def count_starts(output_dir: str | Path, step: int, config_yaml: str) -> int:
    """Which start in a row from `step` with this config this one is (1 for the first)."""
    try:
        record = json.loads(starts_file(output_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return 1
    same = record.get("step") == step and record.get("config") == hashlib.sha256(config_yaml.encode()).hexdigest()
    return record.get("count", 0) + 1 if same else 1


def record_start(output_dir: str | Path, step: int, config_yaml: str, count: int) -> None:
    path = starts_file(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "config": hashlib.sha256(config_yaml.encode()).hexdigest(), "count": count}))


def clear_starts(output_dir: str | Path) -> None:
    starts_file(output_dir).unlink(missing_ok=True)


# Settings that may differ between a checkpoint and the run resuming it: how the run is observed,
# how long it goes on, how it is spread, and the knobs OPT's and PaLM's teams turned when they
# restarted by hand. Anything else (model, adapter, data, seed, optimizer) changes what is trained.
CHANGEABLE_ON_RESUME = (
    "logging.", "eval.", "checkpoint.", "model.ramdisk", "guard.", "watchdog.", "distributed.", "data.cache_dir", "data.num_proc", "data.tokenize_wait_minutes",
    "train.output_dir", "train.max_steps", "train.epochs", "train.lr", "train.warmup_", "train.scheduler", "train.min_lr_ratio", "train.decay_ratio",
    "train.max_grad_norm", "train.skip_data",
    # Batch shape: resuming at another world size (DCP reshards) means another micro-batch/accumulation.
    "train.micro_batch_size", "train.grad_accum",
)


def config_changes(saved: dict, cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(changes that alter what is trained, harmless changes) from a checkpoint's config to this one. A setting the
    checkpoint's version of finetune did not have takes its default, which is how that version ran."""
    try:
        saved = RunConfig.model_validate(saved).model_dump(mode="json")
    except ValidationError:  # a setting since renamed or removed: compared as written (it shows as a change)
        pass
    old, new = flatten(saved), flatten(cfg.model_dump(mode="json"))
    breaking, harmless = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            line = f"{key}: {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}"
            (harmless if key.startswith(CHANGEABLE_ON_RESUME) else breaking).append(line)
    return breaking, harmless
