"""What a run leaves when its last step is done: the final eval and summary (summary.json, with the guard's
report and the memory it held), the adapter or model in ordinary Hugging Face formats, the tokenizer or
processor, the model card, the loss curve and the serving check; a run that ended worse than it started
is saved and then stops with exit 3."""

from __future__ import annotations

import functools
import json
import time

import torch

from finetune.checkpoint import store
from finetune.checkpoint.checkpointers import last_good
from finetune.checkpoint.resume import clear_starts
from finetune.config.errors import EXIT_DIVERGED, Stopped
from finetune.config.files import job_key
from finetune.config.schema import MUTATED_INITS, SUMMARY_FILE
from finetune.model import experts, nf4
from finetune.objectives.evaluate import eval_loss, exact_match_after
from finetune.outputs import model_card
from finetune.outputs.serving import check_vllm
from finetune.parallel import runtime
from finetune.parallel.distributed import local_numel, replicas_identical
from finetune.run.metrics import plot_loss_curve, summary_line
from finetune.run.state import INITIAL_ADAPTER, RunResult, RunState, evaluate


def finish(state: RunState) -> RunResult:
    cfg, engine, accelerator = state.cfg, state.engine, state.accelerator
    engine.checkpointer.wait()  # the last save complete: last_good may pick it, and DCP's background writes need the process group
    summary = summarize(state)
    # Save: PEFT adapter or full model, tokenizer and resolved config, in ordinary HF formats.
    accelerator.wait_for_everyone()
    unwrapped = engine.unwrap()
    summary["param_numel_per_rank"] = accelerator.gather(torch.tensor([local_numel(engine.model, engine.params)], device=accelerator.device)).tolist()
    if experts.fused_experts(unwrapped):
        summary["experts_held_per_rank"] = accelerator.gather(torch.tensor([experts.held_whole(unwrapped)], device=accelerator.device)).tolist()
    if cfg.model.quantization is not None and cfg.model.quantization.bits == 4:  # the NF4 codes and scales each rank holds (torchao's
        # weights, any 4-bit base's expert stacks): its shards of them under fsdp, its experts' under expert parallelism
        summary["nf4_bytes_per_rank"] = accelerator.gather(torch.tensor([nf4.packed_bytes(engine.model)], device=accelerator.device)).tolist()
    summary["replicas_identical"] = replicas_identical(engine.params, accelerator) if engine.replicated else None
    # Sharded weights are gathered into one ordinary state dict (all ranks take part), saved by rank 0.
    state_dict = engine.final_state()
    if state.main:
        save_outputs(state, unwrapped, state_dict, summary)
    worse = ended_worse(state, summary)
    runtime.finish_distributed(accelerator)
    accelerator.end_training()  # trackers; the process group is already gone
    if worse:
        raise Stopped(worse, EXIT_DIVERGED)
    return RunResult(summary, unwrapped)


