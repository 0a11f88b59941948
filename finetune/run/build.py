"""What a run is built from, before its first step: the staged model folder, tokenizer (or processor),
tokenized data, step schedule and objective (`load_inputs`); then the base as the strategy's engine loads
it, the adapter on it, spread over the processes with the optimizer, the objective's frozen models (a
reference, a teacher) and the packed-row check (`load_model`)."""

from __future__ import annotations

from pathlib import Path

from finetune.config import faults
from finetune.config.errors import UserError
from finetune.config.schema import MUTATED_INITS, RunConfig, looks_local
from finetune.config.strategy import Strategy
from finetune.data.chat import choose_template
from finetune.data.datasets import load_data, plan_steps, summary_lines
from finetune.model import families, nf4, routing, vision
from finetune.model.loading import apply_adapter, compile_layers, describe, load_tokenizer, loftq_init
from finetune.model.mixers import packed_samples_meet
from finetune.model.stage import staged_model
from finetune.model.teacher import teacher_source, teacher_tokenizer
from finetune.objectives.distill import teacher_answers
from finetune.objectives.evaluate import exact_match
from finetune.objectives.registry import objective_for
from finetune.parallel import runtime, sequence_parallel, tensor_parallel
from finetune.parallel.engines import engine_for
from finetune.run.state import INITIAL_ADAPTER, RunState
from finetune.run.supervise import stop_if_preempted


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
                              cfg.distill.teacher_quantization, cfg.distill.cross_tokenizer) if cfg.train.objective == "distill" else None)
    if cfg.distill.cross_tokenizer and processor is not None:
        raise UserError("distill.cross_tokenizer: not with a vision-language model (the teacher would read the text without the pictures)")
    if cfg.distill.sequence_level and processor is not None:
        raise UserError("distill.sequence_level: not with a vision-language model (its teacher would answer without the pictures)")
    answers = teacher_answers(*teacher, cfg.distill, tokenizer, accelerator.device, each) if cfg.distill.sequence_level and teacher else None
    data = load_data(cfg.data, tokenizer, cfg.train.seed, eval_examples=cfg.eval.generate_samples if main else 0, say=each, processor=processor,
                     answers=answers)
    stop_if_preempted(preemption.signal is not None, preemption.name, Path(cfg.train.output_dir), main, "while the data loaded")
    d = cfg.distributed
    sp = tensor_parallel.row_share(d.tensor_parallel, rank) if d.tensor_parallel > 1 else sequence_parallel.setup(d.sequence_parallel, rank, world)
    state = RunState(cfg, accelerator, preemption, model_cfg, tokenizer, data, plan_steps(cfg, len(data.train), sp.data_world(world)),
                   processor=processor, row_share=sp, teacher=teacher)
    state.objective = objective_for(cfg, locate=data.train.locate, world=world, processor=processor)
    for line in summary_lines(data, cfg.data.max_seq_len):
        state.say(line)
    return state


def load_model(state: RunState) -> None:
    """The base, loaded as the strategy's engine wants it, the adapter on it, then spread over the
    processes with the optimizer built on what each holds; the objective's frozen models beside it."""
    cfg, t = state.cfg, state.cfg.train
    state.engine = engine_for(cfg, state.accelerator)
    if state.engine.gathers or nf4.after_adapter(cfg.model):  # gathered layers; or weights cast and quantized one by one after loading
        runtime.map_large_blocks()
    state.rss_before_model, state.anonymous_before_model = runtime.current_rss(), runtime.current_anonymous()
    model = state.engine.load(state.model_cfg, state.say, policy=True)
    # Saved configs name the source, not a RAM copy; a local one by its absolute path, so that the adapter
    # loads from any directory (AutoPeftModelForCausalLM reads it); hub ids stay as they are.
    state.base = str(Path(cfg.model.name_or_path).expanduser().resolve()) if looks_local(cfg.model.name_or_path) else cfg.model.name_or_path
    model.name_or_path = model.config.name_or_path = state.base
    state.router_coef = families.router_aux_loss_coef(model.config.to_dict()) if t.router_aux_loss_coef is None else t.router_aux_loss_coef
    sequence_parallel.check_model(cfg.distributed.sequence_parallel, model, state.router_coef)
    tensor_parallel.check_model(cfg.distributed.tensor_parallel, model)
    if cfg.train.objective == "grpo" and cfg.grpo.router_replay:
        why = routing.unreplayable(model)
        if why:
            raise UserError(f"grpo.router_replay: {why}; set router_replay: false")
        state.say(f"router replay: {routing.install(model)} routers send each trained token to the experts it was sampled with")
    model = apply_adapter(model, cfg.adapter, t.gradient_checkpointing, say=state.say)
    if cfg.model.tiled_mlp > 1:
        count = sequence_parallel.tile_mlps(model, cfg.model.tiled_mlp)
        state.say(f"tiled MLP: {count} MLPs run over {cfg.model.tiled_mlp} chunks of each row")
    if cfg.adapter.init == "loftq":
        loftq_init(model, state.model_cfg)
    if cfg.adapter.init in MUTATED_INITS and state.main:
        # PiSSA/OLoRA move part of each weight into the adapter: peft converts the final adapter for the
        # original base from this record of where training started (the same for every start: SVD/QR).
        model.save_pretrained(state.out / INITIAL_ADAPTER, safe_serialization=True)
    if t.neftune_alpha:  # transformers' own NEFTune hook: noise only while the embedding is in training mode
        from transformers.integrations.neftune import activate_neftune

        activate_neftune(model, t.neftune_alpha)
    say_model(state, model)
    if cfg.eval.generate_samples and state.main and state.data.eval_examples:
        state.before = exact_match(model, state.tokenizer, state.data.eval_examples[: cfg.eval.generate_samples], cfg.data.format, cfg.eval.max_new_tokens,
                                 state.processor)
        state.say(f"before training: exact match {state.before['exact_match']:.1%} on {state.before['n']} eval prompts")
    if cfg.model.compile:
        compile_layers(model)
    state.engine.prepare(model, state.schedule.total_steps)
    state.engine.checkpointer.after_file = faults.inject_saving
    load_frozen_models(state)
    if cfg.data.packing or cfg.train.objective != "sft":
        check_packed_rows(state)


