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

import contextlib
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune.checkpoint import store
from finetune.checkpoint.checkpointers import last_good
from finetune.checkpoint.locks import hold_output_dir, release_output_dir
from finetune.checkpoint.resume import Progress, Start, clear_starts, resume, starting_point
from finetune.config import faults
from finetune.config.errors import EXIT_DIVERGED, EXIT_PREEMPTED, Stopped, UserError, make_folder
from finetune.config.schema import CONFIG_FILE, MUTATED_INITS, SUMMARY_FILE, ModelConfig, RunConfig, looks_local, to_yaml
from finetune.config.strategy import Strategy
from finetune.data.chat import choose_template
from finetune.data.datasets import Datasets, Schedule, batches_at, load_data, plan_steps, step_samples, summary_lines
from finetune.model import families, nf4, vision
from finetune.model.attention import leak, mixer_outside_attention
from finetune.model.loading import adapter_input_casting_off, apply_adapter, compile_layers, describe, load_tokenizer, loftq_init
from finetune.model.stage import staged_model
from finetune.model.teacher import teacher_source
from finetune.objectives.distill import teacher_answers
from finetune.objectives.evaluate import eval_loss, exact_match, exact_match_after
from finetune.objectives.grpo import GRPO
from finetune.objectives.loss import to_device
from finetune.objectives.objective import SFT, Objective
from finetune.objectives.registry import objective_for
from finetune.outputs import model_card
from finetune.outputs.serving import check_vllm
from finetune.parallel import network, runtime, sequence_parallel
from finetune.parallel.distributed import local_numel, replicas_identical
from finetune.parallel.engines import Engine, engine_class, engine_for
from finetune.parallel.optim import current_lr, set_peak_lr, warmup_steps
from finetune.parallel.sequence_parallel import SequenceParallel
from finetune.run import preflight
from finetune.run.elastic import batch_at_this_size
from finetune.run.guard import DRIFT_STEPS, FIRST_STEPS_CHECKED, Guard, Verdict, check_first_steps, data_step
from finetune.run.metrics import RunLog, plot_loss_curve, summary_line, tracked_config, tracker_kwargs
from finetune.run.supervise import Watchdog, release_preemption, stop_if_preempted, stop_with_launcher, watch_preemption

# A packed sample's logits may move by rounding (bf16 kernels over rows of other lengths), a small
# share of what the sample before it would move them as context; samples that see each other move them
# most of the way.
LEAK_TOLERANCE = 0.05
INITIAL_ADAPTER = "initial-adapter"  # where such an adapter started, for peft's conversion at the end


@dataclass
class RunResult:
    summary: dict
    model: torch.nn.Module  # the trained model, unwrapped (PEFT model for adapters)


def make_accelerator(cfg: RunConfig):
    from accelerate import Accelerator

    mp = cfg.train.mixed_precision
    cuda = torch.cuda.is_available()
    if cfg.train.tf32 and cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    flag = runtime.launcher_strategy(cfg)
    if flag:
        os.environ[flag] = "false"  # the strategy agrees: finetune applies it, not accelerate's plugin
    network.check_store()  # rank 0's store answers, before the process group waits on it
    runtime.join_restarted_workers()
    if not engine_class(cfg, int(os.environ.get("WORLD_SIZE", "1")))[0].autocast:  # launchers set WORLD_SIZE
        mp = "no"
    handlers = []
    if mp == "fp8" and importlib.util.find_spec("torchao"):
        from accelerate.utils import AORecipeKwargs
        from torchao.float8 import Float8LinearConfig

        # Rowwise scaling: a scale per token. One scale per tensor (accelerate's default) lets the largest
        # activation of a packed row set every sample's precision: the packed-row check saw a sample's
        # logits move 6% towards the previous sample's context (docs/platform-notes.md). Rowwise takes no
        # FSDP float8 all-gather, which only made weights that safetensors cannot save; fp8 runs unsharded.
        # pad_inner_dim: a micro-batch's token count is rarely a multiple of 16, and the weight gradient's
        # matmul runs over tokens.
        rowwise = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), pad_inner_dim=True)
        handlers.append(AORecipeKwargs(config=rowwise))
    return Accelerator(mixed_precision=mp, cpu=not cuda, log_with=list(cfg.logging.report_to) or None, project_dir=cfg.train.output_dir,
                       kwargs_handlers=handlers)


def run(cfg: RunConfig) -> RunResult:
    """Train as configured. Returns a summary (also printed by the main process).

    The main process holds the output directory's lock for the whole run: one run per directory."""
    preflight.check(cfg)
    lock = claim_output_dir(Path(cfg.train.output_dir)) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        return _run(cfg)
    finally:
        release_preemption()
        if lock is not None:
            release_output_dir(lock)
        # The run's model and optimizer sit in reference cycles (accelerate's and peft's hooks): freed now,
        # not at the interpreter's next full collection, so a process that trains again (a sweep, a
        # notebook, the GPU tests) starts with the last run's weights off its GPU (docs/platform-notes.md).
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def claim_output_dir(out: Path):
    """Create and lock the output directory (preflight.check_output_dir has found it fit to use)."""
    make_folder(out, "train.output_dir")
    return hold_output_dir(out)


