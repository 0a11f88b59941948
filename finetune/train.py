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

import functools
import importlib.util
import json
import math
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune import checkpoint, families, faults, runtime
from finetune.chat import choose_template
from finetune.config import CONFIG_FILE, RunConfig, looks_local, to_yaml
from finetune.data import Datasets, load_data
from finetune.packing import epoch_batches
from finetune.distributed import (ZERO_STAGES, check_strategy, full_state_dict, gathered_trainable_state, init_deepspeed, local_numel,
                                  shard_fsdp2, stream_source, zero3_loading)
from finetune.errors import EXIT_DIVERGED, EXIT_PREEMPTED, Stopped, UserError
from finetune.guard import Guard, Verdict, data_step
from finetune.evaluate import eval_loss, exact_match
from finetune.locks import LOCK_FILE, hold_output_dir, release_output_dir
from finetune.loss import losses, trained_tokens
from finetune.metrics import EVENTS_FILE, RunLog, plot_loss_curve, write_event
from finetune.model import adapter_input_casting_off, apply_adapter, check_supported, describe, load_model, load_tokenizer
from finetune.optim import build_optimizer, build_scheduler, check_optimizer, current_lr, set_peak_lr
from finetune.stage import staged_model
from finetune.supervise import Watchdog, stop_with_launcher, watch_preemption

SUMMARY_FILE = "summary.json"


@dataclass
class RunResult:
    summary: dict
    model: torch.nn.Module  # the trained model, unwrapped (PEFT model for adapters)


@dataclass
class Schedule:
    steps_per_epoch: int
    total_steps: int


def plan_steps(cfg: RunConfig, num_rows: int, world: int) -> Schedule:
    t = cfg.train
    batches_per_rank = len(epoch_batches(num_rows, t.micro_batch_size, t.seed, 0, 0, world))
    steps_per_epoch = batches_per_rank // t.grad_accum
    if steps_per_epoch == 0:
        raise UserError(
            f"data: {num_rows} rows make {batches_per_rank} micro-batch(es) per process, fewer than "
            f"train.grad_accum={t.grad_accum}: add data or lower train.micro_batch_size / train.grad_accum"
        )
    if t.overfit_batch:
        return Schedule(steps_per_epoch, t.overfit_batch)
    total = t.max_steps or math.ceil(t.epochs * steps_per_epoch)
    return Schedule(steps_per_epoch, total)


@functools.lru_cache(maxsize=2)
def _epoch_batches(num_rows: int, micro_batch_size: int, seed: int, epoch: int, rank: int, world: int) -> list[list[int]]:
    return epoch_batches(num_rows, micro_batch_size, seed, epoch, rank, world)


def batches_at(data: Datasets, cfg: RunConfig, schedule: Schedule, position: int, rank: int, world: int, pad_id: int):
    """(epoch, micro-batches, real tokens) for the data step `position` on this rank.

    A pure function of the position: a resumed or rolled-back run reads exactly what it should.
    """
    t = cfg.train
    epoch, k = (0, 0) if t.overfit_batch else divmod(position, schedule.steps_per_epoch)
    batches = _epoch_batches(len(data.train), t.micro_batch_size, t.seed, epoch, rank, world)
    chunk = batches[k * t.grad_accum : (k + 1) * t.grad_accum]
    real = sum(data.train.tokens(idx) for idx in chunk)  # padding excluded
    return epoch, [data.train.batch(idx, pad_id) for idx in chunk], real


FIRST_STEPS_CHECKED = 10


def check_first_steps(step: int, loss: float) -> None:
    """A loss of exactly 0 or not finite in the first steps means nothing useful is being trained
    (peers' sharded QLoRA setups have trained for days at loss 0 with NaN gradient norms): stop before
    the update is applied and before more of the allocation is spent. Every rank sees the same
    reduced loss, so all stop together."""
    if loss == 0.0 or not math.isfinite(loss):
        raise Stopped(
            f"step {step + 1}: the training loss is {loss} in the first {FIRST_STEPS_CHECKED} steps, so the model is not learning; "
            "stopped. Usual causes: a learning rate far too high, fp16 overflow, every label masked, or a quantized base whose "
            "storage dtype does not match what the sharding strategy flattens", EXIT_DIVERGED
        )


