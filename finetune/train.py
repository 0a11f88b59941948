"""The training recipe: YAML config in, adapter (or full model) out. Read it top to bottom.

Started any of these ways, all the same run:
    accelerate launch finetune/train.py --config configs/lora.yaml
    torchrun --nproc_per_node 2 finetune/train.py --config configs/lora.yaml
    finetune train --config configs/lora.yaml      (python -m finetune train ...)
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    # Run as a script (accelerate launch / torchrun): the same as `python -m finetune train ...`, run
    # from the package (not from this folder, whose files would shadow libraries of the same name)
    # before anything else is imported, so that the recipe is imported once, as finetune.train.
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    sys.argv[1:1] = ["train"]
    runpy.run_module("finetune", run_name="__main__", alter_sys=True)

import gc
import os
import time
from pathlib import Path

import torch

from finetune.checkpoint.locks import hold_output_dir, release_output_dir
from finetune.checkpoint.resume import starting_point
from finetune.config import faults
from finetune.config.files import to_yaml
from finetune.config.schema import CONFIG_FILE, RunConfig
from finetune.model.loading import adapter_input_casting_off
from finetune.outputs.finish import finish
from finetune.parallel import runtime
from finetune.parallel.optim import current_lr
from finetune.run import preflight
from finetune.run.build import load_inputs, load_model
from finetune.run.elastic import batch_at_this_size
from finetune.run.guard import FIRST_STEPS_CHECKED, check_first_steps, data_step
from finetune.run.recovery import resume_or_start, roll_back, save, start_point, stop_preempted
from finetune.run.state import RunResult, RunState, StepOutcome, evaluate, logged, skipped
from finetune.run.steps import saved_on_cpu, step_batches, trained_samples
from finetune.run.supervise import release_preemption, stop_if_preempted, stop_with_launcher, watch_preemption


def run(cfg: RunConfig) -> RunResult:
    """Train as configured. Returns a summary (also printed by the main process).

    The main process holds the output directory's lock for the whole run: one run per directory."""
    preflight.check(cfg)
    lock = hold_output_dir(Path(cfg.train.output_dir)) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        return _run(cfg)
    finally:
        release_preemption()
        if lock is not None:
            release_output_dir(lock)
        # The run's model and optimizer sit in reference cycles (accelerate's and peft's hooks): freed now,
        # not at the interpreter's next full collection, so a process that trains again (a sweep, a
        # notebook, the GPU tests) starts with the last run's weights off its GPU (docs/platform-notes.md).
        # Not in a rank of several, which exits next (cli.exit_rank): collecting there can free gloo's
        # process group while its worker threads wait for the GIL the collection holds, a deadlock.
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _run(cfg: RunConfig) -> RunResult:
    state = setup(cfg)
    try:
        if state.progress.step == 0:
            start_point(state)
        # Adapter inputs stay uncast for the whole loop (set once: it walks every module); lifted before
        # the evaluation and generation after it, which run outside autocast.
        with adapter_input_casting_off(state.engine.model, state.accelerator.mixed_precision):
            try:
                train_loop(state)
            except RuntimeError as err:
                raise runtime.timed_out(err, state.cfg.distributed.collective_timeout, state.log, state.progress.step) or err
        return finish(state)
    finally:
        state.watchdog.close()
        state.engine.checkpointer.wait()  # a save in flight completes before the run lets go of its folder


# ------------------------------------------------------------------------------------------------
# Setup: data, model, optimizer, resume


def setup(cfg: RunConfig) -> RunState:
    from accelerate.utils import set_seed

    preemption = watch_preemption()
    stop_with_launcher()
    accelerator = runtime.make_accelerator(cfg)
    set_seed(cfg.train.seed)
    start = starting_point(cfg)
    cfg, resized, batch = batch_at_this_size(cfg, start, accelerator, preemption)
    if accelerator.is_main_process:
        (Path(cfg.train.output_dir) / CONFIG_FILE).write_text(to_yaml(cfg))
    state = load_inputs(cfg, accelerator, preemption)
    load_model(state)
    resume_or_start(state, start, [("resize", resized)] if resized else [])
    state.progress.batch = batch
    # Every rank agrees whether a signal came during set-up (there is nothing to save yet).
    signalled = accelerator.reduce(torch.tensor(float(preemption.signal is not None), device=accelerator.device), "sum").item() > 0
    stop_if_preempted(signalled, preemption.name, state.out, state.main, "before the first step")
    tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len / cfg.distributed.sequence_parallel  # a process's share of a micro-batch
    runtime.keep_freed_memory(gathers=state.engine.gathers, quantized=cfg.model.quantization is not None, long_rows=tokens >= runtime.LONG_ROWS)
    state.peak_rss_since = "the first step" if runtime.reset_peak_rss() else "the process's start"
    return state


# ------------------------------------------------------------------------------------------------
# The loop


