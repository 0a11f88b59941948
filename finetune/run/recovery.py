"""What a run keeps so that it can come back: the checkpoint it resumes from (with its log, guard and
watchdog), the start the guard judges from, the checkpoints it saves, the rollbacks the guard asks for and
the stop on a preemption signal."""

from __future__ import annotations

import dataclasses
import time

import torch

from finetune.checkpoint import store
from finetune.checkpoint.resume import Progress, Start, resume
from finetune.config.errors import EXIT_DIVERGED, EXIT_PREEMPTED, Stopped
from finetune.config.files import to_yaml
from finetune.parallel import runtime
from finetune.parallel.optim import set_peak_lr, warmup_steps
from finetune.run.guard import DRIFT_STEPS, Guard, Verdict, data_step
from finetune.run.metrics import RunLog, tracked_config, tracker_kwargs
from finetune.run.state import RunState, evaluate, skipped
from finetune.run.steps import step_batches
from finetune.run.supervise import Watchdog


def resume_or_start(state: RunState, start: Start, events: list[tuple[str, str]]) -> None:
    """Restore the checkpoint to resume from (if any), then the run log, guard and watchdog; `events`
    (set-up's) are logged with the resume's."""
    cfg, engine = state.cfg, state.engine
    state.background = engine.background_saves and (cfg.checkpoint.async_save if cfg.checkpoint.async_save is not None
                                                       else cfg.adapter.method != "full")
    if cfg.logging.report_to:
        state.accelerator.init_trackers(cfg.logging.project, config=tracked_config(cfg), init_kwargs=tracker_kwargs(cfg.logging, state.out))
    state.progress, resumed = resume(cfg, start, engine.checkpointer, state.accelerator)
    events = events + resumed
    state.objective.load_held(engine.checkpointer.rank_state)
    state.start_step = state.progress.step
    state.log = RunLog(state.out, state.schedule.total_steps, state.accelerator, state.main, cfg.logging.progress_bar, state.progress.step)
    for kind, message in events:
        state.log.event(kind, state.progress.step, message)
    # GRPO's guard judges the negative mean reward, a level that may be negative: no ratio to the start's gradient norm.
    guard_cfg = cfg.guard if state.objective.levels else cfg.guard.model_copy(update={"grad_collapse": 0.0})
    state.guard = Guard(guard_cfg, state.progress.guard, cfg.guard.min_rise if cfg.guard.min_rise is not None else state.objective.start_loss,
                      warmup=warmup_steps(cfg.train, state.schedule.total_steps), watched=state.objective.watched_name, resumed_at=state.start_step)
    set_peak_lr(engine.scheduler, cfg.train.lr * state.guard.state.lr_scale)  # the config's LR wins over the checkpoint's (OPT's logbook)
    rank = state.accelerator.process_index
    state.watchdog = Watchdog(cfg.watchdog, on_hang=lambda message: state.log.event("hang", state.watchdog.step, f"rank {rank}: {message}", any_rank=True))
    state.last_save = time.monotonic()


def start_point(state: RunState) -> None:
    """Before the first step: the eval baseline and, unless a step-0 checkpoint holds them already,
    where the guard judges the run from (the first steps' batches at the initial weights, the eval
    loss) and, for adapters, that checkpoint: the start to roll back to costs a few MB at most."""
    cfg, guard = state.cfg, state.guard
    result = evaluate(state, 0) if cfg.eval.on_start else None
    if not cfg.guard.enabled or guard.state.start_level is not None or state.schedule.total_steps <= DRIFT_STEPS or not state.objective.levels:
        return
    guard.set_start(start_losses(state), result["eval_loss"] if result else None)
    state.say(f"start: loss level {guard.state.start_level[0]:.4f} on the first {DRIFT_STEPS} steps' batches before training")
    if cfg.adapter.method != "full":
        save(state)