def _run(cfg: RunConfig) -> RunResult:
    run = setup(cfg)
    try:
        if run.progress.step == 0:
            start_point(run)
        # Adapter inputs stay uncast for the whole loop (set once: it walks every module); lifted before
        # the evaluation and generation after it, which run outside autocast.
        with adapter_input_casting_off(run.engine.model, run.accelerator.mixed_precision):
            train_loop(run)
        return finish(run)
    finally:
        run.watchdog.close()
        run.engine.checkpointer.wait()  # a save in flight completes before the run lets go of its folder


@dataclass
class RunState:
    """One run, as setup builds it and the loop and finish use it. `step` counts optimizer steps done."""

    cfg: RunConfig
    accelerator: object
    preemption: object  # supervise.Preemption: the signal, if one came
    model_cfg: ModelConfig  # where the base was loaded from (a RAM copy, maybe)
    tokenizer: object
    data: Datasets
    schedule: Schedule
    processor: object = None  # a vision-language model's (AutoProcessor): pictures to pixels; saved beside the adapter
    engine: Engine = None  # model, optimizer, scheduler and checkpoint layout of the strategy
    sequence_parallel: SequenceParallel = field(default_factory=SequenceParallel)  # the processes that share each row, if any
    base: str = ""  # the base model as the saved adapter names it
    teacher: tuple[ModelConfig, str | None] | None = None  # distillation: the teacher's base and the adapter merged into it
    objective: Objective = field(default_factory=SFT)  # what a step minimises (train.objective)
    router_coef: float = 0.0
    rss_before_model: int = 0
    anonymous_before_model: int = 0
    peak_rss_since: str = ""  # when peak_rss_mib counts from: the kernel may refuse to reset the peak
    before: dict | None = None  # exact match on eval prompts before training
    background: bool = False  # checkpoints written in the background
    log: RunLog | None = None
    guard: Guard | None = None
    watchdog: Watchdog | None = None
    start_step: int = 0  # where this start of the run began (a resumed step, or 0)
    progress: Progress = field(default_factory=Progress)  # progress.step: optimizer steps done
    last: dict = field(default_factory=dict)  # the last logged step's metrics
    started: float = 0.0
    last_save: float = 0.0

    @property
    def out(self) -> Path:
        return Path(self.cfg.train.output_dir)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    def say(self, message: str) -> None:
        if self.main:
            print(message)


# ------------------------------------------------------------------------------------------------
# Setup: data, model, optimizer, resume


def setup(cfg: RunConfig) -> RunState:
    from accelerate.utils import set_seed

    preemption = watch_preemption()
    stop_with_launcher()
    accelerator = make_accelerator(cfg)
    set_seed(cfg.train.seed)
    start = starting_point(cfg)
    cfg, resized, batch = batch_at_this_size(cfg, start, accelerator, preemption)
    if accelerator.is_main_process:
        (Path(cfg.train.output_dir) / CONFIG_FILE).write_text(to_yaml(cfg))
    run = load_inputs(cfg, accelerator, preemption)
    load_and_prepare_model(run)
    resume_or_start(run, start, [("resize", resized)] if resized else [])
    run.progress.batch = batch
    # Every rank agrees whether a signal came during set-up (there is nothing to save yet).
    signalled = accelerator.reduce(torch.tensor(float(preemption.signal is not None), device=accelerator.device), "sum").item() > 0
    stop_if_preempted(signalled, preemption.name, run.out, run.main, "before the first step")
    tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len / cfg.distributed.sequence_parallel  # a process's share of a micro-batch
    runtime.keep_freed_memory(gathers=run.engine.gathers, quantized=cfg.model.quantization is not None, long_rows=tokens >= runtime.LONG_ROWS)
    run.peak_rss_since = "the first step" if runtime.reset_peak_rss() else "the process's start"
    return run


def start_point(run: RunState) -> None:
    """Before the first step: the eval baseline and, unless a step-0 checkpoint holds them already,
    where the guard judges the run from (the first steps' batches at the initial weights, the eval
    loss) and, for adapters, that checkpoint: the start to roll back to costs a few MB at most."""
    cfg, guard = run.cfg, run.guard
    result = evaluate(run, 0) if cfg.eval.on_start else None
    if not cfg.guard.enabled or guard.state.start_level is not None or run.schedule.total_steps <= DRIFT_STEPS or not run.objective.levels:
        return
    guard.set_start(start_losses(run), result["eval_loss"] if result else None)
    run.say(f"start: loss level {guard.state.start_level[0]:.4f} on the first {DRIFT_STEPS} steps' batches before training")
    if cfg.adapter.method != "full":
        save(run)


def start_losses(run: RunState) -> list[float]:
    """The losses of the first DRIFT_STEPS steps' batches at the initial weights, each as its step
    will compute it (training mode, dropout included); the RNG is put back afterwards, so the steps
    themselves are the same as without this measurement."""
    losses, rng = [], store.rng_state()
    try:
        with torch.no_grad():
            for step in range(DRIFT_STEPS):
                _, micro_batches, totals, _ = step_batches(run, data_step(step, skipped(run)))
                loss = sum(run.objective.losses(run.engine.model, batch, totals).tokens.float() for batch in micro_batches)
                losses.append(run.accelerator.reduce(loss, "sum").item() / max(totals[0], 1))
    finally:
        store.set_rng_state(rng)
    return losses


