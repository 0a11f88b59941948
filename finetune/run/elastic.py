"""Elastic jobs (launch/multi_node.sh --nnodes MIN:MAX): the process counts the job may run at, the global batch kept
at whichever it runs at (the gradient accumulation re-derived from the checkpoint's batch), and, where none keeps it, the
wait for nodes to join, bounded by distributed.elastic_wait. The launcher's agents re-form the job; a start at the new size
resumes from the newest checkpoint (checkpoint/resume.py) as any start does.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from finetune.checkpoint import store
from finetune.checkpoint.resume import Start
from finetune.config.errors import UserError
from finetune.config.schema import CONFIG_FILE, RunConfig, TrainConfig
from finetune.run.metrics import EVENTS_FILE, write_event
from finetune.run.supervise import stop_if_preempted


def worlds() -> list[int]:
    """The process counts an elastic job may run at (launch/multi_node.sh --nnodes MIN:MAX sets FINETUNE_ELASTIC to
    the range; each node runs LOCAL_WORLD_SIZE processes); [] outside one. Its agents re-form the job when a node
    joins, so a run that cannot go on at one size may wait for another."""
    low, _, high = os.environ.get("FINETUNE_ELASTIC", "").partition(":")
    if not (low.isdigit() and high.isdigit()):
        return []
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return [nodes * per_node for nodes in range(int(low), int(high) + 1)]


class BatchUnreachable(UserError):
    """No gradient accumulation keeps the checkpoint's global batch at this process count."""


def batch_for_world(cfg: RunConfig, path: Path | None, world: int) -> tuple[RunConfig, str | None, dict]:
    """The config to run with at `world` processes, what changed, and the run's batch as checkpoints record it
    (Progress.batch: rows per optimizer step, and the micro_batch_size and grad_accum configured for it).

    A run keeps its global batch whatever its process count (an elastic job's node lost or back):
    micro_batch_size as configured, grad_accum re-derived so micro x accum x processes is the checkpoint's.
    A step's micro-batches are one block of the epoch's single order (datasets._step_rows), so the data
    position, LR schedule and per-step losses go on as if no node had come or gone. A config whose
    micro_batch_size or grad_accum differs from the ones the run was configured with sets a new batch
    instead. distributed.elastic_batch: flexible takes the nearest batch where none is exact."""
    import yaml

    configured = [cfg.train.micro_batch_size, cfg.train.grad_accum]
    share = cfg.train.micro_batch_size * (world // cfg.distributed.row_group)  # rows per micro-batch over all processes
    ours = {"rows": share * cfg.train.grad_accum, "configured": configured}
    if path is None or world % cfg.distributed.row_group:  # the latter: the row share's setup refuses it
        return cfg, None, ours
    state = store.trainer_state(path)
    saved_world, batch = state.get("world_size", world), state.get("batch")
    if batch is None:  # a checkpoint from before batches were recorded: its config's, as it ran
        t, sp = (yaml.safe_load((path / CONFIG_FILE).read_text()) or {}).get("train", {}), cfg.distributed.row_group
        defaults = TrainConfig.model_fields  # the schema's defaults, as that run took them
        micro, accum = t.get("micro_batch_size", defaults["micro_batch_size"].default), t.get("grad_accum", defaults["grad_accum"].default)
        batch = {"rows": micro * accum * (saved_world // sp), "configured": [micro, accum]}
    if batch["configured"] != configured:  # the user set another batch
        return cfg, None, ours
    rows = batch["rows"]
    accum, exact = max(1, round(rows / share)), rows % share == 0
    if saved_world == world and exact and accum == cfg.train.grad_accum:
        return cfg, None, batch
    where = f"{path} was written by {saved_world} process(es) at {rows} rows per step; at {world}"
    if not exact and cfg.distributed.elastic_batch == "fixed":
        raise BatchUnreachable(f"{where}, micro_batch_size {cfg.train.micro_batch_size} x grad_accum N x {world // cfg.distributed.row_group} "
                               f"cannot make {rows}: resume at a process count that can, or set distributed.elastic_batch: flexible")
    kept = f"{rows} rows per step kept" if exact else f"{share * accum} rows per step instead of {rows} (distributed.elastic_batch: flexible)"
    resized = cfg.model_copy(update={"train": cfg.train.model_copy(update={"grad_accum": accum})})
    return resized, f"{where}: train.grad_accum {accum}, {kept}", batch


def batch_at_this_size(cfg: RunConfig, start: Start, accelerator, preemption) -> tuple[RunConfig, str | None, dict]:
    """The config at this process count (the checkpoint's global batch kept: batch_for_world). Where no
    accumulation keeps it, an elastic job below its largest size waits for nodes: the launcher's agents
    re-form the job (SIGTERM, then a start at the new size) when one joins; anything else stops in one line."""
    sizes, main, out = worlds(), accelerator.is_main_process, Path(cfg.train.output_dir)
    try:
        cfg, resized, batch = batch_for_world(cfg, start.path, accelerator.num_processes)
    except BatchUnreachable as err:
        if not sizes or accelerator.num_processes >= sizes[-1]:
            raise
        wait_for_nodes(f"{err}; waiting for nodes to join (the launcher starts the run again at the new size)", preemption, out, main,
                       cfg.distributed.elastic_wait)
    sp, micro = cfg.distributed.row_group, cfg.train.micro_batch_size
    bad = [w for w in sizes if w % sp or batch["rows"] % (micro * (w // sp))]
    if bad and start.path is None and main and cfg.distributed.elastic_batch == "fixed":
        message = (f"{batch['rows']} rows per step (micro_batch_size {micro}) cannot be kept at {', '.join(map(str, bad))} of this elastic job's "
                   f"{sizes[0]}-{sizes[-1]} processes: there it would wait for a node (choose a batch every count divides)")
        write_event(out / EVENTS_FILE, "warning", None, message)
        print(f"[warning] {message}", flush=True)
    return cfg, resized, batch


def wait_for_nodes(message: str, preemption, out: Path, main: bool, seconds: float) -> None:
    """Idle until the agent's SIGTERM, then end as a preempted run (exit 75) would before its first step; no SIGTERM
    within `seconds` (distributed.elastic_wait): stop in one line (exit 2) rather than wait for ever."""
    if main:
        write_event(out / EVENTS_FILE, "wait", None, message)
        print(f"[wait] {message}", flush=True)
    deadline = time.monotonic() + seconds
    while preemption.signal is None and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    if preemption.signal is None:
        raise UserError(f"distributed.elastic_wait: no node joined within {seconds:g} s ({message.partition('; waiting')[0]}); start the "
                        "missing nodes and launch again, or set distributed.elastic_batch: flexible")
    stop_if_preempted(True, preemption.name, out, main, "while it waited for nodes")
