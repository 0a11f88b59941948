"""A step's data on this rank: the micro-batches of its data step (sampled by the policy where the objective
rolls out), this process's slice of each row, the counts every rank divides by, and the samples it trained."""

from __future__ import annotations

import contextlib

import torch

from finetune.data.datasets import batches_at, step_samples
from finetune.objectives.loss import to_device
from finetune.run.guard import data_step
from finetune.run.state import RunState, skipped


def step_batches(state: RunState, position: int) -> tuple[int, list[dict], list[float], float]:
    """The micro-batches of data step `position` for this rank, on its device, with the objective's
    counts (and the real tokens) summed over the step's micro-batches and every rank."""
    accelerator, sp, pad = state.accelerator, state.row_share, state.tokenizer.pad_token_id
    position = state.objective.reading_position(position)
    epoch, micro_batches, real_tokens = batches_at(state.data, state.cfg, state.schedule, position, sp.data_rank(accelerator.process_index),
                                                   sp.data_world(accelerator.num_processes), pad)
    if state.objective.rollouts:  # what the policy samples as it is now (under the training forward's autocast): GRPO, on-policy distillation
        with accelerator.autocast():
            sampled = state.objective.rollout(state.engine.unwrap(), state.tokenizer, micro_batches, position, accelerator.device)
        if sampled is not None:
            micro_batches, real_tokens = sampled
        sample_ahead(state, position)
    micro_batches = [sp.shard(b, pad) for b in micro_batches]  # this process's slice of each row (sequence parallelism)
    real_tokens = 0 if sp.rank else real_tokens  # a row's tokens, counted once among the processes sharing it
    local = [*map(sum, zip(*(state.objective.counts(b) for b in micro_batches))), real_tokens]  # counted on the host
    local = local if sp.counts else [0] * len(local)  # a whole row shared (tensor parallel): counted by the group's first
    micro_batches = [to_device(b, accelerator.device) for b in micro_batches]
    if accelerator.num_processes == 1:
        return epoch, micro_batches, local[:-1], local[-1]
    *totals, global_real = accelerator.reduce(torch.tensor(local, device=accelerator.device), "sum").tolist()  # a sync: the loss scale
    return epoch, micro_batches, totals, global_real


def sample_ahead(state: RunState, position: int) -> None:
    """The objective's coming data steps' rollouts (grpo.async_rollouts k: the next k), sampled in the background while
    this step trains; each begun once, by the policy as it is when it begins."""
    accelerator, sp = state.accelerator, state.row_share
    for following in upcoming(state, position, state.objective.samples_ahead()):
        if state.objective.sampling(following):
            continue
        _, prompts, _ = batches_at(state.data, state.cfg, state.schedule, following, sp.data_rank(accelerator.process_index),
                                   sp.data_world(accelerator.num_processes), state.tokenizer.pad_token_id)
        state.objective.sample_ahead(state.engine.unwrap(), state.tokenizer, prompts, following, accelerator.device, accelerator.autocast)


def upcoming(state: RunState, position: int, depth: int) -> list[int]:
    """The next `depth` data steps the run reads after `position`, in order (fewer near the end; num_iterations' updates of
    one data step read it once)."""
    found, step = [], state.progress.step + 1
    while len(found) < depth and step < state.schedule.total_steps:
        following = state.objective.reading_position(data_step(step, skipped(state)))
        if following != position and following not in found:
            found.append(following)
        step += 1
    return found


def trained_samples(state: RunState, position: int) -> list[int]:
    """logging.sample_ids: the samples of data step `position` on every rank (those sharing a row name it once), sorted."""
    sp, accelerator = state.row_share, state.accelerator
    mine = [] if sp.rank else step_samples(state.data, state.cfg, state.schedule, state.objective.reading_position(position),
                                            sp.data_rank(accelerator.process_index), sp.data_world(accelerator.num_processes))
    from accelerate.utils import gather_object

    return sorted(gather_object(mine) if accelerator.num_processes > 1 else mine)


def saved_on_cpu(offload: bool):
    """train.offload_activations: what autograd saves in the forward goes to pinned host memory and comes
    back when the backward reaches it (the backward needs no context: the tensors carry their hooks)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