def load_inputs(cfg: RunConfig, accelerator, preemption) -> RunState:
    """The staged model folder, tokenizer, tokenized data and step schedule."""
    main, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes
    each = print if world == 1 else lambda m: print(f"[rank {rank}] {m}")
    # One process per node copies the model to RAM (model.ramdisk); everything loads from that copy.
    model_cfg = staged_model(cfg.model, say=each)
    # Data: one process per node tokenizes (and fills the cache) while the others wait for its lock;
    # then all of them memory-map the same files.
    processor = vision.processor_for(model_cfg)
    tokenizer = load_tokenizer(model_cfg, processor)
    choose_template(tokenizer, cfg.data.chat_template, cfg.data.format, say=print if main else (lambda *_: None))
    # Distillation: the teacher's vocabulary checked against the student's before any data or weights load
    strategy = Strategy.of(cfg.distributed.strategy, world)
    teacher = (teacher_source(cfg.distill.teacher, model_cfg, tokenizer, strategy.name if strategy.shards_weights else None,
                              cfg.distill.teacher_quantization) if cfg.train.objective == "distill" else None)
    if cfg.distill.sequence_level and processor is not None:
        raise UserError("distill.sequence_level: not with a vision-language model (its teacher would answer without the pictures)")
    answers = teacher_answers(*teacher, cfg.distill, tokenizer, accelerator.device, each) if cfg.distill.sequence_level and teacher else None
    data = load_data(cfg.data, tokenizer, cfg.train.seed, eval_examples=cfg.eval.generate_samples if main else 0, say=each, processor=processor,
                     answers=answers)
    stop_if_preempted(preemption.signal is not None, preemption.name, Path(cfg.train.output_dir), main, "while the data loaded")
    sp = sequence_parallel.setup(cfg.distributed.sequence_parallel, rank, world)
    run = RunState(cfg, accelerator, preemption, model_cfg, tokenizer, data, plan_steps(cfg, len(data.train), sp.data_world(world)),
                   processor=processor, sequence_parallel=sp, teacher=teacher)
    run.objective = objective_for(cfg, locate=data.train.locate, world=world, processor=processor)
    for line in summary_lines(data, cfg.data.max_seq_len):
        run.say(line)
    return run


def load_and_prepare_model(run: RunState) -> None:
    """The base, loaded as the strategy's engine wants it, the adapter on it, then spread over the
    processes with the optimizer built on what each holds."""
    cfg, t, world = run.cfg, run.cfg.train, run.accelerator.num_processes
    run.engine = engine_for(cfg, run.accelerator)
    if run.engine.gathers:
        runtime.map_large_blocks()
    run.rss_before_model, run.anonymous_before_model = runtime.current_rss(), runtime.current_anonymous()
    model = run.engine.load(run.model_cfg, run.say)
    # Saved configs name the source, not a RAM copy; a local one by its absolute path, so that the adapter
    # loads from any directory (AutoPeftModelForCausalLM reads it); hub ids stay as they are.
    run.base = str(Path(cfg.model.name_or_path).expanduser().resolve()) if looks_local(cfg.model.name_or_path) else cfg.model.name_or_path
    model.name_or_path = model.config.name_or_path = run.base
    run.router_coef = families.router_aux_loss_coef(model.config.to_dict()) if t.router_aux_loss_coef is None else t.router_aux_loss_coef
    sequence_parallel.check_model(run.sequence_parallel.size, model, run.router_coef)
    model = apply_adapter(model, cfg.adapter, t.gradient_checkpointing, say=run.say)
    if cfg.model.tiled_mlp > 1:
        count = sequence_parallel.tile_mlps(model, cfg.model.tiled_mlp)
        run.say(f"tiled MLP: {count} MLPs run over {cfg.model.tiled_mlp} chunks of each row")
    if cfg.adapter.init == "loftq":
        loftq_init(model, run.model_cfg)
    if cfg.adapter.init in MUTATED_INITS and run.main:
        # PiSSA/OLoRA move part of each weight into the adapter: peft converts the final adapter for the
        # original base from this record of where training started (the same for every start: SVD/QR).
        model.save_pretrained(run.out / INITIAL_ADAPTER, safe_serialization=True)
    if t.neftune_alpha:  # transformers' own NEFTune hook: noise only while the embedding is in training mode
        from transformers.integrations.neftune import activate_neftune

        activate_neftune(model, t.neftune_alpha)
    info = describe(model)
    q = cfg.model.quantization
    method = cfg.adapter.method if q is None else f"{cfg.adapter.method} on a {q.bits}-bit base" + (f" ({q.quant_type})" if q.bits == 4 else "")
    run.say(
        f"model: {cfg.model.name_or_path} ({method}), {info['trainable_params']:,} trainable of "
        f"{info['total_params']:,} params ({info['trainable_params'] / info['total_params']:.2%}), "
        f"{info['param_bytes'] / 2**20:.1f} MiB of weights"
    )
    if "unquantized" in info:
        run.say(f"quantized: {info['quantized_linears']} linear layers; kept in {info['unquantized_dtype']}: {info['unquantized']}")
    data_world = run.sequence_parallel.data_world(world)
    shared = f" (of {world}: {run.sequence_parallel.size} share each row)" if run.sequence_parallel.size > 1 else ""
    run.say(
        f"batch: {t.micro_batch_size} micro x {t.grad_accum} accum x {data_world} process(es){shared} = "
        f"{t.micro_batch_size * t.grad_accum * data_world} rows per step; {run.schedule.total_steps} steps "
        f"({run.schedule.steps_per_epoch} per epoch)"
    )
    if cfg.eval.generate_samples and run.main and run.data.eval_examples:
        run.before = exact_match(model, run.tokenizer, run.data.eval_examples[: cfg.eval.generate_samples], cfg.data.format, cfg.eval.max_new_tokens,
                                 run.processor)
        run.say(f"before training: exact match {run.before['exact_match']:.1%} on {run.before['n']} eval prompts")
    if cfg.model.compile:
        compile_layers(model)
    run.engine.prepare(model, run.schedule.total_steps)
    run.engine.checkpointer.after_file = faults.inject_saving
    if cfg.needs_reference:
        run.objective.reference = run.engine.reference(run.model_cfg, run.say)
        run.say(f"{cfg.train.objective}: the reference is a frozen copy of the base, held as the policy is")
    if run.teacher is not None:
        teacher_cfg, adapter = run.teacher
        run.objective.teacher = run.engine.reference(teacher_cfg, run.say, adapter)
        q = cfg.distill.teacher_quantization
        run.say(f"distill: the teacher is {cfg.distill.teacher}" + (f" (merged into {teacher_cfg.name_or_path})" if adapter else "")
                + (f" (in {q.bits} bits" + (f", {q.quant_type})" if q.bits == 4 else ")") if q else "")
                + f", frozen, held as the student is; {cfg.distill.divergence} at temperature {cfg.distill.temperature:g}")
    if cfg.data.packing or cfg.train.objective != "sft":
        check_packed_rows(run)


