"""Sequence mixers packed exactly: the layers that carry a state along the row outside attention (Gated DeltaNet's
recurrent state in Qwen3-Next and Qwen3.5, Kimi Delta Attention's, the Mamba and Mamba2 scans of Jamba, Bamba, Zamba2,
GraniteMoE-Hybrid, Falcon-H1, Nemotron-H and Mamba, LFM2's short convolution) would run on from one packed sample
into the next.

finetune runs such a layer once per packed sample, from a zero state, as in a row of its own: exact whatever
implementation is behind the layer (the kernel libraries' or the PyTorch fallbacks), since it is the layer's own
forward that runs. A forward pre-hook on the model hands its layers the samples of the rows it is given as the
keyword attention.SEGMENTS (finetune's packed attention reads them too, where a layer is handed no position ids).
The decoder layers hand that keyword on to their mixers, or a pre-hook on the mixer's parent leaves it on the
mixer: both read it from the layer's own call, which gradient checkpointing keeps and replays, so a recomputed
layer splits its rows as its forward did, whatever forwards ran in between (KTO's reference point). Pure Mamba
models hand their blocks no keywords: their mixers take the model's latest samples, which a recomputation would
not (`UNKEPT`: refused packed with checkpointing). Rows of one sample each, and every forward with a cache
(generation), run the layers untouched.

A vision-language form (Qwen3.5 with pictures) is handed its positions in the 4-row form (attention.packed_positions),
whose first row, the text positions, says where each sample starts. Not here: families not measured (`unhandled` finds
their mixers: refused packed).
"""

from __future__ import annotations

import inspect

import torch

from finetune.model.attention import LEAK_TOLERANCE, PACKED_SDPA, PACKED_SINKS, SEGMENTS, in_packed_rows, leak, row_places, sample_bounds

# The model types whose mixers were measured exact packed (bench/families.py; tests/test_families.py tests some)
FAMILIES = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "jamba", "bamba",
            "granitemoehybrid", "zamba2", "falcon_h1", "mamba", "mamba2", "kimi_linear", "falcon_mamba", "nemotron_h"}
UNKEPT = {"mamba", "mamba2", "falcon_mamba"}  # their blocks are called without keywords: the samples are not kept for a recomputation


def mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of `model` that mix tokens along the row outside attention: each runs a causal Conv1d, which no
    attention layer has."""
    return [module for module in model.modules() if any(isinstance(child, torch.nn.Conv1d) for child in module.children())]


def handles(module: torch.nn.Module) -> bool:
    """Whether `module` is a mixer that runs one packed sample at a time."""
    return getattr(type(module).forward, "finetune_packed", False)


def unhandled(model: torch.nn.Module) -> str | None:
    """The class of a layer that mixes tokens along the row outside attention and is not run one packed sample at a
    time, or None. On small random models such a layer's state moved the logits too little to measure against bf16
    rounding while the gradients were 12-23% off (bench/families.py): found in the layers, never measured."""
    for layer in mixers(model):
        if not handles(layer):
            return type(layer).__name__
    return None


def packed_samples_meet(model, prepared, device, autocast, row_tokens: int, gathered_per_call: bool = False) -> str:
    """Why the samples of a packed row would see each other in `model` ("" where they stay apart): a place in rows of
    `row_tokens` that the model reads (attention.row_places), a layer that mixes tokens outside attention unhandled, a
    Mamba whose recomputation would not know the samples, else attention's `leak` measured on `prepared` (the model as
    the strategy wraps it; every process at once) under `autocast`, the training forward's. gathered_per_call: the
    strategy gathers a layer's weights at each call (ZeRO-3), where a mixer run once per sample would make the
    processes' collectives differ in number."""
    kind = f"{model.config.model_type} ({model.config._attn_implementation} attention)"
    placed = row_places(model.config, row_tokens)
    if placed:
        return placed
    mixer = unhandled(model)
    if mixer:
        return f"{kind} mixes tokens outside attention ({mixer}), carrying a state from one packed sample into the next"
    per_sample = mixers(model)  # all handled, by the line above
    if per_sample and gathered_per_call:
        return (f"{kind} runs its {type(per_sample[0]).__name__} layers once per packed sample, and ZeRO-3 gathers a layer's weights "
                "at each call: the processes' rows hold other numbers of samples, so their collectives would not match "
                "(distributed.strategy: fsdp packs it)")
    if model.config.model_type in UNKEPT and model.is_gradient_checkpointing:
        return (f"{kind} calls its Mamba blocks without keywords, so gradient checkpointing's recomputation would not know where "
                "each packed sample starts (train.gradient_checkpointing: false packs it)")
    with autocast():
        # a vision-language model's text vocabulary, below its picture token (a picture token without a picture fails)
        vocab = min(model.config.get_text_config().vocab_size, getattr(model.config, "image_token_id", None) or 2**62)
        moved = leak(prepared, vocab, device)
    if not moved > LEAK_TOLERANCE:  # nan: context changes nothing, there is nothing to leak
        return ""
    return (f"{kind} lets the samples of a packed row see each other (measured at the start: a sample's logits "
            f"moved {moved:.0%} of the way to having the sample before it as context)")