def start_losses(state: RunState) -> list[float]:
    """The losses of the first DRIFT_STEPS steps' batches at the initial weights, each as its step
    will compute it (training mode, dropout included); the RNG is put back afterwards, so the steps
    themselves are the same as without this measurement."""
    losses, rng = [], store.rng_state()
    try:
        with torch.no_grad():
            for step in range(DRIFT_STEPS):
                _, micro_batches, totals, _ = step_batches(state, data_step(step, skipped(state)))
                loss = sum(state.objective.losses(state.engine.model, batch, totals).tokens.float() for batch in micro_batches)
                losses.append(state.accelerator.reduce(loss, "sum").item() / max(totals[0], 1))
    finally:
        store.set_rng_state(rng)
    return losses


def save(state: RunState) -> None:
    engine, step = state.engine, state.progress.step
    progress = dataclasses.replace(state.progress, guard=state.guard.state_dict(), good=state.guard.is_healthy(step))
    began = time.perf_counter()
    state.watchdog.start(step, "save")  # its barriers hang on a lost peer as a step's collectives do
    try:
        saved = engine.checkpointer.save(state.out, progress.state_dict(), to_yaml(state.cfg), state.cfg.checkpoint.keep_last, state.background,
                                         state.objective.held_state())
    finally:
        state.watchdog.end()
    if saved:  # the seconds training waited (bench/large.py compares them with and without background writes)
        state.log.print(f"step {step}: checkpoint {'being written in the background to' if state.background else 'saved to'} {saved} "
                      f"(training paused {time.perf_counter() - began:.2f} s)")
    state.last_save = time.monotonic()


def stop_preempted(state: RunState) -> None:
    state.engine.checkpointer.wait()
    name = state.preemption.name or "a signal on another rank"
    state.log.event("preempted", state.progress.step, f"{name}: checkpoint saved at step {state.progress.step}; exiting with code {EXIT_PREEMPTED}, "
                  "start the same command to resume")
    state.log.close_bar()
    runtime.finish_distributed(state.accelerator)
    raise Stopped(f"preempted at step {state.progress.step}: checkpoint saved; start the same command to resume", EXIT_PREEMPTED)


def roll_back(state: RunState, trouble_step: int, verdict: Verdict) -> Progress:
    """Back to the newest good checkpoint before the trouble, with a lower LR and the data that led
    to the trouble skipped; or stop with what was seen. Returns the progress to go on from."""
    guard, engine, lr = state.guard, state.engine, state.cfg.train.lr
    engine.checkpointer.wait()
    target = store.find_good(state.out, verdict.before_step)  # at or before the trouble (a drift: its lowest level)
    if verdict.action == "stop" or target is None:
        where = _no_rollback(target, verdict)
        state.log.event("stop", trouble_step, f"guard: {verdict.reason}; {where}")
        raise Stopped(f"step {trouble_step + 1}: training diverged: {verdict.reason}; {where}", EXIT_DIVERGED)
    back = Progress.from_state_dict(engine.checkpointer.restore(target, state.out))
    state.objective.load_held(engine.checkpointer.rank_state)
    guard.rolled_back(back.step, trouble_step, saved=back.guard)
    set_peak_lr(engine.scheduler, lr * guard.state.lr_scale)
    state.log.event("rollback", trouble_step, f"guard: {verdict.reason}; rolled back to {target.name}, LR x{guard.state.lr_scale:g} "
                  f"(now {lr * guard.state.lr_scale:.3g}), batches of steps {back.step + 1}-{trouble_step + 1} skipped"
                  + (f", clipping at {guard.state.max_grad_norm}" if guard.state.max_grad_norm else ""))
    return back


def _no_rollback(target, verdict: Verdict) -> str:
    """What a stop's message says of the checkpoints there are to start again from."""
    if target and store.step_of(target) == 0:
        return f"only the start is good ({target}, the adapter as initialised): lower train.lr (e.g. 10x) and start a new run"
    if target:
        return f"the last good checkpoint is {target}. Start again from it by hand with a lower train.lr and/or train.skip_data (see events.jsonl)"
    if verdict.before_step == 0:
        return "no checkpoint predates the trouble"
    return "there is no good checkpoint to roll back to (set checkpoint.save_every)"