def check_packed_rows(run: RunState) -> None:
    """Refuse a model that lets the samples of a packed row see each other (found in its layers, or
    measured on it, every process at once): it would train and evaluate on other samples' context
    without a sign."""
    model = run.engine.unwrap()
    kind = f"{model.config.model_type} ({model.config._attn_implementation} attention)"
    mixer = mixer_outside_attention(model)
    if mixer:
        how = f"{kind} mixes tokens outside attention ({mixer}), carrying a state from one packed sample into the next"
    else:
        with run.accelerator.autocast():
            # a vision-language model's text vocabulary, below its picture token (a picture token without a picture fails)
            vocab = min(model.config.get_text_config().vocab_size, getattr(model.config, "image_token_id", None) or 2**62)
            moved = leak(run.engine.model, vocab, run.accelerator.device)
        if not moved > LEAK_TOLERANCE:  # nan: context changes nothing, there is nothing to leak
            return
        how = (f"{kind} lets the samples of a packed row see each other (measured at the start: a sample's logits "
               f"moved {moved:.0%} of the way to having the sample before it as context)")
    if run.cfg.train.objective == "sft":
        raise UserError(f"data.packing: {how}; set data.packing: false")
    objective = run.cfg.train.objective
    what = {"grpo": "each prompt's completions", "kto": "its examples"}.get(objective, "each pair's chosen and rejected sequences")
    raise UserError(f"train.objective: {objective} packs {what} in one row, and {how}: this model cannot be trained with {objective} by finetune")


def resume_or_start(run: RunState, start: Start, events: list[tuple[str, str]]) -> None:
    """Restore the checkpoint to resume from (if any), then the run log, guard and watchdog; `events`
    (set-up's) are logged with the resume's."""
    cfg, engine = run.cfg, run.engine
    run.background = engine.background_saves and (cfg.checkpoint.async_save if cfg.checkpoint.async_save is not None
                                                       else cfg.adapter.method != "full")
    if cfg.logging.report_to:
        run.accelerator.init_trackers(cfg.logging.project, config=tracked_config(cfg), init_kwargs=tracker_kwargs(cfg.logging, run.out))
    run.progress, resumed = resume(cfg, start, engine.checkpointer, run.accelerator)
    events = events + resumed
    restore_held(run)
    run.start_step = run.progress.step
    run.log = RunLog(run.out, run.schedule.total_steps, run.accelerator, run.main, cfg.logging.progress_bar, run.progress.step)
    for kind, message in events:
        run.log.event(kind, run.progress.step, message)
    # GRPO's guard judges the negative mean reward, a level that may be negative: no ratio to the start's gradient norm.
    guard_cfg = cfg.guard if run.objective.levels else cfg.guard.model_copy(update={"grad_collapse": 0.0})
    run.guard = Guard(guard_cfg, run.progress.guard, cfg.guard.min_rise if cfg.guard.min_rise is not None else run.objective.start_loss,
                      warmup=warmup_steps(cfg.train, run.schedule.total_steps), watched=run.objective.watched_name, resumed_at=run.start_step)
    set_peak_lr(engine.scheduler, cfg.train.lr * run.guard.state.lr_scale)  # the config's LR wins over the checkpoint's (OPT's logbook)
    rank = run.accelerator.process_index
    run.watchdog = Watchdog(cfg.watchdog, on_hang=lambda message: run.log.event("hang", run.watchdog.step, f"rank {rank}: {message}", any_rank=True))
    run.last_save = time.monotonic()


