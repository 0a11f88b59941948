"""Evaluation: the run's loss on held-out rows (per token, or per preference pair with its metrics),
and greedy generation scored by exact match."""

from __future__ import annotations

import math

import torch

from finetune.data import images
from finetune.data.encoding import prompt_and_answer
from finetune.data.packing import Split
from finetune.data.rows import IGNORE
from finetune.model.loading import end_tokens
from finetune.objectives.loss import to_device


def batches_per_rank(rows: int, world: int, batch_size: int, max_batches: int | None) -> int:
    """How many eval batches every rank runs: the same on all, as a sharded model gathers its weights in
    each forward (the busiest rank's count, capped by eval.max_batches)."""
    count = math.ceil(math.ceil(rows / world) / batch_size)
    return min(count, max_batches) if max_batches else count


@torch.no_grad()
def eval_loss(model, rows: Split, batch_size: int, pad_id: int, accelerator, max_batches: int | None, objective=None, sp=None,
              tokenizer=None) -> dict:
    """The objective's mean loss (per token: with perplexity; per pair: with its metrics) over this
    rank's share of the eval rows, reduced over ranks. `sp`: the processes that share each row (as in
    training: their slices of it, or the whole row counted once). GRPO: the mean reward of greedy completions of the eval prompts
    (eval_loss is its negative)."""
    from finetune.objectives.objective import SFT
    from finetune.parallel.sequence_parallel import RowShare

    if hasattr(objective, "evaluate"):
        return objective.evaluate(getattr(model, "module", model), tokenizer, rows, batch_size, accelerator, max_batches)
    objective, sp = objective or SFT(), sp or RowShare()
    was_training = model.training
    model.eval()
    world = sp.data_world(accelerator.num_processes)
    mine = list(range(sp.data_rank(accelerator.process_index), len(rows), world))
    # A rank with fewer rows repeats a row with its labels ignored.
    count = batches_per_rank(len(rows), world, batch_size, max_batches)
    sums = None  # the loss's, the metrics' and the objective's counts, summed over the batches
    for b in range(count):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        batch = rows.batch(chunk or [0], pad_id)
        if not chunk:
            batch["labels"].fill_(IGNORE)
        batch = to_device(sp.shard(batch, pad_id), accelerator.device)
        counts = objective.counts(batch)
        with accelerator.autocast():
            parts = objective.losses(model, batch, counts)
        metrics = parts.metrics.double().cpu() if parts.metrics is not None else torch.zeros(len(objective.metrics), dtype=torch.float64)
        here = torch.cat([parts.tokens.double().cpu().reshape(1), metrics, torch.tensor(counts, dtype=torch.float64)]) * sp.counts
        sums = here if sums is None else sums + here
    sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
    loss_sum, metric_sums, counts = sums[0], sums[1 : 1 + len(objective.metrics)], sums[1 + len(objective.metrics) :]
    model.train(was_training)
    loss = (loss_sum / counts[0]).item() if counts[0] > 0 else float("nan")
    if objective.metrics:
        return {"eval_loss": loss, f"eval_{objective.unit}": int(counts[0]),
                **{f"eval_{name}": (value / counts[c]).item() if counts[c] > 0 else float("nan")
                   for name, value, c in zip(objective.metrics, metric_sums, objective.mean_over)}}
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": int(counts[0])}


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int, add_special_tokens: bool | None = None, temperature: float = 0.0,
             streamer=None, pictures: list[bytes] | None = None, processor=None) -> str:
    """The continuation of a prompt: greedy unless temperature > 0, streamed to `streamer` if given; a
    prompt that shows pictures (their bytes) goes through the vision-language model's processor.

    add_special_tokens: default, only when the tokenizer has no chat template (prompts rendered with
    one already carry the special tokens they need)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    add = not tokenizer.chat_template if add_special_tokens is None else add_special_tokens
    if pictures:
        inputs = dict(processor(text=[prompt], images=images.decoded(pictures), add_special_tokens=add, return_tensors="pt").to(device))
    else:
        ids = tokenizer(prompt, add_special_tokens=add, return_tensors="pt").input_ids.to(device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ids = inputs["input_ids"]
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        use_cache=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=end_tokens(model, tokenizer),
        streamer=streamer,
        **sampling(temperature),
    )
    model.train(was_training)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def sampling(temperature: float) -> dict:
    """generate()'s decoding arguments: greedy at 0, else sampling at that temperature."""
    return {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}


def exact_match(model, tokenizer, examples: list[dict], fmt: str, max_new_tokens: int, processor=None) -> dict:
    """Share of eval prompts whose greedy answer equals the reference answer (whitespace-trimmed); a row
    with pictures is answered with them (processor: the vision-language model's)."""
    results = []
    for row in examples:
        prompt, answer = prompt_and_answer(row, tokenizer, fmt)
        pictures = images.read(row["images"])[0] if images.has_images(row) else None
        got = generate(model, tokenizer, prompt, max_new_tokens, pictures=pictures, processor=processor)
        results.append({"prompt": prompt, "expected": answer.strip(), "got": got.strip()})
    correct = sum(r["got"] == r["expected"] for r in results)
    return {"exact_match": correct / max(1, len(results)), "n": len(results), "samples": results}


def exact_match_after(model, tokenizer, examples: list[dict], fmt: str, max_new_tokens: int, before: dict, say=print, processor=None) -> dict:
    """Exact match after training beside `before` (exact_match's result at the start), with three samples shown."""
    after = exact_match(model, tokenizer, examples, fmt, max_new_tokens, processor)
    say(f"exact match on {after['n']} eval prompts: {before['exact_match']:.1%} before -> {after['exact_match']:.1%} after")
    for b, a in list(zip(before["samples"], after["samples"]))[:3]:
        say(f"  prompt {a['prompt']!r}\n    expected {a['expected']!r} | before tuning {b['got']!r} | after tuning {a['got']!r}")
    return {"exact_match_before": before["exact_match"], "exact_match_after": after["exact_match"]}
