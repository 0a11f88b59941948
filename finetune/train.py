"""The training recipe: YAML config in, adapter (or full model) out. Read it top to bottom.

Started any of these ways, all the same run:
    accelerate launch finetune/train.py --config configs/lora.yaml
    torchrun --nproc_per_node 2 finetune/train.py --config configs/lora.yaml
    finetune train --config configs/lora.yaml      (python -m finetune train ...)
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script (accelerate launch / torchrun): import the package, not sibling files that would
    # shadow libraries of the same name.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed warns about it on every import

from finetune import checkpoint, faults
from finetune.config import RunConfig, to_yaml
from finetune.data import Datasets, collate, epoch_batches, load_data
from finetune.distributed import (ZERO_STAGES, check_strategy, full_state_dict, gathered_trainable_state, init_deepspeed, local_numel,
                                  shard_fsdp2, zero3_loading)
from finetune.errors import UserError
from finetune.evaluate import eval_loss, exact_match, token_loss_sum, trained_tokens
from finetune.metrics import RunLog, plot_loss_curve
from finetune.model import apply_adapter, check_supported, describe, load_model, load_tokenizer
from finetune.optim import build_optimizer, build_scheduler, check_optimizer

CONFIG_FILE = "finetune_config.yaml"
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


def step_batches(data: Datasets, cfg: RunConfig, schedule: Schedule, rank: int, world: int, pad_id: int, start_step: int = 0):
    """Yield (epoch, micro-batches, real tokens) for each optimizer step from start_step on.

    Position in the data is a pure function of the step, so a resumed run picks up exactly where the
    interrupted one was.
    """
    t = cfg.train
    for step in range(start_step, schedule.total_steps):
        epoch, k = (0, 0) if t.overfit_batch else divmod(step, schedule.steps_per_epoch)
        if step == start_step or k == 0:
            batches = epoch_batches(len(data.train), t.micro_batch_size, t.seed, epoch, rank, world)
        chunk = batches[k * t.grad_accum : (k + 1) * t.grad_accum]
        real = sum(len(data.train[i].input_ids) for idx in chunk for i in idx)  # padding excluded
        yield epoch, [collate([data.train[i] for i in idx], pad_id) for idx in chunk], real


FIRST_STEPS_CHECKED = 10


def check_first_steps(step: int, loss: float) -> None:
    """A loss of exactly 0 or not finite in the first steps means nothing useful is being trained
    (peers' sharded QLoRA setups have trained for days at loss 0 with NaN gradient norms): stop before
    the update is applied and before more of the allocation is spent. Every rank sees the same
    reduced loss, so all stop together."""
    if loss == 0.0 or not math.isfinite(loss):
        raise UserError(
            f"step {step + 1}: the training loss is {loss} in the first {FIRST_STEPS_CHECKED} steps, so the model is not learning; "
            "stopped. Usual causes: a learning rate far too high, fp16 overflow, every label masked, or a quantized base whose "
            "storage dtype does not match what the sharding strategy flattens"
        )


def check_launcher_strategy(cfg: RunConfig) -> None:
    """An accelerate config that asks for FSDP or DeepSpeed must agree with the run config: never a
    silent fall-back to DDP. finetune applies the strategy itself, so accelerate's own plugin is
    switched off once the two agree."""
    env = os.environ
    asked = None
    if env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        asked, flag = "fsdp", "ACCELERATE_USE_FSDP"
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        offload = any(env.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{k}_DEVICE", "none") not in ("", "none") for k in ("OPTIMIZER", "PARAM"))
        asked, flag = f"zero{stage}" + ("_offload" if offload else ""), "ACCELERATE_USE_DEEPSPEED"
    if asked is None:
        return
    if cfg.distributed.strategy != asked:
        offered = "ddp, fsdp, zero2, zero3, zero3_offload"
        fix = f"set distributed.strategy: {asked}" if asked in offered.split(", ") else f"use an accelerate config for one of: {offered}"
        raise UserError(f"accelerate config asks for {asked} but the run config has distributed.strategy: {cfg.distributed.strategy}; "
                        f"{fix} (finetune applies the strategy itself)")
    env[flag] = "false"


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
    check_launcher_strategy(cfg)
    # Under FSDP the shards' MixedPrecisionPolicy, under ZeRO DeepSpeed's bf16 mode, do what autocast would
    # (sharding applies with several processes only; launchers set WORLD_SIZE).
    if cfg.distributed.strategy not in ("ddp", "none") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        mp = "no"
    return Accelerator(mixed_precision=mp, cpu=not cuda, log_with=trackers or None, project_dir=cfg.train.output_dir)


def run(cfg: RunConfig) -> RunResult:
    """Train as configured. Returns a summary (also printed by the main process)."""
    from accelerate.utils import set_seed

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
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(to_yaml(cfg))

    # Data: the main process tokenizes (and fills the cache) first; the others then read the cache.
    tokenizer = load_tokenizer(cfg.model)
    with accelerator.main_process_first():
        data = load_data(cfg.data, tokenizer, t.seed, keep_eval_examples=cfg.eval.generate_samples > 0)
    schedule = plan_steps(cfg, len(data.train), world)
    s = data.stats["train"]
    say(
        f"data: {s['samples']} samples -> {s['rows']} rows, {s['tokens']} tokens"
        + (f", {s['fill']:.0%} of packed rows filled" if "fill" in s else "")
        + f", {s['truncated']} truncated; {len(data.eval)} eval rows; cache {'hit' if data.stats['cache_hit'] else 'written'}"
    )

    # Model and method. Sharding strategies apply with several processes; one process runs plainly.
    strategy = cfg.distributed.strategy if world > 1 else "single"
    fsdp, zero = strategy == "fsdp", strategy in ZERO_STAGES
    rss_before_model = current_rss()
    reset_peak_rss()
    zero3_partitioning = zero3_loading(cfg, world)  # noqa: F841  (must stay alive while loading)
    model = load_model(cfg.model, accelerator.device, skeleton=fsdp and rank != 0)
    model = apply_adapter(model, cfg.adapter, t.gradient_checkpointing)
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
        model = shard_fsdp2(model, cfg, accelerator.device, world)
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
    load_peak_rss = peak_rss()
    if cfg.logging.report_to:
        accelerator.init_trackers("finetune", config={k: v for k, v in cfg.model_dump(mode="json")["train"].items() if v is not None and not isinstance(v, list)})
    start_step, tokens_seen = resume(cfg, model, optimizer, scheduler, accelerator, say, layout)
    log = RunLog(out, schedule.total_steps, accelerator, main, cfg.logging.progress_bar, start_step)

    def evaluate(step: int) -> dict | None:
        if not data.eval:
            return None
        result = eval_loss(model, data.eval, t.micro_batch_size, tokenizer.pad_token_id, accelerator, cfg.eval.max_batches)
        log.write({"step": step, **result})
        log.print(f"step {step}: eval loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.2f}")
        return result

    reset_peak_rss()
    if cfg.eval.on_start and start_step == 0:
        evaluate(0)

    # The loop.
    model.train()
    started, last = time.perf_counter(), {}
    window_tokens, window_start = 0, started
    batches = step_batches(data, cfg, schedule, rank, world, tokenizer.pad_token_id, start_step)
    for step, (epoch, micro_batches, real_tokens) in enumerate(batches, start=start_step):
        faults.inject(step, rank)
        micro_batches = [{k: v.to(accelerator.device) for k, v in b.items()} for b in micro_batches]
        # The loss is a mean over every trained token of the step, across micro-batches and ranks:
        # each micro-batch contributes its sum divided by the global count (times world size, because
        # DDP averages gradients over ranks).
        local = torch.tensor([sum(trained_tokens(b) for b in micro_batches), real_tokens], device=accelerator.device)
        global_tokens, global_real = accelerator.reduce(local, "sum").tolist()
        loss_sum = torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1  # gradients are reduced across ranks once per step
            if fsdp:
                model.set_requires_gradient_sync(sync)
            with nullcontext() if sync or fsdp or zero else accelerator.no_sync(model):
                loss = token_loss_sum(model, batch) * faults.loss_factor(step, rank)
                scaled = loss * (world / max(global_tokens, 1))
                if zero:
                    model.backward(scaled, scale_wrt_gas=False)  # already normalised over the whole step
                    model.step()  # DeepSpeed reduces, clips and updates at the last micro-batch only
                else:
                    accelerator.backward(scaled)
            loss_sum += loss.detach()
        if step - start_step < FIRST_STEPS_CHECKED:
            check_first_steps(step, accelerator.reduce(loss_sum.clone(), "sum").item() / max(global_tokens, 1))
        if zero:
            grad_norm = model.get_global_grad_norm()
        else:
            if fsdp:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm or float("inf")).full_tensor()
            else:
                grad_norm = accelerator.clip_grad_norm_(params, t.max_grad_norm or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        tokens_seen += global_real
        window_tokens += global_real
        log.advance()
        done = step + 1
        if done % cfg.logging.log_every == 0 or done == schedule.total_steps:
            now = time.perf_counter()
            last = {
                "step": done,
                "epoch": epoch,
                "loss": (accelerator.reduce(loss_sum, "sum").item() / max(global_tokens, 1)),
                "grad_norm": float(grad_norm),
                "lr": scheduler.get_last_lr()[0],
                "tokens": tokens_seen,
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                "elapsed_s": now - started,
            }
            log.write(last)
            window_tokens, window_start = 0, now
        if cfg.eval.every and done % cfg.eval.every == 0 and done < schedule.total_steps:
            evaluate(done)
        if cfg.checkpoint.save_every and done % cfg.checkpoint.save_every == 0 and done < schedule.total_steps:
            saved = checkpoint.save(out, done, model, optimizer, scheduler, {"tokens": tokens_seen, "epoch": epoch},
                                    to_yaml(cfg), accelerator, cfg.checkpoint.keep_last, layout)
            if saved:
                log.print(f"step {done}: checkpoint saved to {saved}")

    log.close_bar()
    final_eval = evaluate(schedule.total_steps)
    summary = {"steps": schedule.total_steps, "train_loss": last.get("loss"), "tokens": tokens_seen, "elapsed_s": time.perf_counter() - started}
    if final_eval:
        summary.update(final_eval)

    # Save: PEFT adapter or full model, tokenizer and resolved config, in ordinary HF formats.
    accelerator.wait_for_everyone()
    unwrapped = model.module if zero else accelerator.unwrap_model(model)
    summary["world_size"] = world
    # Memory held by model, optimizer and activations while training (compare with `finetune plan`).
    summary["rss_before_model_mib"] = rss_before_model / 2**20
    summary["load_peak_rss_mib"] = accelerator.gather(torch.tensor([load_peak_rss / 2**20], device=accelerator.device)).tolist()
    summary["peak_rss_mib"] = peak_rss() / 2**20
    summary["strategy"] = strategy
    summary["param_numel_per_rank"] = accelerator.gather(torch.tensor([local_numel(model, params)], device=accelerator.device)).tolist()
    summary["replicas_identical"] = replicas_identical(params, accelerator) if strategy in ("ddp", "single") else None
    # Sharded weights are gathered into one ordinary state dict (all ranks take part), saved by rank 0.
    state_dict = full_state_dict(model) if fsdp else gathered_trainable_state(unwrapped) if zero else None
    if main:
        unwrapped.config.use_cache = True  # saved models generate with a KV cache
        unwrapped.save_pretrained(out, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(out)
        plot = plot_loss_curve(out) if cfg.logging.plot else None
        summary["saved_to"] = str(out)
        summary["loss_curve"] = str(plot) if plot else None
        if before is not None:
            after = exact_match(unwrapped, tokenizer, data.eval_examples[: cfg.eval.generate_samples], cfg.data.format, cfg.eval.max_new_tokens)
            summary["exact_match_before"], summary["exact_match_after"] = before["exact_match"], after["exact_match"]
            say(f"exact match on {after['n']} eval prompts: {before['exact_match']:.1%} before -> {after['exact_match']:.1%} after")
            for b, a in list(zip(before["samples"], after["samples"]))[:3]:
                say(f"  prompt {a['prompt']!r}\n    expected {a['expected']!r} | before tuning {b['got']!r} | after tuning {a['got']!r}")
    accelerator.end_training()
    if main:
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        say(_summary_line(summary))
    if torch.distributed.is_initialized():
        # Tear the process group down before exit: left to interpreter shutdown, gloo's threads can
        # abort a rank ("terminate called without an active exception") after a successful run.
        accelerator.wait_for_everyone()
        torch.distributed.destroy_process_group()
    return RunResult(summary, unwrapped)


def _proc_status(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def current_rss() -> int:
    """Resident memory of this process now, in bytes (Linux; 0 elsewhere)."""
    return _proc_status("VmRSS")


def peak_rss() -> int:
    """Highest resident memory since the last reset_peak_rss(), in bytes (Linux; 0 elsewhere)."""
    return _proc_status("VmHWM")


def reset_peak_rss() -> None:
    """Start measuring the peak afresh (excludes loading transients, such as quantizing a checkpoint)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def replicas_identical(params: list[torch.nn.Parameter], accelerator) -> bool:
    """True when every rank holds the same trained weights (replicas that drift apart are a silent bug)."""
    with torch.no_grad():
        flat = torch.cat([p.detach().double().flatten() for p in params])
        local = torch.stack([flat.sum(), flat.abs().sum(), (flat * torch.arange(len(flat), dtype=flat.dtype)).sum()])
    gathered = accelerator.gather(local.to(accelerator.device)[None]).cpu()
    return bool((gathered == gathered[0]).all())


def resume(cfg: RunConfig, model, optimizer, scheduler, accelerator, say, layout: str) -> tuple[int, int]:
    """(step, tokens seen) to start from: 0 for a fresh run, else those of the checkpoint restored."""
    choice = cfg.checkpoint.resume
    if choice == "never":
        return 0, 0
    if choice == "auto":
        found = checkpoint.find_latest(cfg.train.output_dir)
        if found is None:
            return 0, 0
        for line in found.skipped:
            say(line)
        path = found.path
        if path is None:
            say("no complete checkpoint to resume from: starting afresh")
            return 0, 0
    else:
        path = Path(choice)
        problem = checkpoint.verify(path) if path.is_dir() else "not a folder"
        if problem:
            raise UserError(f"checkpoint.resume: {choice}: {problem}")
    try:
        state = checkpoint.restore(path, model, optimizer, scheduler, accelerator, layout)
    except ValueError as err:
        raise UserError(f"checkpoint.resume: {err}") from None
    say(f"resumed from {path} at step {state['step']}")
    return state["step"], state["tokens"]


def _summary_line(summary: dict) -> str:
    parts = [f"done: {summary['steps']} steps, final train loss {summary['train_loss']:.4f}"]
    if "eval_loss" in summary:
        parts.append(f"eval loss {summary['eval_loss']:.4f} (ppl {summary['eval_ppl']:.2f})")
    parts.append(f"{summary['elapsed_s']:.1f} s")
    lines = [", ".join(parts)]
    if summary.get("loss_curve"):
        lines.append(f"loss curve: {summary['loss_curve']}")
    lines.append(f"saved to:   {summary['saved_to']}")
    return "\n".join(lines)


if __name__ == "__main__":
    from finetune.cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