def say_model(state: RunState, model) -> None:
    """The model line (method, trainable and total parameters, weights' size) and the batch line."""
    cfg, t, world = state.cfg, state.cfg.train, state.accelerator.num_processes
    info = describe(model)
    q = cfg.model.quantization
    method = cfg.adapter.method if q is None else f"{cfg.adapter.method} on a {q.bits}-bit base" + (f" ({q.quant_type})" if q.bits == 4 else "")
    state.say(
        f"model: {cfg.model.name_or_path} ({method}), {info['trainable_params']:,} trainable of "
        f"{info['total_params']:,} params ({info['trainable_params'] / info['total_params']:.2%}), "
        f"{info['param_bytes'] / 2**20:.1f} MiB of weights"
    )
    if "unquantized" in info:
        stacks = f" and {info['expert_modules']} experts modules' weight stacks" if info["expert_modules"] else ""
        state.say(f"quantized: {info['quantized_linears']} linear layers{stacks}; kept in {info['unquantized_dtype']}: {info['unquantized']}")
    if cfg.distributed.expert_parallel > 1:
        state.say(f"experts: each process holds 1/{cfg.distributed.expert_parallel} of every layer's (expert parallelism: the routed "
                  "tokens go to their expert's process and back), the adapter's LoRA of all of them")
    data_world, sp = state.row_share.data_world(world), state.row_share
    shared = f" (of {world}: {sp.size} share each row" + ("" if sp.cut else ", each holding a share of the weights") + ")" if sp.size > 1 else ""
    state.say(
        f"batch: {t.micro_batch_size} micro x {t.grad_accum} accum x {data_world} process(es){shared} = "
        f"{t.micro_batch_size * t.grad_accum * data_world} rows per step; {state.schedule.total_steps} steps "
        f"({state.schedule.steps_per_epoch} per epoch)"
    )


def load_frozen_models(state: RunState) -> None:
    """The objective's frozen models, each held as the policy is: DPO/KTO/GRPO's reference under full
    fine-tuning (a copy of the base), distillation's teacher (an adapter merged into it, maybe)."""
    cfg = state.cfg
    if cfg.needs_reference:
        state.objective.reference = state.engine.reference(state.model_cfg, state.say)
        state.say(f"{cfg.train.objective}: the reference is a frozen copy of the base, held as the policy is")
    if state.teacher is not None:
        teacher_cfg, adapter = state.teacher
        state.objective.teacher = state.engine.reference(teacher_cfg, state.say, adapter)
        if cfg.distill.cross_tokenizer:
            state.objective.tokenizers = (state.tokenizer, teacher_tokenizer(cfg.distill.teacher, teacher_cfg))
        q = cfg.distill.teacher_quantization
        state.say(f"distill: the teacher is {cfg.distill.teacher}" + (f" (merged into {teacher_cfg.name_or_path})" if adapter else "")
                + (f" (in {q.bits} bits" + (f", {q.quant_type})" if q.bits == 4 else ")") if q else "")
                + f", frozen, held as the student is; {'ULD across tokenizers' if cfg.distill.cross_tokenizer else cfg.distill.divergence} "
                f"at temperature {cfg.distill.temperature:g}")


def check_packed_rows(state: RunState) -> None:
    """Refuse a model that lets the samples of a packed row see each other: it would train and evaluate
    on other samples' context without a sign."""
    zero3 = Strategy.of(state.cfg.distributed.strategy, state.accelerator.num_processes).zero_stage == 3
    cfg, objective = state.cfg, state.cfg.train.objective
    # the longest row the objective packs: a sample; a pair's two sides; a prompt written once before its group's completions
    row = {"sft": cfg.data.max_seq_len, "grpo": cfg.data.max_seq_len + cfg.grpo.num_generations * cfg.grpo.max_completion_length}
    how = packed_samples_meet(state.engine.unwrap(), state.engine.model, state.accelerator.device, state.accelerator.autocast,
                              row.get(objective, 2 * cfg.data.max_seq_len), zero3)
    if not how:
        return
    if objective == "sft":
        raise UserError(f"data.packing: {how}; set data.packing: false")
    what = {"grpo": "each prompt's completions", "kto": "its examples"}.get(objective, "each pair's chosen and rejected sequences")
    raise UserError(f"train.objective: {objective} packs {what} in one row, and {how}: this model cannot be trained with {objective} by finetune")
