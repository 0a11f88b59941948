"""How the model is spread over processes: DDP replicas (through accelerate) or FSDP2 shards.

FSDP2 is applied by calling torch's `fully_shard` directly: accelerate's FSDP plugin silently
becomes DDP on a CPU (shared/notes/cpu-facts.md), and the same calls run on gloo and nccl.
"""

from __future__ import annotations

import torch

from finetune.config import RunConfig


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the unit FSDP shards and gathers one at a time."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def shard_fsdp2(model: torch.nn.Module, cfg: RunConfig, device: torch.device, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world,))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    # Compute in low precision, reduce gradients in fp32: the usual FSDP mixed-precision recipe.
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if cfg.distributed.fsdp_cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=cfg.distributed.fsdp_reshard_after_forward)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather a sharded model's full state dict onto CPU (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def local_numel(params: list[torch.nn.Parameter]) -> int:
    """Elements this rank holds (its shard, for FSDP DTensors)."""
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