def restore_held(run: RunState) -> None:
    """GRPO with num_iterations > 1: the rollouts the restored checkpoint held for its next updates (this rank's)."""
    if isinstance(run.objective, GRPO):
        run.objective.load_held(run.engine.checkpointer.rank_state)


# ------------------------------------------------------------------------------------------------
# The loop


@dataclass
class StepOutcome:
    epoch: int
    loss: float  # mean over the step's trained tokens, all ranks
    grad_norm: float
    verdict: Verdict
    moved: bool  # the weights moved (also where DeepSpeed stepped before the guard's verdict to skip)
    real_tokens: int  # non-padding tokens of the step, all ranks
    router_loss: float | None  # MoE: the router's auxiliary loss, mean over the step's forwards
    preempted: bool  # a rank has been signalled: save and stop
    time_due: bool  # checkpoint.save_every_minutes has passed
    metrics: dict[str, float]  # the objective's own (preference: rewards, margin, accuracy), means over the step's pairs
    samples: list[int] | None = None  # logging.sample_ids: the samples the step trained, all ranks', sorted


def train_loop(run: RunState) -> None:
    """Steps until the schedule's end. The data a step reads is a function of `run.progress.step`."""
    cfg, log, total = run.cfg, run.log, run.schedule.total_steps
    run.engine.model.train()
    run.started = window_start = time.perf_counter()
    window_tokens = 0
    while run.progress.step < total:
        run.watchdog.start_step(run.progress.step)
        done = train_step(run)
        run.watchdog.end_step()
        if done.verdict.action in ("rollback", "stop"):
            run.progress = roll_back(run, run.progress.step, done.verdict)
            log.advance(run.progress.step - log.position())
            continue
        if done.verdict.action == "skip":
            log.event("anomaly" if done.moved else "skip", run.progress.step,
                      f"guard: step {run.progress.step + 1}: {done.verdict.reason} (applied already, inside backward: only rollbacks help)"
                      if done.moved else f"guard: step {run.progress.step + 1} not applied: {done.verdict.reason}")
        run.progress.tokens += done.real_tokens
        run.progress.epoch = done.epoch
        window_tokens += done.real_tokens
        run.progress.step += 1
        log.advance()
        if logged(run, run.progress.step):
            now = time.perf_counter()
            run.last = {"step": run.progress.step, "epoch": done.epoch, "loss": done.loss, "grad_norm": done.grad_norm, "lr": current_lr(run.engine.scheduler),
                        "tokens": run.progress.tokens, "tokens_per_s": window_tokens / max(now - window_start, 1e-9), "elapsed_s": now - run.started,
                        "time": time.time()}
            if done.router_loss is not None:
                run.last["router_aux_loss"] = done.router_loss
            run.last.update(done.metrics)
            if done.samples is not None:
                run.last["samples"] = done.samples
            log.write(run.last)
            window_tokens, window_start = 0, now
        if cfg.eval.every and run.progress.step % cfg.eval.every == 0 and run.progress.step < total:
            evaluate(run, run.progress.step)
        every = cfg.checkpoint.save_every and run.progress.step % cfg.checkpoint.save_every == 0
        if run.progress.step < total and (every or done.time_due or done.preempted):
            save(run)
        if done.preempted and run.progress.step < total:
            stop_preempted(run)
        if run.progress.step == total:  # the final weights must not have drifted worse than the run's best
            verdict = run.guard.finish(run.progress.step - 1)
            if verdict.action != "apply":
                run.progress = roll_back(run, run.progress.step - 1, verdict)
                log.advance(run.progress.step - log.position())
    log.close_bar()


def reading_position(run: RunState, position: int) -> int:
    """The data step whose rows a step reads: GRPO trains num_iterations updates on each."""
    return position // run.objective.cfg.num_iterations if isinstance(run.objective, GRPO) else position


def skipped(run: RunState) -> list[list[int]]:
    """The data windows steps skip: the guard's rollbacks' and train.skip_data."""
    return run.guard.state.skip_windows + [list(w) for w in run.cfg.train.skip_data]


def trained_samples(run: RunState, position: int) -> list[int]:
    """logging.sample_ids: the samples of data step `position` on every rank (those sharing a row name it once), sorted."""
    sp, accelerator = run.sequence_parallel, run.accelerator
    mine = [] if sp.rank else step_samples(run.data, run.cfg, run.schedule, reading_position(run, position), sp.data_rank(accelerator.process_index),
                                            sp.data_world(accelerator.num_processes))
    from accelerate.utils import gather_object

    return sorted(gather_object(mine) if accelerator.num_processes > 1 else mine)