def make_accelerator(cfg: RunConfig):
    from accelerate import Accelerator

    mp = cfg.train.mixed_precision
    cuda = torch.cuda.is_available()
    if mp == "fp16" and not cuda:
        raise UserError("train.mixed_precision: fp16 needs a GPU (accelerate runs fp16 with loss scaling on GPUs only); use bf16 on CPU")
    if mp == "fp8":
        if not cuda or torch.cuda.get_device_capability() < (8, 9):
            raise UserError("train.mixed_precision: fp8 needs an NVIDIA GPU of compute capability 8.9+ (Ada/Hopper); use bf16")
        if not any(importlib.util.find_spec(p) for p in ("torchao", "transformer_engine")):
            raise UserError("train.mixed_precision: fp8 needs torchao or transformer_engine installed")
    if cfg.train.tf32 and cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    trackers = []
    for name in cfg.logging.report_to:
        if importlib.util.find_spec(name) is None:
            raise UserError(f"logging.report_to: '{name}' is not installed (pip install {name}) or remove it")
        trackers.append(name)
    runtime.check_launcher_strategy(cfg)
    runtime.join_restarted_workers()
    # Under FSDP the shards' MixedPrecisionPolicy, under ZeRO DeepSpeed's bf16 mode, do what autocast would
    # (sharding applies with several processes only; launchers set WORLD_SIZE).
    if cfg.distributed.strategy not in ("ddp", "none") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        mp = "no"
    handlers = []
    if mp == "fp8" and importlib.util.find_spec("torchao"):
        from accelerate.utils import AORecipeKwargs

        # fp8 runs unsharded here (config.py): torchao's FSDP float8 all-gather would only turn the weights into
        # tensor subclasses that safetensors cannot save (seen on an H100, docs/platform-notes.md).
        handlers.append(AORecipeKwargs(enable_fsdp_float8_all_gather=False))
    return Accelerator(mixed_precision=mp, cpu=not cuda, log_with=trackers or None, project_dir=cfg.train.output_dir, kwargs_handlers=handlers)


def run(cfg: RunConfig) -> RunResult:
    """Train as configured. Returns a summary (also printed by the main process).

    The main process holds the output directory's lock for the whole run: one run per directory."""
    lock = claim_output_dir(Path(cfg.train.output_dir)) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        return _run(cfg)
    finally:
        try:
            checkpoint.wait()  # a save in flight completes before the run lets go of its folder
        finally:
            if lock is not None:
                release_output_dir(lock)


