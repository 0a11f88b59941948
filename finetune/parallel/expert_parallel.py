"""Expert parallelism: each mixture-of-experts layer's frozen base experts split over `distributed.expert_parallel`
processes (consecutive ranks), the routed tokens sent to the process that holds their expert.

Under DDP every process would hold every expert stack; with expert parallelism over N, each holds num_experts / N of
them: each stack is sliced as transformers loads it (a 4-bit or 8-bit base quantizes the whole stack in blocks the
processes split and keeps its share of the codes: those one process would hold), so a process holds the others' experts
only one stack at a time, while it loads. The forward
(model/experts.py `routed_apart`) sends each routed copy of a token to its expert's process with torch's all-to-all,
computes there, and sends the outputs back; the all-to-all's backward sends the gradients the other way, so each
process's experts see every process's tokens.

The adapter is left whole on every process: peft builds the experts' LoRA for all of them (the saved adapter is one
process's), a process computes the LoRA of its own experts only, and DDP's all-reduce of the LoRA's gradients (zero
for the experts a process does not hold) gives every process the whole gradient, as without the split. DDP does
not broadcast the split stacks (each process's are its own); the all-to-alls run in a process group of their own,
apart from DDP's.

Under FSDP2 the stacks are parameters fully_shard leaves alone (`ignored_params`): rank 0 loads the model and sends each
stack whole, one at a time, and each process keeps its share (`shares_from_rank0`, `send_shares`); FSDP2 shards the rest
and the adapter, and its reduce-scatter sums the LoRA's gradients as DDP's all-reduce does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from finetune.config.errors import UserError
from finetune.model import experts, families


def check(config: dict, size: int) -> None:
    """Refuse, in one line, a split the model does not allow (before its weights are read; the process count is
    preflight's check_group)."""
    total = families.num_experts(config)
    if not total:
        raise UserError(f"distributed.expert_parallel: {size}: the model has no experts to split (not a mixture of experts); set it to 1")
    if total % size:
        raise UserError(f"distributed.expert_parallel: {size}: {size} does not divide the model's {total} experts; set it to a divisor, or to 1")


def split(model: torch.nn.Module, size: int, rank: int, world: int) -> list[str]:
    """Mark every fused experts module as split (its stacks hold this process's share since they loaded:
    loading.load_model's expert_share) and keep its biases' share; returns the names of the parameters split, which DDP
    must leave alone."""
    group, index = _group(size, world, rank)
    named, names = experts.named_fused_experts(model), []
    if not named:
        raise UserError("distributed.expert_parallel: the model's experts are not fused 3-D stacks (transformers' experts "
                        "modules) to split; set it to 1")
    for name, module in named:
        total = module.num_experts
        count = total // size
        first = index * count
        for key, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 2 and not experts.quantized(param) and param.shape[0] == total:  # biases (E, d): the stacks split as they loaded
                setattr(module, key, torch.nn.Parameter(param.detach()[first:first + count].clone(), requires_grad=False))
            elif param.dim() == 3 and param.shape[0] != count:
                raise UserError(f"distributed.expert_parallel: {name}.{key} holds {param.shape[0]} experts, not this process's {count}")
            names.append(f"{name}.{key}")
        module.__dict__[experts.SPLIT] = experts.Split(group, size, first, count)
    return names


def shares_from_rank0(model: torch.nn.Module, size: int, rank: int) -> dict[str, torch.Tensor]:
    """FSDP2, before fully_shard: each fused experts stack set to this process's share, rank 0's a view of what it loaded,
    the other processes' a meta tensor (no memory); returns each stack and bias by its state-dict name, as rank 0 holds it
    whole (a meta tensor elsewhere), for send_shares once the model is sharded."""
    whole = {}
    for name, module in experts.named_fused_experts(model):
        kept = experts.share_slice(module.num_experts, rank % size, size)
        for key, param in list(module.named_parameters(recurse=False)):
            whole[f"{name}.{key}"] = param.detach()
            if param.dim() == 3:
                share = param.detach()[kept] if rank == 0 else torch.empty((kept.stop - kept.start, *param.shape[1:]), dtype=param.dtype, device="meta")
                setattr(module, key, torch.nn.Parameter(share, requires_grad=False))
    return whole


def send_shares(model: torch.nn.Module, whole: dict[str, torch.Tensor], size: int, device: torch.device, dtype: torch.dtype | None) -> None:
    """Rank 0 sends each stack (and bias) whole, one at a time; every process keeps its share of the stack (split() then
    takes the biases'), in `dtype` where given (FSDP2's compute dtype: frozen, they need no other copy)."""
    rank = dist.get_rank()
    for name, values in whole.items():
        module, key = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        held = values.to(device, dtype or values.dtype) if rank == 0 else torch.empty(values.shape, dtype=dtype or values.dtype, device=device)
        dist.broadcast(held, src=0)
        if held.dim() == 3:
            held = held[experts.share_slice(module.num_experts, rank % size, size)].clone()
        setattr(module, key, torch.nn.Parameter(held, requires_grad=False))


def local_stacks(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The fused experts modules' own parameters: what fully_shard leaves to each process under expert parallelism."""
    return {p for module in experts.fused_experts(model) for p in module.parameters(recurse=False)}


def _group(size: int, world: int, rank: int):
    """This process's group of `size` consecutive ranks and its place in it. Every process makes every group (torch's
    new_group is collective); a group of its own even where it is the whole world, so that the all-to-alls never
    interleave with DDP's all-reduces in one queue."""
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = (group, rank - start)
    return mine