def train_step(run: RunState) -> StepOutcome:
    """Forward and backward over the step's micro-batches; the guard judges the step before the
    engine applies it. One all-reduce and host sync: every rank takes the same decision."""
    cfg, engine, accelerator, step = run.cfg, run.engine, run.accelerator, run.progress.step
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    faults.inject(step, rank, engine.checkpointer.wait, lambda: run.preemption.signal is not None)
    position = data_step(step, skipped(run))
    epoch, micro_batches, totals, global_real = step_batches(run, position)
    # The loss is a mean over every trained token (or pair) of the step, across micro-batches and ranks:
    # each micro-batch contributes its sum divided by the global count (times world size, because DDP
    # averages gradients over ranks).
    objective = run.objective
    loss_sum, router_sum = torch.zeros((), device=device), torch.zeros((), device=device)
    metric_sums = torch.zeros(len(objective.metrics), device=device)
    for i, batch in enumerate(micro_batches):
        with engine.accumulating(last=i == len(micro_batches) - 1):  # gradients are reduced across ranks once per step
            with saved_on_cpu(cfg.train.offload_activations):
                parts = objective.losses(engine.model, batch, totals, router=run.router_coef > 0)
            loss = parts.tokens * faults.loss_factor(position, rank)
            scaled = loss * (world / max(totals[0], 1))
            if parts.router is not None:  # MoE load balancing: its mean over the step's forwards, as the model weighs it
                scaled = scaled + parts.router * (run.router_coef / len(micro_batches))
                router_sum += parts.router.detach()
            engine.backward(scaled)
        loss_sum += loss.detach()
        if parts.metrics is not None:
            metric_sums += parts.metrics.float()
    # The preemption signal and the save clock ride along with the loss; the gradient norm (the same on
    # every rank) joins them after the sum: the step's one host sync.
    minutes = cfg.checkpoint.save_every_minutes
    due = minutes > 0 and time.monotonic() - run.last_save > 60 * minutes
    local = torch.stack([loss_sum.float(), loss_sum.new_tensor(float(run.preemption.signal is not None)), loss_sum.new_tensor(float(due)),
                         router_sum.float(), *metric_sums])
    norm = engine.clip(run.guard.state.max_grad_norm or cfg.train.max_grad_norm or float("inf"))
    norm = torch.as_tensor(norm, dtype=torch.float32, device=device).reshape(1)
    total_loss, preempted, time_due, router_loss, *metric_totals, grad_norm = torch.cat([accelerator.reduce(local, "sum"), norm]).tolist()
    step_loss = total_loss / max(totals[0], 1)
    metrics = {name: value / max(totals[c], 1) for name, value, c in zip(objective.metrics, metric_totals, objective.mean_over)}
    if step - run.start_step < FIRST_STEPS_CHECKED and objective.levels:  # GRPO's loss is 0 where no group's rewards differ
        check_first_steps(step, step_loss)
    verdict = run.guard.check(step, objective.watched(step_loss, metrics), grad_norm, metrics.get("kl"))
    if verdict.action == "apply":
        waited = engine.checkpointer.staged()  # a background save's copy of the weights first
        if waited > 0.01:
            run.log.print(f"step {step + 1}: training paused {waited:.2f} s more while the checkpoint was copied")
    moved = engine.apply(verdict.action == "apply")
    return StepOutcome(epoch, step_loss, grad_norm, verdict, moved, int(global_real),
                       router_loss / (len(micro_batches) * world) if run.router_coef > 0 else None, preempted > 0, time_due > 0, metrics,
                       trained_samples(run, position) if cfg.logging.sample_ids and logged(run, step + 1) else None)


def logged(run: RunState, steps_done: int) -> bool:
    """Whether the step that makes `steps_done` writes a metrics row."""
    return steps_done % run.cfg.logging.log_every == 0 or steps_done == run.schedule.total_steps


def saved_on_cpu(offload: bool):
    """train.offload_activations: what autograd saves in the forward goes to pinned host memory and comes
    back when the backward reaches it (the backward needs no context: the tensors carry their hooks)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()


def step_batches(run: RunState, position: int) -> tuple[int, list[dict], list[float], float]:
    """The micro-batches of data step `position` for this rank, on its device, with the objective's
    counts (and the real tokens) summed over the step's micro-batches and every rank."""
    accelerator, sp, pad = run.accelerator, run.sequence_parallel, run.tokenizer.pad_token_id
    position = reading_position(run, position)
    epoch, micro_batches, real_tokens = batches_at(run.data, run.cfg, run.schedule, position, sp.data_rank(accelerator.process_index),
                                                   sp.data_world(accelerator.num_processes), pad)
    if run.objective.rollouts:  # what the policy samples as it is now (under the training forward's autocast): GRPO, on-policy distillation
        with accelerator.autocast():
            sampled = run.objective.rollout(run.engine.unwrap(), run.tokenizer, micro_batches, position, accelerator.device)
        if sampled is not None:
            micro_batches, real_tokens = sampled
        sample_ahead(run, position)
    micro_batches = [sp.shard(b, pad) for b in micro_batches]  # this process's slice of each row (sequence parallelism)
    real_tokens = 0 if sp.rank else real_tokens  # a row's tokens, counted once among the processes sharing it
    local = [*map(sum, zip(*(run.objective.counts(b) for b in micro_batches))), real_tokens]  # counted on the host
    micro_batches = [to_device(b, accelerator.device) for b in micro_batches]
    if accelerator.num_processes == 1:
        return epoch, micro_batches, local[:-1], local[-1]
    *totals, global_real = accelerator.reduce(torch.tensor(local, device=accelerator.device), "sum").tolist()  # a sync: the loss scale
    return epoch, micro_batches, totals, global_real