def save_outputs(state: RunState, unwrapped, state_dict, summary: dict) -> None:
    """Rank 0: the model (or adapter), its tokenizer or processor, the loss curve, the serving check, exact match after
    training, the model card and summary.json."""
    cfg = state.cfg
    unwrapped.config.use_cache = True  # saved models generate with a KV cache
    initial = state.out / INITIAL_ADAPTER if cfg.adapter.init in MUTATED_INITS else None
    unwrapped.save_pretrained(state.out, safe_serialization=True, state_dict=state_dict,
                              **({"path_initial_model_for_weight_conversion": str(initial)} if initial else {}))
    (state.processor or state.tokenizer).save_pretrained(state.out)  # a processor saves its tokenizer, picture settings and chat template
    plot = plot_loss_curve(state.out) if cfg.logging.plot else None
    summary.update(saved_to=str(state.out), adapter=cfg.adapter.method != "full", loss_curve=str(plot) if plot else None)
    if summary["adapter"]:
        serving = check_vllm(state.out)
        summary["vllm"] = {"loads": serving.loads, "max_lora_rank": serving.max_lora_rank, "problems": serving.problems}
        state.say(serving.line())
    if state.before is not None:
        examples = state.data.eval_examples[: cfg.eval.generate_samples]
        summary.update(exact_match_after(unwrapped, state.tokenizer, examples, cfg.data.format, cfg.eval.max_new_tokens, state.before,
                                         state.say, state.processor))
    # The folder's README.md is a model card of this run (it replaces the template peft's save wrote).
    (state.out / model_card.CARD).write_text(model_card.run_card(cfg, summary, state.out))
    (state.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    state.say(summary_line(summary))
    clear_starts(state.out)  # a finished run ends any restart loop


def ended_worse(state: RunState, summary: dict) -> str:
    """A run that ended worse than it started is saved (summary.json says so) but is no success: the
    stop's message names the start and what to change ("" when the run did not end worse)."""
    if not summary.get("worse_than_start"):
        return ""
    start = summary["start_checkpoint"]
    where = f"its start is {start} (the adapter as initialised)" if start else "the model before training was better"
    message = (f"the run ended worse than it started: {summary['worse_than_start']}; {where}. Lower train.lr (e.g. 10x) and start a new "
               f"run; what it saved in {state.out} is kept (summary.json: final_is_best false)")
    state.log.event("stop", state.schedule.total_steps, f"guard: {message}")
    return message


def summarize(state: RunState) -> dict:
    """The run's figures: losses, tokens, the guard's report, memory, where things came from."""
    cfg, last = state.cfg, state.last
    final_eval = evaluate(state, state.schedule.total_steps)
    summary = {"steps": state.schedule.total_steps, **{f"train_{name}": last.get(name) for name in state.objective.final}, "tokens": state.progress.tokens,
               "elapsed_s": time.perf_counter() - state.started, "job": job_key(cfg)}
    if "router_aux_loss" in last:
        summary["router_aux_loss"] = last["router_aux_loss"]
    if state.processor is not None:  # a vision-language model: which of its parts trained (the model card says it)
        summary["vision"] = {"tower": cfg.adapter.vision, "projector": cfg.adapter.projector}
    summary.update(final_eval or {})
    summary.update(state.guard.report())
    worse = state.guard.worse_than_start(final_eval["eval_loss"] if final_eval else None)
    if worse:
        start = store.find_good(state.out, 0)
        summary.update(final_is_best=False, worse_than_start=worse, start_checkpoint=str(start) if start else None)
    elif summary["final_is_best"] is False:
        summary.update(best_checkpoint(state, summary))
    # Memory held by model, optimizer and activations while training (compare with `finetune plan`).
    gpu = runtime.peak_gpu()
    summary.update(world_size=state.accelerator.num_processes, rss_before_model_mib=state.rss_before_model / 2**20,
                   anonymous_before_model_mib=state.anonymous_before_model / 2**20,
                   peak_rss_mib=runtime.peak_rss() / 2**20, peak_rss_since=state.peak_rss_since, peak_gpu_mib=gpu / 2**20 if gpu is not None else None,
                   backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else None, strategy=state.engine.name,
                   model_loaded_from=state.model_cfg.name_or_path, base_model=state.base)  # base_model: what the adapter needs
    return summary


def best_checkpoint(state: RunState, summary: dict) -> dict:
    """The final weights are not the best seen: the last good checkpoint before the best level (its eval loss where
    one process holds whole weights), said in one line."""
    cfg, engine = state.cfg, state.engine
    score = functools.partial(eval_loss, engine.model, state.data.eval, cfg.train.micro_batch_size, state.tokenizer.pad_token_id, state.accelerator,
                              cfg.eval.max_batches, state.objective, None, state.tokenizer)
    found = last_good(state.out, int(state.guard.state.best[0]), score if state.data.eval and engine.replicated else None, engine.unwrap())
    state.say(f"the final weights are not the best seen: loss level {summary['final_loss_level']:.4g} vs {summary['best_loss_level']:.4g} at "
            f"step {summary['best_level_step']}; the last good checkpoint before it: {found['last_good_checkpoint']}"
            + (f" (eval loss {found['last_good_eval_loss']:.4f})" if found.get("last_good_eval_loss") is not None else ""))
    return found