def register(model: torch.nn.Module) -> bool:
    """Have `model` hand its layers the samples of packed rows (finetune's packed attention reads them where a layer is
    handed no position ids: GPT-BigCode, Persimmon, GraniteMoE-Hybrid), and the mixers of the families measured run one
    packed sample at a time (their class's forward wrapped, once per process). Returns whether it has such mixers."""
    found = mixers(model) if model.config.model_type in FAMILIES else []
    for mixer in found:
        if not handles(mixer):
            wrapped = _per_sample(type(mixer).forward)
            wrapped.finetune_packed = True
            type(mixer).forward = wrapped
    takes = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    if takes and not getattr(model, "finetune_segments_hook", False):
        model.register_forward_pre_hook(lambda module, args, kwargs: _segments_of_packed_rows(module, args, kwargs, found), with_kwargs=True)
        ids = {id(m) for m in found}
        parents = {name.rpartition(".")[0] for name, module in model.named_modules() if id(module) in ids}
        for name in parents:
            own = [m for m in model.get_submodule(name).children() if id(m) in ids]
            model.get_submodule(name).register_forward_pre_hook(lambda module, args, kwargs, own=own: _hand_on(kwargs, own), with_kwargs=True)
        model.finetune_segments_hook = True
    return bool(found)


def _segments_of_packed_rows(model, args, kwargs, found):
    """The model's forward pre-hook: [(row, start, end)] of every sample of rows given position ids (samples start
    where they restart), passed on to its layers and left on its mixers; nothing for a forward with a cache."""
    if not found and not (model.config._attn_implementation in (PACKED_SDPA, PACKED_SINKS) and (model.training or in_packed_rows())):
        return None  # nothing reads them (the packed attention reads packed rows only): no host sync for the samples' bounds
    segments = _segments(model, kwargs)
    for mixer in found:
        setattr(mixer, SEGMENTS, segments)
    return None if segments is None else (args, {**kwargs, SEGMENTS: segments})


def _hand_on(kwargs, own) -> None:
    """A mixer's parent's forward pre-hook: the samples its call was handed, left on its mixers. It runs inside the
    parent's call, so a recomputation under gradient checkpointing hands on the samples of the forward it replays."""
    if SEGMENTS in kwargs:
        for mixer in own:
            setattr(mixer, SEGMENTS, kwargs[SEGMENTS])


def _segments(model, kwargs) -> list[tuple[int, int, int]] | None:
    positions = kwargs.get("position_ids")
    use_cache = kwargs.get("use_cache")
    if positions is None or kwargs.get("past_key_values") is not None or kwargs.get("cache_params") is not None:
        return None
    if use_cache if use_cache is not None else getattr(model.config, "use_cache", False):
        return None
    if positions.dim() == 3:
        if positions.shape[0] != 4:  # (time, height, width) alone: where a sample starts is not said
            return None
        positions = positions[0]  # the 4-row form: text positions first
    bounds = sample_bounds(positions)  # the training batch's own (no host sync), else one a forward
    return [(row, start, end) for row, edges in enumerate(bounds) for start, end in zip(edges, edges[1:])]


def _per_sample(forward):
    """A mixer's forward that runs each packed sample of the batch on its own (a row of one sample: its own zero state),
    the outputs joined back along the row."""

    def packed(self, hidden_states, *args, **kwargs):
        segments = kwargs.pop(SEGMENTS, None) or getattr(self, SEGMENTS, None)
        if segments is None or len(segments) == hidden_states.shape[0]:  # a sample a row
            return forward(self, hidden_states, *args, **kwargs)
        mask = kwargs.pop("attention_mask", None)

        def sample(row, start, end):
            part = mask[row : row + 1, start:end] if mask is not None and mask.dim() == 2 else None
            return forward(self, hidden_states[row : row + 1, start:end], *args, attention_mask=part, **kwargs)

        rows = [torch.cat([sample(row, start, end) for r, start, end in segments if r == row], dim=1) for row in range(hidden_states.shape[0])]
        return torch.cat(rows, dim=0)

    return packed