def sample_ahead(run: RunState, position: int) -> None:
    """grpo.async_rollouts: the next data step's rollouts, sampled in the background while this step trains."""
    step = run.progress.step + 1
    if not (isinstance(run.objective, GRPO) and run.objective.cfg.async_rollouts) or step >= run.schedule.total_steps:
        return
    following = reading_position(run, data_step(step, skipped(run)))
    if following == position:  # num_iterations > 1: the next update trains on the same rollouts
        return
    accelerator, sp = run.accelerator, run.sequence_parallel
    _, prompts, _ = batches_at(run.data, run.cfg, run.schedule, following, sp.data_rank(accelerator.process_index),
                               sp.data_world(accelerator.num_processes), run.tokenizer.pad_token_id)
    run.objective.sample_ahead(run.engine.unwrap(), run.tokenizer, prompts, following, accelerator.device, accelerator.autocast)


def evaluate(run: RunState, step: int) -> dict | None:
    if not run.data.eval:
        return None
    cfg = run.cfg
    result = eval_loss(run.engine.model, run.data.eval, cfg.train.micro_batch_size, run.tokenizer.pad_token_id, run.accelerator, cfg.eval.max_batches,
                       run.objective, run.sequence_parallel, run.tokenizer)
    run.log.write({"step": step, **result})
    run.log.print(f"step {step}: {run.objective.eval_line(result)}")
    return result


def save(run: RunState) -> None:
    engine, step = run.engine, run.progress.step
    progress = dataclasses.replace(run.progress, guard=run.guard.state_dict(), good=run.guard.is_healthy(step))
    began = time.perf_counter()
    held = run.objective.held_state() if isinstance(run.objective, GRPO) else {}
    saved = engine.checkpointer.save(run.out, progress.state_dict(), to_yaml(run.cfg), run.cfg.checkpoint.keep_last, run.background, held)
    if saved:  # the seconds training waited (bench/large.py compares them with and without background writes)
        run.log.print(f"step {step}: checkpoint {'being written in the background to' if run.background else 'saved to'} {saved} "
                      f"(training paused {time.perf_counter() - began:.2f} s)")
    run.last_save = time.monotonic()


def stop_preempted(run: RunState) -> None:
    run.engine.checkpointer.wait()
    name = run.preemption.name or "a signal on another rank"
    run.log.event("preempted", run.progress.step, f"{name}: checkpoint saved at step {run.progress.step}; exiting with code {EXIT_PREEMPTED}, "
                  "start the same command to resume")
    run.log.close_bar()
    runtime.finish_distributed(run.accelerator)
    raise Stopped(f"preempted at step {run.progress.step}: checkpoint saved; start the same command to resume", EXIT_PREEMPTED)


def roll_back(run: RunState, trouble_step: int, verdict: Verdict) -> Progress:
    """Back to the newest good checkpoint before the trouble, with a lower LR and the data that led
    to the trouble skipped; or stop with what was seen. Returns the progress to go on from."""
    guard, engine, lr = run.guard, run.engine, run.cfg.train.lr
    engine.checkpointer.wait()
    target = store.find_good(run.out, verdict.before_step)  # at or before the trouble (a drift: its lowest level)
    if verdict.action == "stop" or target is None:
        if target and store.step_of(target) == 0:
            where = f"only the start is good ({target}, the adapter as initialised): lower train.lr (e.g. 10x) and start a new run"
        elif target:
            where = (f"the last good checkpoint is {target}. Start again from it by hand with a lower train.lr and/or "
                     "train.skip_data (see events.jsonl)")
        elif verdict.before_step == 0:
            where = "no checkpoint predates the trouble"
        else:
            where = "there is no good checkpoint to roll back to (set checkpoint.save_every)"
        run.log.event("stop", trouble_step, f"guard: {verdict.reason}; {where}")
        raise Stopped(f"step {trouble_step + 1}: training diverged: {verdict.reason}; {where}", EXIT_DIVERGED)
    back = Progress.from_state_dict(engine.checkpointer.restore(target, run.out))
    restore_held(run)
    guard.rolled_back(back.step, trouble_step, saved=back.guard)
    set_peak_lr(engine.scheduler, lr * guard.state.lr_scale)
    run.log.event("rollback", trouble_step, f"guard: {verdict.reason}; rolled back to {target.name}, LR x{guard.state.lr_scale:g} "
                  f"(now {lr * guard.state.lr_scale:.3g}), batches of steps {back.step + 1}-{trouble_step + 1} skipped"
                  + (f", clipping at {guard.state.max_grad_norm}" if guard.state.max_grad_norm else ""))
    return back


# ------------------------------------------------------------------------------------------------
# Finish: final eval, summary, the saved adapter or model


