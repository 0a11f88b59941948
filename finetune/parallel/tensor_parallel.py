"""Tensor parallelism: each decoder layer's weights split over `distributed.tensor_parallel` processes,
FSDP2 sharding over the rest of a 2-D (dp, tp) mesh.

The split is the family's own plan (`config.base_model_tp_plan`, the one transformers' `tp_plan="auto"`
reads), applied with transformers' parallel styles on torch's DTensor: q/k/v and the MLP's gate/up
column-wise (each process holds its heads and its share of the MLP's columns), o_proj and down_proj
row-wise (their outputs summed over the group). A norm over a sharded axis (Qwen3's per-head q/k norms)
stays whole, its gradient summed over the group.

An adapter follows its layer: LoRA's B of a column-wise layer is split by its rows like the layer's
outputs, LoRA's A of a row-wise layer by its columns like the layer's inputs (its r-wide output summed);
the other matrix stays whole on every process. peft builds them from the layer's full shape, so the
saved adapter is the same as one process's.

The processes of one group see the same rows (`row_share`): each computes the whole loss, which is
counted once, and FSDP2 averages the gradients over the data-parallel side only.
"""

from __future__ import annotations

import re

import torch

from finetune.config.errors import UserError
from finetune.parallel.sequence_parallel import RowShare

SUPPORTED = ("colwise", "rowwise", "replicated_with_grad_allreduce")
ADAPTER_SIDE = {"colwise": "lora_B", "rowwise": "lora_A"}  # the adapter matrix split as the layer is


def row_share(size: int, rank: int) -> RowShare:
    """The processes that share each row: `size` consecutive ranks, one tensor-parallel group (preflight checked that
    `size` divides the world)."""
    return RowShare(size, rank % size, cut=False)


def plan_of(config: dict) -> dict[str, str]:
    """The family's tensor-parallel plan (module pattern -> style), as transformers ships it on the family's config
    class (empty for a family without one); `config`: its config.json (a model's config.to_dict())."""
    from transformers import CONFIG_MAPPING

    kind = (config.get("text_config") or config).get("model_type", "")
    return dict((CONFIG_MAPPING[kind].base_model_tp_plan if kind in CONFIG_MAPPING else None) or {})


def styles(config: dict) -> dict[str, str]:
    """The plan by layer name (q_proj -> colwise), for the planner."""
    return {pattern.rsplit(".", 1)[-1]: style for pattern, style in plan_of(config).items()}


def check_model(size: int, model) -> None:
    """After loading: the family has a plan of styles built here, and its heads and widths split evenly."""
    if size == 1:
        return
    config = model.config
    if hasattr(config, "vision_config") and getattr(config, "vision_config", None) is not None:
        raise UserError("distributed.tensor_parallel: not with a vision-language model (its tower has no plan here); set it to 1")
    plan = plan_of(config.to_dict())
    if not plan:
        raise UserError(f"distributed.tensor_parallel: transformers ships no tensor-parallel plan for {config.model_type}; set it to 1")
    other = sorted({style for style in plan.values() if style not in SUPPORTED})
    if other:
        raise UserError(f"distributed.tensor_parallel: {config.model_type}'s plan uses {', '.join(other)}, not built here "
                        f"(built: {', '.join(SUPPORTED)}); set it to 1")
    text = config.get_text_config()
    widths = {"attention heads": text.num_attention_heads, "key/value heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
              "MLP width": getattr(text, "intermediate_size", 0)}
    odd = [f"{name} {value}" for name, value in widths.items() if value % size]
    if odd:
        raise UserError(f"distributed.tensor_parallel: {size} does not divide the model's {' and '.join(odd)}; choose a divisor")


def parallelize(model: torch.nn.Module, mesh) -> None:
    """Split the (peft-wrapped) model's layers over the 1-D tensor-parallel `mesh` by the family's plan, in
    place; the weights may be on the meta device (filled after)."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    patterns = [(re.compile(r"(?:.*\.)?" + re.escape(pattern).replace(r"\*", r"\d+")), style) for pattern, style in plan_of(model.config.to_dict()).items()]
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in patterns if pattern.fullmatch(name)), None)
        if style is None or name.endswith(("base_layer", "lora_A", "lora_B")):
            continue
        if style == "replicated_with_grad_allreduce":
            _sum_gradients(module, mesh.get_group())
            continue
        base = getattr(module, "base_layer", None)
        parts = [module] if base is None else [base, *getattr(module, ADAPTER_SIDE[style]).values()]
        for part in parts:
            for param in [n for n, p in part.named_parameters(recurse=False) if p is not None]:
                ALL_PARALLEL_STYLES[style].shard_param(part, param, mesh)
            ALL_PARALLEL_STYLES[style].install_forward(part, mesh)


def _sum_gradients(module: torch.nn.Module, group) -> None:
    """A whole weight that sees only this process's heads: its gradient summed over the group. Hooked on each use's
    gradient (not the accumulated one, which accumulation over micro-batches would sum again), on the parameter the
    forward meets (FSDP2's gathered one), once."""
    import torch.distributed as dist

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    def hook(mod, args):
        if torch.is_grad_enabled():
            for param in mod.parameters(recurse=False):
                if param.requires_grad and not getattr(param, "_tp_summed", False):
                    param.register_hook(summed)
                    param._tp_summed = True

    module.register_forward_pre_hook(hook)