def claim_output_dir(out: Path):
    """Create and lock the output directory. A directory with files of its own that is not a finetune
    run's is refused: a run writes README.md, config.json and more, and must not replace a user's."""
    if out.exists() and not out.is_dir():
        raise UserError(f"train.output_dir: {out} is a file; expected a folder (or a path to create)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"train.output_dir: cannot create {out} ({err.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"train.output_dir: {out} is not writable")
    ours = {CONFIG_FILE, LOCK_FILE, checkpoint.CHECKPOINTS}  # a run's, or checkpoints brought here to resume from
    names = {p.name for p in out.iterdir()}
    if names and not names & ours:
        raise UserError(f"train.output_dir: {out} holds files that are not a finetune run's ({', '.join(sorted(names)[:3])}); "
                        "choose an empty or new folder")
    return hold_output_dir(out)


def _run(cfg: RunConfig) -> RunResult:
    from accelerate.utils import set_seed

    preemption = watch_preemption()
    stop_with_launcher()

    t = cfg.train
    out = Path(t.output_dir)
    check_supported(cfg)
    check_optimizer(t)
    check_strategy(cfg)
    accelerator = make_accelerator(cfg)
    main, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    if cfg.distributed.strategy == "none" and world > 1:
        raise UserError(f"distributed.strategy: none, but {world} processes were started; choose ddp, fsdp or a zero strategy, or start one process")
    say = print if main else (lambda *_: None)
    set_seed(t.seed)
    if main:
        (out / CONFIG_FILE).write_text(to_yaml(cfg))

    # One process per node copies the model to RAM (model.ramdisk); everything loads from that copy.
    model_cfg = staged_model(cfg.model, say=print if world == 1 else lambda m: print(f"[rank {rank}] {m}"))

    # Data: one process per node tokenizes (and fills the cache) while the others wait for its lock;
    # then all of them memory-map the same files.
    tokenizer = load_tokenizer(model_cfg)
    choose_template(tokenizer, cfg.data.chat_template, cfg.data.format, say=say)
    data = load_data(cfg.data, tokenizer, t.seed, eval_examples=cfg.eval.generate_samples if main else 0,
                     say=print if world == 1 else lambda m: print(f"[rank {rank}] {m}"))
    stop_if_preempted(preemption.signal is not None, preemption.name, out, main, "while the data loaded")
    schedule = plan_steps(cfg, len(data.train), world)
    s = data.stats["train"]
    say(
        f"data: {s['samples']} samples -> {s['rows']} rows, {s['tokens']} tokens"
        + (f", {s['fill']:.0%} of packed rows filled" if "fill" in s else "")
        + f", {s['truncated']} truncated; {len(data.eval) if data.eval else 0} eval rows; cache {'hit' if data.stats['cache_hit'] else 'written'} ({data.stats['seconds']:.1f} s)"
    )
    if len(s["sources"]) > 1:
        for source in s["sources"]:
            say(f"  {source['path']}: {source['samples']} samples, {source['tokens']} tokens")

    # Model and method. Sharding strategies apply with several processes; one process runs plainly.
    strategy = cfg.distributed.strategy if world > 1 else "single"
    fsdp, zero = strategy == "fsdp", strategy in ZERO_STAGES
    rss_before_model = runtime.current_rss()
    zero3_partitioning = zero3_loading(cfg, world)  # noqa: F841  (must stay alive while loading)
    stream_from = stream_source(cfg.model_copy(update={"model": model_cfg}), say) if fsdp else None
    model = load_model(model_cfg, accelerator.device, skeleton="meta" if fsdp and rank != 0 else "empty" if stream_from else None, say=say)
    # Saved configs name the source, not a RAM copy; a local one by its absolute path, so that the adapter
    # loads from any directory (AutoPeftModelForCausalLM reads it); hub ids stay as they are.
    base = str(Path(cfg.model.name_or_path).expanduser().resolve()) if looks_local(cfg.model.name_or_path) else cfg.model.name_or_path
    model.name_or_path = model.config.name_or_path = base
    router_coef = families.router_aux_loss_coef(model.config.to_dict()) if t.router_aux_loss_coef is None else t.router_aux_loss_coef
    model = apply_adapter(model, cfg.adapter, t.gradient_checkpointing, say=say)
    info = describe(model)
    q = cfg.model.quantization
    method = cfg.adapter.method if q is None else f"{cfg.adapter.method} on a {q.bits}-bit base" + (f" ({q.quant_type})" if q.bits == 4 else "")
    say(
        f"model: {cfg.model.name_or_path} ({method}), {info['trainable_params']:,} trainable of "
        f"{info['total_params']:,} params ({info['trainable_params'] / info['total_params']:.2%}), "
        f"{info['param_bytes'] / 2**20:.1f} MiB of weights"
    )
    if "unquantized" in info:
        say(f"quantized: {info['quantized_linears']} linear layers; kept in {cfg.model.dtype if cfg.model.dtype != 'auto' else 'their'} precision: {info['unquantized']}")
    say(
        f"batch: {t.micro_batch_size} micro x {t.grad_accum} accum x {world} process(es) = "
        f"{t.micro_batch_size * t.grad_accum * world} rows per step; {schedule.total_steps} steps "
        f"({schedule.steps_per_epoch} per epoch)"
    )

    before = None
    if cfg.eval.generate_samples and main and data.eval_examples:
        before = exact_match(model, tokenizer, data.eval_examples[: cfg.eval.generate_samples], cfg.data.format, cfg.eval.max_new_tokens)
        say(f"before training: exact match {before['exact_match']:.1%} on {before['n']} eval prompts")

    # Spread the model over the processes, then build the optimizer on what each process holds.
    if fsdp:
        model = shard_fsdp2(model, cfg, accelerator.device, world, stream_from)
    elif not zero:
        model = accelerator.prepare(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, t, zero_offload=strategy == "zero3_offload")
    scheduler = build_scheduler(optimizer, t, schedule.total_steps)  # drives the lr of the groups DeepSpeed wraps too
    if zero:
        model, optimizer = init_deepspeed(model, optimizer, cfg, world)
    elif not fsdp:
        optimizer = accelerator.prepare(optimizer)
    layout = "dcp" if fsdp else "deepspeed" if zero else "full"
    background = layout != "deepspeed" and (cfg.checkpoint.async_save if cfg.checkpoint.async_save is not None else cfg.adapter.method != "full")
    if cfg.logging.report_to:
        accelerator.init_trackers("finetune", config={k: v for k, v in cfg.model_dump(mode="json")["train"].items() if v is not None and not isinstance(v, list)})
    resumed = resume(cfg, model, optimizer, scheduler, accelerator, layout)
    start_step, tokens_seen = resumed.step, resumed.tokens
    log = RunLog(out, schedule.total_steps, accelerator, main, cfg.logging.progress_bar, start_step)
    for kind, message in resumed.events:
        log.event(kind, start_step, message)
    guard = Guard(cfg.guard, resumed.guard_state)
    set_peak_lr(scheduler, t.lr * guard.state.lr_scale)  # the config's LR wins over the checkpoint's (OPT's logbook)
    watchdog = Watchdog(cfg.watchdog, on_hang=lambda message: log.event("hang", watchdog.step, f"rank {rank}: {message}", any_rank=True))
    last_save = time.monotonic()

    def evaluate(step: int) -> dict | None:
        if not data.eval:
            return None
        result = eval_loss(model, data.eval, t.micro_batch_size, tokenizer.pad_token_id, accelerator, cfg.eval.max_batches)
        log.write({"step": step, **result})
        log.print(f"step {step}: eval loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.2f}")
        return result

    def save(step: int, epoch: int) -> None:
        trainer_state = {"tokens": tokens_seen, "epoch": epoch, "guard": guard.state_dict(), "good": guard.is_healthy(step)}
        began = time.perf_counter()
        saved = checkpoint.save(out, step, model, optimizer, scheduler, trainer_state, to_yaml(cfg), accelerator,
                                cfg.checkpoint.keep_last, layout, background)
        if saved:  # the seconds training waited (bench/large.py compares them with and without background writes)
            log.print(f"step {step}: checkpoint {'being written in the background to' if background else 'saved to'} {saved} "
                      f"(training paused {time.perf_counter() - began:.2f} s)")

    def roll_back(trouble_step: int, verdict: Verdict) -> tuple[int, int]:
        """Back to the newest good checkpoint before the trouble, with a lower LR and the data that led
        to the trouble skipped; or stop with what was seen."""
        target = checkpoint.find_good(out, verdict.before_step)  # at or before the trouble (a drift: its lowest level)
        if verdict.action == "stop" or target is None:
            if target:
                where = (f"the last good checkpoint is {target}. Start again from it by hand with a lower train.lr and/or "
                         "train.skip_data (see events.jsonl)")
            elif verdict.before_step == 0:
                where = "no checkpoint predates the trouble"
            else:
                where = "there is no good checkpoint to roll back to (set checkpoint.save_every)"
            log.event("stop", trouble_step, f"guard: {verdict.reason}; {where}")
            raise Stopped(f"step {trouble_step + 1}: training diverged: {verdict.reason}; {where}", EXIT_DIVERGED)
        state = checkpoint.restore(target, model, optimizer, scheduler, accelerator, layout)
        guard.rolled_back(state["step"], trouble_step, saved=state.get("guard"))
        set_peak_lr(scheduler, t.lr * guard.state.lr_scale)
        log.event("rollback", trouble_step, f"guard: {verdict.reason}; rolled back to {target.name}, LR x{guard.state.lr_scale:g} "
                  f"(now {t.lr * guard.state.lr_scale:.3g}), batches of steps {state['step'] + 1}-{trouble_step + 1} skipped"
                  + (f", clipping at {guard.state.max_grad_norm}" if guard.state.max_grad_norm else ""))
        return state["step"], state["tokens"]

    # Every rank agrees whether a signal came during set-up (there is nothing to save yet).
    signalled = accelerator.reduce(torch.tensor(float(preemption.signal is not None), device=accelerator.device), "sum").item() > 0
    stop_if_preempted(signalled, preemption.name, out, main, "before the first step")
    runtime.keep_freed_memory(gathers=fsdp or ZERO_STAGES.get(strategy) == 3)
    runtime.reset_peak_rss()
    if cfg.eval.on_start and start_step == 0:
        evaluate(0)

    # The loop. `step` counts optimizer steps done; the data it reads is a function of it.
    model.train()
    # Set once for the loop (not per micro-batch: it walks every module); lifted before the
    # generation checks after it, which run outside autocast.
    casting = ExitStack()
    casting.enter_context(adapter_input_casting_off(model, accelerator.mixed_precision))
    started, last = time.perf_counter(), {}
    window_tokens, window_start = 0, started
    step = start_step
    while step < schedule.total_steps:
        watchdog.start_step(step)
        faults.inject(step, rank)
        position = data_step(step, guard.state.skip_windows + [list(w) for w in t.skip_data])
        epoch, micro_batches, real_tokens = batches_at(data, cfg, schedule, position, rank, world, tokenizer.pad_token_id)
        micro_batches = [{k: v.to(accelerator.device) for k, v in b.items()} for b in micro_batches]
        # The loss is a mean over every trained token of the step, across micro-batches and ranks:
        # each micro-batch contributes its sum divided by the global count (times world size, because
        # DDP averages gradients over ranks).
        local = torch.tensor([sum(trained_tokens(b) for b in micro_batches), real_tokens], device=accelerator.device)
        global_tokens, global_real = accelerator.reduce(local, "sum").tolist()
        loss_sum, router_sum = torch.zeros((), device=accelerator.device), torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1  # gradients are reduced across ranks once per step
            if fsdp:
                model.set_requires_gradient_sync(sync)
            with nullcontext() if sync or fsdp or zero else accelerator.no_sync(model):
                parts = losses(model, batch, router=router_coef > 0)
                loss = parts.tokens * faults.loss_factor(position, rank)
                scaled = loss * (world / max(global_tokens, 1))
                if parts.router is not None:  # MoE load balancing: its mean over the step's forwards, as the model weighs it
                    scaled = scaled + parts.router * (router_coef / len(micro_batches))
                    router_sum += parts.router.detach()
                if zero:
                    model.backward(scaled, scale_wrt_gas=False)  # already normalised over the whole step
                    model.step()  # DeepSpeed reduces, clips and updates at the last micro-batch only
                else:
                    accelerator.backward(scaled)
            loss_sum += loss.detach()
        # One all-reduce and host sync per step: the guard judges the step before it is applied, and
        # every rank must agree to save or stop (the preemption signal and the save clock ride along).
        minutes = cfg.checkpoint.save_every_minutes
        due = minutes > 0 and time.monotonic() - last_save > 60 * minutes
        local = torch.stack([loss_sum.float(), loss_sum.new_tensor(float(preemption.signal is not None)), loss_sum.new_tensor(float(due)),
                             router_sum.float()])
        total_loss, preempted, time_due, router_loss = accelerator.reduce(local, "sum").tolist()
        step_loss, preempted, time_due = total_loss / max(global_tokens, 1), preempted > 0, time_due > 0
        if step - start_step < FIRST_STEPS_CHECKED:
            check_first_steps(step, step_loss)
        if zero:
            grad_norm = model.get_global_grad_norm()  # DeepSpeed has applied the step already: no skip rung
        else:
            clip = guard.state.max_grad_norm or t.max_grad_norm or float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip).full_tensor() if fsdp else accelerator.clip_grad_norm_(params, clip)
        verdict = guard.check(step, step_loss, float(grad_norm))
        if not zero:
            if verdict.action == "apply":
                waited = checkpoint.staged()  # a background save's copy of the weights first
                if waited > 0.01:
                    log.print(f"step {step + 1}: training paused {waited:.2f} s more while the checkpoint was copied")
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if verdict.action in ("rollback", "stop"):
            watchdog.end_step()
            step, tokens_seen = roll_back(step, verdict)
            log.advance(step - log.position())
            continue
        if verdict.action == "skip" and zero:
            log.event("anomaly", step, f"guard: step {step + 1}: {verdict.reason} (DeepSpeed applied it already: only rollbacks help)")
        elif verdict.action == "skip":
            log.event("skip", step, f"guard: step {step + 1} not applied: {verdict.reason}")
        if verdict.action == "apply" or zero:
            scheduler.step()
        watchdog.end_step()

        tokens_seen += global_real
        window_tokens += global_real
        step += 1
        log.advance()
        if step % cfg.logging.log_every == 0 or step == schedule.total_steps:
            now = time.perf_counter()
            last = {
                "step": step,
                "epoch": epoch,
                "loss": step_loss,
                "grad_norm": float(grad_norm),
                "lr": current_lr(scheduler),
                "tokens": tokens_seen,
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                "elapsed_s": now - started,
                "time": time.time(),
            }
            if router_coef > 0:
                last["router_aux_loss"] = router_loss / (len(micro_batches) * world)
            log.write(last)
            window_tokens, window_start = 0, now
        if cfg.eval.every and step % cfg.eval.every == 0 and step < schedule.total_steps:
            evaluate(step)
        every = cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0
        if step < schedule.total_steps and (every or time_due or preempted):
            save(step, epoch)
            last_save = time.monotonic()
        if preempted and step < schedule.total_steps:
            checkpoint.wait()
            log.event("preempted", step, f"{preemption.name or 'a signal on another rank'}: checkpoint saved at step {step}; "
                      f"exiting with code {EXIT_PREEMPTED}, start the same command to resume")
            log.close_bar()
            runtime.finish_distributed(accelerator)
            raise Stopped(f"preempted at step {step}: checkpoint saved; start the same command to resume", EXIT_PREEMPTED)
        if step == schedule.total_steps:  # the final weights must not have drifted worse than the run's best
            verdict = guard.finish(step - 1)
            if verdict.action != "apply":
                step, tokens_seen = roll_back(step - 1, verdict)
                log.advance(step - log.position())

    log.close_bar()
    casting.close()
    checkpoint.wait()  # the last save complete: last_good may pick it, and DCP's background writes need the process group
    final_eval = evaluate(schedule.total_steps)
    summary = {"steps": schedule.total_steps, "train_loss": last.get("loss"), "tokens": tokens_seen, "elapsed_s": time.perf_counter() - started}
    if "router_aux_loss" in last:
        summary["router_aux_loss"] = last["router_aux_loss"]
    if final_eval:
        summary.update(final_eval)
    summary.update(guard.report())
    if summary["final_is_best"] is False:
        score = functools.partial(eval_loss, model, data.eval, t.micro_batch_size, tokenizer.pad_token_id, accelerator, cfg.eval.max_batches)
        summary.update(last_good(out, int(guard.state.best[0]), score if data.eval and layout == "full" else None, accelerator.unwrap_model(model)))
        say(f"the final weights are not the best seen: loss level {summary['final_loss_level']:.4g} vs {summary['best_loss_level']:.4g} at "
            f"step {summary['best_level_step']}; the last good checkpoint before it: {summary['last_good_checkpoint']}"
            + (f" (eval loss {summary['last_good_eval_loss']:.4f})" if summary.get("last_good_eval_loss") is not None else ""))

    # Save: PEFT adapter or full model, tokenizer and resolved config, in ordinary HF formats.
    accelerator.wait_for_everyone()
    unwrapped = model.module if zero else accelerator.unwrap_model(model)
    summary["world_size"] = world
    # Memory held by model, optimizer and activations while training (compare with `finetune plan`).
    summary["rss_before_model_mib"] = rss_before_model / 2**20
    summary["peak_rss_mib"] = runtime.peak_rss() / 2**20
    summary["peak_gpu_mib"] = runtime.peak_gpu() / 2**20 if torch.cuda.is_available() else None
    summary["backend"] = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    summary["strategy"] = strategy
    summary["model_loaded_from"] = model_cfg.name_or_path
    summary["base_model"] = base  # what the adapter needs (adapter_config.json names it too)
    summary["param_numel_per_rank"] = accelerator.gather(torch.tensor([local_numel(model, params)], device=accelerator.device)).tolist()
    summary["replicas_identical"] = replicas_identical(params, accelerator) if strategy in ("ddp", "single") else None
    # Sharded weights are gathered into one ordinary state dict (all ranks take part), saved by rank 0.
    state_dict = full_state_dict(model, cfg.adapter.method != "full") if fsdp else gathered_trainable_state(unwrapped) if zero else None
    if main:
        unwrapped.config.use_cache = True  # saved models generate with a KV cache
        unwrapped.save_pretrained(out, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(out)
        plot = plot_loss_curve(out) if cfg.logging.plot else None
        summary["saved_to"] = str(out)
        summary["adapter"] = cfg.adapter.method != "full"
        summary["loss_curve"] = str(plot) if plot else None
        if before is not None:
            after = exact_match(unwrapped, tokenizer, data.eval_examples[: cfg.eval.generate_samples], cfg.data.format, cfg.eval.max_new_tokens)
            summary["exact_match_before"], summary["exact_match_after"] = before["exact_match"], after["exact_match"]
            say(f"exact match on {after['n']} eval prompts: {before['exact_match']:.1%} before -> {after['exact_match']:.1%} after")
            for b, a in list(zip(before["samples"], after["samples"]))[:3]:
                say(f"  prompt {a['prompt']!r}\n    expected {a['expected']!r} | before tuning {b['got']!r} | after tuning {a['got']!r}")
    if main:
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        say(_summary_line(summary))
        checkpoint.clear_starts(out)  # a finished run ends any restart loop
    runtime.finish_distributed(accelerator)
    accelerator.end_training()  # trackers; the process group is already gone
    return RunResult(summary, unwrapped)


def stop_if_preempted(signalled: bool, name: str, out: Path, main: bool, when: str) -> None:
    """Before the loop there is nothing to save: a preemption signal ends the run at once, with the
    exit code of a preemption in the loop (so that a requeue starts it again), and says so in events.jsonl."""
    if not signalled:
        return
    message = f"preempted ({name or 'a signal on another rank'}) {when}: nothing to save yet; start the same command to begin"
    if main:
        write_event(out / EVENTS_FILE, "preempted", None, message)
    raise Stopped(message, EXIT_PREEMPTED)


def last_good(out: Path, best_step: int, evaluate, model) -> dict:
    """Where the final weights are not the best seen: the newest good checkpoint from before the best
    level, and (unsharded runs with eval data) its eval loss, the final weights put back after."""
    path = checkpoint.find_good(out, best_step)
    result = {"last_good_checkpoint": str(path) if path else None, "last_good_eval_loss": None}
    if path is None or evaluate is None:
        return result
    final = checkpoint.host_copy(checkpoint.trainable_state(model))  # a copy: loading the checkpoint overwrites the parameters
    checkpoint.load_trainable(path, model)
    result["last_good_eval_loss"] = evaluate()["eval_loss"]
    model.load_state_dict(final, strict=False)
    return result


CHECKSUM_CHUNK = 1 << 18  # elements per slice: the check's memory is a few of these, whatever the model's size


def replica_checksum(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Sum, absolute sum and position-weighted sum of every trained value, in float64, one slice at a
    time: equal on two replicas only if their weights are, and O(1) memory (no flat copy of the model)."""
    total = torch.zeros(3, dtype=torch.float64, device=params[0].device if params else "cpu")
    offset = 0
    with torch.no_grad():
        for p in params:
            flat = p.detach().reshape(-1)
            for start in range(0, flat.numel(), CHECKSUM_CHUNK):
                x = flat[start : start + CHECKSUM_CHUNK].double()
                where = torch.arange(offset + start, offset + start + x.numel(), dtype=torch.float64, device=x.device)
                total += torch.stack([x.sum(), x.abs().sum(), (x * where).sum()])
            offset += flat.numel()
    return total


def replicas_identical(params: list[torch.nn.Parameter], accelerator) -> bool:
    """True when every rank holds the same trained weights (replicas that drift apart are a silent bug)."""
    gathered = accelerator.gather(replica_checksum(params).to(accelerator.device)[None]).cpu()
    return bool((gathered == gathered[0]).all())


@dataclass
class Resumed:
    step: int = 0
    tokens: int = 0
    guard_state: dict | None = None
    events: list[tuple[str, str]] = field(default_factory=list)  # (kind, message) for events.jsonl


def resume(cfg: RunConfig, model, optimizer, scheduler, accelerator, layout: str) -> Resumed:
    """Where to start: a fresh run, or the checkpoint restored (auto: the newest complete one)."""
    result = Resumed()
    choice = cfg.checkpoint.resume
    path = None
    if choice == "auto":
        found = checkpoint.find_latest(cfg.train.output_dir)
        if found is not None:
            result.events += [("checkpoint_skipped", line) for line in found.skipped]
            path = found.path
        if path is None and (found is not None or checkpoint.starts_file(cfg.train.output_dir).exists()):
            # an earlier start of this run ended (killed, crashed) before it saved a complete checkpoint
            result.events.append(("restart", "no complete checkpoint to resume from: starting afresh"))
    elif choice != "never":
        path = Path(choice)
        problem = checkpoint.verify(path) if path.is_dir() else "not a folder"
        if problem:
            raise UserError(f"checkpoint.resume: {choice}: {problem}")
    if path is not None:
        check_config_change(path, cfg, result)
    _check_restart_loop(cfg, path, accelerator)
    if path is None:
        return result
    began = time.perf_counter()
    try:
        state = checkpoint.restore(path, model, optimizer, scheduler, accelerator, layout)
    except ValueError as err:
        raise UserError(f"checkpoint.resume: {err}") from None
    result.step, result.tokens, result.guard_state = state["step"], state["tokens"], state.get("guard")
    result.events.append(("restart", f"resumed from {path} at step {state['step']} ({time.perf_counter() - began:.1f} s)"))
    return result


def check_config_change(path: Path, cfg: RunConfig, result: Resumed) -> None:
    """Settings that change what is trained must match the checkpoint's; the rest may change (and a
    new LR or clipping then wins over the checkpoint's)."""
    import yaml

    from finetune.config import config_changes

    breaking, harmless = config_changes(yaml.safe_load((path / CONFIG_FILE).read_text()) or {}, cfg)
    if breaking and not cfg.checkpoint.allow_config_change:
        raise UserError(f"checkpoint.resume: {path} was written with a different config: {'; '.join(breaking[:4])}. "
                        "Start in a new train.output_dir, or set checkpoint.allow_config_change: true to resume anyway")
    if breaking or harmless:
        result.events.append(("config_change", "resuming with changed settings: " + "; ".join(breaking + harmless)))


def _check_restart_loop(cfg: RunConfig, path: Path | None, accelerator) -> None:
    """Refuse to start for the N+1-th time in a row from the same checkpoint with the same config:
    each of those starts crashed before saving anything newer."""
    if cfg.checkpoint.resume == "never":
        return
    step = (path and checkpoint.step_of(path)) or 0
    starts = checkpoint.count_starts(cfg.train.output_dir, step, to_yaml(cfg))
    accelerator.wait_for_everyone()  # every rank has read the record before it changes
    if starts > cfg.checkpoint.max_restarts_without_progress:
        raise Stopped(
            f"restart loop: {starts - 1} starts in a row resumed from {'step ' + str(step) if step else 'the beginning'} and "
            f"crashed before saving a newer checkpoint (checkpoint.max_restarts_without_progress: "
            f"{cfg.checkpoint.max_restarts_without_progress}); find the cause in the logs, then delete "
            f"{checkpoint.starts_file(cfg.train.output_dir)} to try again", EXIT_DIVERGED)
    if accelerator.is_main_process:
        checkpoint.record_start(cfg.train.output_dir, step, to_yaml(cfg), starts)


def _summary_line(summary: dict) -> str:
    parts = [f"done: {summary['steps']} steps, final train loss {summary['train_loss']:.4f}"]
    if "eval_loss" in summary:
        parts.append(f"eval loss {summary['eval_loss']:.4f} (ppl {summary['eval_ppl']:.2f})")
    parts.append(f"{summary['elapsed_s']:.1f} s")
    lines = [", ".join(parts)]
    if summary.get("loss_curve"):
        lines.append(f"loss curve: {summary['loss_curve']}")
    lines.append(f"saved to:   {summary['saved_to']}" + (f" (an adapter for {summary['base_model']})" if summary.get("adapter") else ""))
    return "\n".join(lines)