def train_loop(state: RunState) -> None:
    """Steps until the schedule's end. The data a step reads is a function of `state.progress.step`."""
    cfg, log, total = state.cfg, state.log, state.schedule.total_steps
    state.engine.model.train()
    state.started = window_start = time.perf_counter()
    window_tokens = 0
    while state.progress.step < total:
        state.watchdog.start(state.progress.step)
        done = train_step(state)
        state.watchdog.end()
        if done.verdict.action in ("rollback", "stop"):
            state.progress = roll_back(state, state.progress.step, done.verdict)
            log.advance(state.progress.step - log.position())
            continue
        if done.verdict.action == "skip":
            log.event("anomaly" if done.moved else "skip", state.progress.step,
                      f"guard: step {state.progress.step + 1}: {done.verdict.reason} (applied already, inside backward: only rollbacks help)"
                      if done.moved else f"guard: step {state.progress.step + 1} not applied: {done.verdict.reason}")
        state.progress.tokens += done.real_tokens
        state.progress.epoch = done.epoch
        window_tokens += done.real_tokens
        state.progress.step += 1
        log.advance()
        if logged(state, state.progress.step):
            now = time.perf_counter()
            state.last = {"step": state.progress.step, "epoch": done.epoch, "loss": done.loss, "grad_norm": done.grad_norm,
                          "lr": current_lr(state.engine.scheduler), "tokens": state.progress.tokens,
                          "tokens_per_s": window_tokens / max(now - window_start, 1e-9), "elapsed_s": now - state.started, "time": time.time()}
            if done.router_loss is not None:
                state.last["router_aux_loss"] = done.router_loss
            state.last.update(done.metrics)
            if done.samples is not None:
                state.last["samples"] = done.samples
            log.write(state.last)
            window_tokens, window_start = 0, now
        if cfg.eval.every and state.progress.step % cfg.eval.every == 0 and state.progress.step < total:
            evaluate(state, state.progress.step)
        every = cfg.checkpoint.save_every and state.progress.step % cfg.checkpoint.save_every == 0
        if state.progress.step < total and (every or done.time_due or done.preempted):
            save(state)
        if done.preempted and state.progress.step < total:
            stop_preempted(state)
        if state.progress.step == total:  # the final weights must not have drifted worse than the run's best
            verdict = state.guard.finish(state.progress.step - 1)
            if verdict.action != "apply":
                state.progress = roll_back(state, state.progress.step - 1, verdict)
                log.advance(state.progress.step - log.position())
    log.close_bar()


def train_step(state: RunState) -> StepOutcome:
    """Forward and backward over the step's micro-batches; the guard judges the step before the
    engine applies it. One all-reduce and host sync: every rank takes the same decision."""
    cfg, engine, accelerator, step = state.cfg, state.engine, state.accelerator, state.progress.step
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    averaged = state.row_share.averaged_over(world)  # the processes the gradients are averaged over
    faults.inject(step, rank, engine.checkpointer.wait, lambda: state.preemption.signal is not None)
    position = data_step(step, skipped(state))
    epoch, micro_batches, totals, global_real = step_batches(state, position)
    # The loss is a mean over every trained token (or pair) of the step, across micro-batches and ranks:
    # each micro-batch contributes its sum divided by the global count (times the processes the
    # gradients are averaged over: DDP, FSDP and ZeRO average them).
    objective = state.objective
    loss_sum, router_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    metric_sums = torch.zeros(len(objective.metrics), device=device)
    for i, batch in enumerate(micro_batches):
        with engine.accumulating(last=i == len(micro_batches) - 1):  # gradients are reduced across ranks once per step
            with saved_on_cpu(cfg.train.offload_activations):
                parts = objective.losses(engine.model, batch, totals, router=state.router_coef > 0)
            loss = parts.tokens * faults.loss_factor(position, rank)
            scaled = loss * (averaged / max(totals[0], 1))
            if parts.router is not None:  # MoE load balancing: its mean over the step's forwards, as the model weighs it
                scaled = scaled + parts.router * (state.router_coef / len(micro_batches))
                router_sum += parts.router.detach()
            engine.backward(scaled)
        loss_sum += loss.detach()
        if parts.metrics is not None:
            metric_sums += parts.metrics.float()
    # The preemption signal and the save clock ride along with the loss; the gradient norm (the same on
    # every rank) joins them after the sum: the step's one host sync.
    minutes = cfg.checkpoint.save_every_minutes
    due = minutes > 0 and time.monotonic() - state.last_save > 60 * minutes
    counted = float(state.row_share.counts)  # a row shared whole (tensor parallel) is summed once
    local = torch.stack([loss_sum.float() * counted, loss_sum.new_tensor(float(state.preemption.signal is not None)), loss_sum.new_tensor(float(due)),
                         router_sum.float() * counted, *(metric_sums * counted)])
    norm = engine.clip(state.guard.state.max_grad_norm or cfg.train.max_grad_norm or float("inf"))
    norm = torch.as_tensor(norm, dtype=torch.float32, device=device).reshape(1)
    total_loss, preempted, time_due, router_loss, *metric_totals, grad_norm = torch.cat([accelerator.reduce(local, "sum"), norm]).tolist()
    step_loss = total_loss / max(totals[0], 1)
    metrics = {name: value / max(totals[c], 1) for name, value, c in zip(objective.metrics, metric_totals, objective.mean_over)}
    if step - state.start_step < FIRST_STEPS_CHECKED and objective.levels:  # GRPO's loss is 0 where no group's rewards differ
        check_first_steps(step, step_loss)
    verdict = state.guard.check(step, objective.watched(step_loss, metrics), grad_norm, metrics.get("kl"))
    if verdict.action == "apply":
        waited = engine.checkpointer.staged()  # a background save's copy of the weights first
        if waited > 0.01:
            state.log.print(f"step {step + 1}: training paused {waited:.2f} s more while the checkpoint was copied")
    moved = engine.apply(verdict.action == "apply")
    return StepOutcome(epoch, step_loss, grad_norm, verdict, moved, int(global_real),
                       router_loss / (len(micro_batches) * world) if state.router_coef > 0 else None, preempted > 0, time_due > 0, metrics,
                       trained_samples(state, position) if cfg.logging.sample_ids and logged(state, step + 1) else None)
