"""Sequence parallelism: the tokens of every row split over `distributed.sequence_parallel` processes.

DeepSpeed's Ulysses attention for Hugging Face models (`UlyssesSPAttentionHF`, from the ALST paper) does
the work: around each attention an all-to-all turns a process's slice of the row with every head into
the whole row with 1/N of the heads, and back after it. Everything else in a decoder layer works token
by token and runs on the slice, so activations per process shrink N times. This module is the glue:
which processes share rows, how a row is cut, and the attention call that routes a cut row through
Ulysses to finetune's packed attention (`attention.packed_sdpa_forward`), which then sees the whole
row's position_ids: packed samples stay apart across the cut.

The loss stays the sum over trained tokens: each process sums the cross-entropy of its slice, with the
targets taken from the whole row (the last token of a slice predicts the first of the next). The loop
divides the sum over all processes by the trained tokens of all processes, as without sequence
parallelism, and the gradient average over all processes (DDP, FSDP and ZeRO alike) is then the
whole row's gradient: the all-to-all's backward carries each process's share to the others.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.config.errors import UserError
from finetune.data.rows import IGNORE
from finetune.model import families


@dataclass(frozen=True)
class RowShare:
    """The processes that share each row: `size` consecutive ranks, this one `rank` among them. cut: each holds
    slice `rank` of the row (sequence parallelism; `group` is their process group); else each holds the whole
    row and a share of the weights (tensor parallelism), the row counted once. size 1: every process holds
    whole rows of its own."""

    size: int = 1
    rank: int = 0
    group: object = None
    cut: bool = True

    @property
    def counts(self) -> bool:
        """Whether this process's losses and counts enter the sums over processes (a whole row, once)."""
        return self.cut or self.rank == 0

    def averaged_over(self, world: int) -> int:
        """The processes the gradients are averaged over: all of them, or one per tensor-parallel group."""
        return world if self.cut else world // self.size

    def data_rank(self, rank: int) -> int:
        """Which share of the data this process reads: the same for the processes that share rows."""
        return rank // self.size

    def data_world(self, world: int) -> int:
        return world // self.size

    def shard(self, batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
        """This process's slice of a host micro-batch (padded to a multiple of `size` with an untrained
        segment), with what its loss needs from the whole row: `keep` (positions whose next token is
        trained), `targets` (those next tokens) and `full_position_ids` (where samples start)."""
        if self.size == 1 or not self.cut:
            return batch
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        extra = -ids.shape[1] % self.size
        if extra:
            ids, labels = F.pad(ids, (0, extra), value=pad_id), F.pad(labels, (0, extra), value=IGNORE)
            positions = torch.cat([positions, torch.arange(extra).expand(len(positions), -1)], 1)
        following = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # at each position, the token it predicts
        part = ids.shape[1] // self.size
        cut = slice(self.rank * part, (self.rank + 1) * part)
        keep = following[:, cut] != IGNORE
        full = positions.clone()
        # to_device hands these to the attention (tensor attributes stay on the host object)
        full.sequence_group, full.route = self.group, attention
        return {"input_ids": ids[:, cut], "labels": labels[:, cut], "position_ids": positions[:, cut], "keep": keep,
                "targets": following[:, cut][keep], "full_position_ids": full}


def setup(size: int, rank: int, world: int) -> RowShare:
    """The process groups of `size` consecutive ranks (every rank creates every group, as torch asks)."""
    if size == 1:
        return RowShare()
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # deepspeed.comm over the process group accelerate made
    groups = [torch.distributed.new_group(list(range(first, first + size))) for first in range(0, world, size)]
    return RowShare(size, rank % size, groups[rank // size])


def check(size: int, model_config: dict) -> None:
    """Before loading: DeepSpeed is there and the heads split evenly (Ulysses hands each process
    heads / N query heads and key/value heads / N key/value heads)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError("distributed.sequence_parallel: runs DeepSpeed's Ulysses attention; pip install 'finetune-kit[deepspeed]'")
    text = model_config.get("text_config") or model_config
    heads = text.get("num_attention_heads")
    kv = text.get("num_key_value_heads") or heads
    if heads is None:
        return  # not a folder we can read before loading: check_model says it after
    if families.attention_softcap(model_config):
        raise UserError(f"distributed.sequence_parallel: this model soft-caps its attention logits "
                        f"({families.attention_softcap(model_config)}), which runs eager attention, not finetune's packed attention that "
                        "Ulysses routes; set it to 1")
    odd = [f"{name} {value}" for name, value in (("attention heads", heads), ("key/value heads", kv)) if value % size]
    if odd:
        raise UserError(f"distributed.sequence_parallel: {size} does not divide the model's {' and '.join(odd)}; choose a divisor of {kv}")


def check_model(size: int, model, router_coef: float) -> None:
    """After loading: the model's attention goes through finetune's packed attention, which routes it, no layer
    carries a state along the row outside attention, and no loss needs a whole row outside attention (an MoE
    router's load balancing is over the tokens a forward sees)."""
    from finetune.model import mixers
    from finetune.model.attention import PACKED_SDPA, attention_of

    if size == 1:
        return
    if attention_of(model) != PACKED_SDPA:
        raise UserError(f"distributed.sequence_parallel: this model runs {attention_of(model)} attention, which does not go through "
                        f"finetune's packed attention (set model.attn_implementation: sdpa where the family allows it), or set it to 1")
    carried = mixers.mixers(model)
    if carried:  # its scan or convolution over a slice would start from nothing where the row's earlier slice ended
        raise UserError(f"distributed.sequence_parallel: this model's {type(carried[0]).__name__} layers carry a state along the row, "
                        "which a process holding a slice of it cannot start from; set it to 1")
    if router_coef > 0:
        raise UserError("distributed.sequence_parallel: the router's load-balancing loss of this mixture-of-experts model would be taken per "
                        "slice of a row; set train.router_aux_loss_coef: 0, or sequence_parallel: 1")


def attention(inner, module, query, key, value, attention_mask, full_positions: torch.Tensor, **kwargs):
    """Attention over the whole row for this process's slice: Ulysses' all-to-alls around `inner`
    (finetune's packed attention, which hands itself over: the attention layer does not import this
    one), given the whole row's position_ids with their sample bounds."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    def whole_row(module, query, key, value, attention_mask, *args, **kwargs):
        return inner(module, query, key, value, attention_mask, *args, **{**kwargs, "position_ids": full_positions})

    ulysses = UlyssesSPAttentionHF(whole_row, batch_size=query.shape[0], attn_head_count=query.shape[1], attn_head_size=query.shape[-1],
                                   kv_head_count=key.shape[1], num_hidden_layers=1, process_group=full_positions.sequence_group,
                                   seq_length_is_variable=True)
    return ulysses(module, query, key, value, attention_mask, **kwargs)


def tile_mlps(model, shards: int) -> int:
    """model.tiled_mlp: each decoder layer's dense MLP runs through DeepSpeed's TiledMLP over `shards`
    chunks of the row (its forward keeps only the input; the backward recomputes one chunk at a time).
    Returns how many MLPs were tiled; refuses a model whose MLPs are mixtures of experts."""
    import types

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    mlps = [(name, m) for name, m in model.named_modules() if name.split(".")[-1] == "mlp"]
    experts = sorted({type(m).__name__ for _, m in mlps if not type(m).__name__.endswith("MLP")})
    if experts or not mlps:
        raise UserError(f"model.tiled_mlp: tiles dense MLPs only; this model's feed-forward layers are {', '.join(experts) or 'not named mlp'}; set it to 1")
    for _, mlp in mlps:
        def forward(self, x, _original=type(mlp).forward):
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

            def chunk(module, part):
                # The backward recomputes each chunk outside the forward's autocast (autograd runs a
                # Function's backward without it): re-enter it, or a bf16 chunk meets fp32 LoRA weights.
                with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                    return _original(module, part)

            return TiledMLP.apply(chunk, self, x, shards, [p for p in self.parameters() if p.requires_grad])

        mlp.forward = types.MethodType(forward, mlp)
    return len(mlps)
