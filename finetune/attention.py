"""Attention over packed rows at the cost of the samples in them, not of the whole row.

A packed row holds several samples whose `position_ids` restart at 0. Plain sdpa attends over the
whole row with a block-diagonal mask: every query meets every key of the row (L² work), and a mask
keeps the CPU kernels off their causal fast path. Here each sample runs as its own causal sdpa call,
Σ len² / 2 work, the way flash-attention's varlen kernels treat packed rows on GPUs.

Registered with transformers' AttentionInterface under PACKED_SDPA; models load with it when the
config asks for sdpa. Outside training (eval, generation with a KV cache or padding) it is plain sdpa.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKED_SDPA = "sdpa_packed"


_last: tuple[torch.Tensor, int, list[list[int]]] | None = None  # every layer of a forward sees the same position_ids


def sample_bounds(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row, the offsets where a sample starts, plus the row length at the end (one host sync per forward)."""
    global _last
    if _last is not None and _last[0] is position_ids and _last[1] == position_ids._version:
        return _last[2]
    length = position_ids.shape[-1]
    starts = (position_ids == 0).nonzero().tolist()
    bounds: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
    for row, col in starts:
        bounds[row].append(col)
    result = [([0] if not b or b[0] != 0 else []) + b + [length] for b in bounds]
    _last = (position_ids, position_ids._version, result)
    return result


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query (B, H, L, D), key/value (B, H_kv, L, D) -> (B, L, H, D), as transformers' sdpa returns."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if not module.training or position_ids is None or query.shape[2] != key.shape[2] or position_ids.dim() != 2:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    if position_ids.shape[0] != query.shape[0]:
        position_ids = position_ids.expand(query.shape[0], -1)
    # Each sample's output goes straight to its place in the (B, L, H, D) result: no concatenation
    # and transposed copy of the whole output per layer.
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    for b, bounds in enumerate(sample_bounds(position_ids)):
        for s, e in zip(bounds, bounds[1:]):
            out[b, s:e] = F.scaled_dot_product_attention(query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e],
                                                         dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)[0].transpose(0, 1)
    return out, None


def register() -> str:
    """Make PACKED_SDPA a name transformers accepts for attn_implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    return PACKED_SDPA