def finish(run: RunState) -> RunResult:
    cfg, engine, accelerator = run.cfg, run.engine, run.accelerator
    engine.checkpointer.wait()  # the last save complete: last_good may pick it, and DCP's background writes need the process group
    summary = summarize(run)
    # Save: PEFT adapter or full model, tokenizer and resolved config, in ordinary HF formats.
    accelerator.wait_for_everyone()
    unwrapped = engine.unwrap()
    summary["param_numel_per_rank"] = accelerator.gather(torch.tensor([local_numel(engine.model, engine.params)], device=accelerator.device)).tolist()
    if nf4.used(cfg.model):  # the 4-bit codes and scales each rank holds: its shards of them under fsdp
        summary["nf4_bytes_per_rank"] = accelerator.gather(torch.tensor([nf4.packed_bytes(engine.model)], device=accelerator.device)).tolist()
    summary["replicas_identical"] = replicas_identical(engine.params, accelerator) if engine.replicated else None
    # Sharded weights are gathered into one ordinary state dict (all ranks take part), saved by rank 0.
    state_dict = engine.final_state()
    if run.main:
        unwrapped.config.use_cache = True  # saved models generate with a KV cache
        initial = run.out / INITIAL_ADAPTER if cfg.adapter.init in MUTATED_INITS else None
        unwrapped.save_pretrained(run.out, safe_serialization=True, state_dict=state_dict,
                                  **({"path_initial_model_for_weight_conversion": str(initial)} if initial else {}))
        (run.processor or run.tokenizer).save_pretrained(run.out)  # a processor saves its tokenizer, picture settings and chat template
        plot = plot_loss_curve(run.out) if cfg.logging.plot else None
        summary.update(saved_to=str(run.out), adapter=cfg.adapter.method != "full", loss_curve=str(plot) if plot else None)
        if summary["adapter"]:
            serving = check_vllm(run.out)
            summary["vllm"] = {"loads": serving.loads, "max_lora_rank": serving.max_lora_rank, "problems": serving.problems}
            run.say(serving.line())
        if run.before is not None:
            examples = run.data.eval_examples[: run.cfg.eval.generate_samples]
            summary.update(exact_match_after(unwrapped, run.tokenizer, examples, run.cfg.data.format, run.cfg.eval.max_new_tokens, run.before,
                                             run.say, run.processor))
        # The folder's README.md is a model card of this run (it replaces the template peft's save wrote).
        (run.out / model_card.CARD).write_text(model_card.run_card(cfg, summary, run.out))
        (run.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        run.say(summary_line(summary))
        clear_starts(run.out)  # a finished run ends any restart loop
    worse = ended_worse(run, summary)
    runtime.finish_distributed(accelerator)
    accelerator.end_training()  # trackers; the process group is already gone
    if worse:
        raise Stopped(worse, EXIT_DIVERGED)
    return RunResult(summary, unwrapped)


def ended_worse(run: RunState, summary: dict) -> str:
    """A run that ended worse than it started is saved (summary.json says so) but is no success: the
    stop's message names the start and what to change ("" when the run did not end worse)."""
    if not summary.get("worse_than_start"):
        return ""
    start = summary["start_checkpoint"]
    where = f"its start is {start} (the adapter as initialised)" if start else "the model before training was better"
    message = (f"the run ended worse than it started: {summary['worse_than_start']}; {where}. Lower train.lr (e.g. 10x) and start a new "
               f"run; what it saved in {run.out} is kept (summary.json: final_is_best false)")
    run.log.event("stop", run.schedule.total_steps, f"guard: {message}")
    return message


def summarize(run: RunState) -> dict:
    """The run's figures: losses, tokens, the guard's report, memory, where things came from."""
    cfg, engine, last = run.cfg, run.engine, run.last
    final_eval = evaluate(run, run.schedule.total_steps)
    summary = {"steps": run.schedule.total_steps, **{f"train_{name}": last.get(name) for name in run.objective.final}, "tokens": run.progress.tokens,
               "elapsed_s": time.perf_counter() - run.started}
    if "router_aux_loss" in last:
        summary["router_aux_loss"] = last["router_aux_loss"]
    if run.processor is not None:  # a vision-language model: which of its parts trained (the model card says it)
        summary["vision"] = {"tower": cfg.adapter.vision, "projector": cfg.adapter.projector}
    summary.update(final_eval or {})
    summary.update(run.guard.report())
    worse = run.guard.worse_than_start(final_eval["eval_loss"] if final_eval else None)
    if worse:
        start = store.find_good(run.out, 0)
        summary.update(final_is_best=False, worse_than_start=worse, start_checkpoint=str(start) if start else None)
    elif summary["final_is_best"] is False:
        score = functools.partial(eval_loss, engine.model, run.data.eval, cfg.train.micro_batch_size, run.tokenizer.pad_token_id, run.accelerator,
                                  cfg.eval.max_batches, run.objective, None, run.tokenizer)
        summary.update(last_good(run.out, int(run.guard.state.best[0]), score if run.data.eval and engine.replicated else None,
                                 engine.unwrap()))
        run.say(f"the final weights are not the best seen: loss level {summary['final_loss_level']:.4g} vs {summary['best_loss_level']:.4g} at "
                f"step {summary['best_level_step']}; the last good checkpoint before it: {summary['last_good_checkpoint']}"
                + (f" (eval loss {summary['last_good_eval_loss']:.4f})" if summary.get("last_good_eval_loss") is not None else ""))
    # Memory held by model, optimizer and activations while training (compare with `finetune plan`).
    gpu = runtime.peak_gpu()
    summary.update(world_size=run.accelerator.num_processes, rss_before_model_mib=run.rss_before_model / 2**20,
                   anonymous_before_model_mib=run.anonymous_before_model / 2**20,
                   peak_rss_mib=runtime.peak_rss() / 2**20, peak_rss_since=run.peak_rss_since, peak_gpu_mib=gpu / 2**20 if gpu is not None else None,
                   backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else None, strategy=engine.name,
                   model_loaded_from=run.model_cfg.name_or_path, base_model=run.base)  # base_model: what the adapter needs
    return summary

