"""Linear attention packed exactly: the Gated DeltaNet layers of Qwen3-Next and Qwen3.5 (dense and MoE) carry
a recurrent state and a short convolution along the row, which run on from one packed sample into the next.

transformers hands those layers whatever keyword arguments the model's forward was given, and calls its
convolution and delta rule through module-level functions (flash-linear-attention's and causal-conv1d's
kernels where installed, PyTorch fallbacks otherwise). finetune gives the decoder, for a packed row (position
ids that restart), the row's samples as `SEGMENTS`, and runs both functions on one sample at a time: each
sample starts from a zero state, as in a row of its own, whichever implementation is behind them. Rows that
hold one sample, and every forward with a cache (generation), take the functions untouched.

Not here: the vision-language forms of these families (their 3-row picture positions do not say where a
sample starts), Kimi Linear (its own delta attention), and the state-space layers (Mamba, Jamba, Bamba,
Zamba2, GraniteMoE-Hybrid, LFM2's short convolution): attention.mixer_outside_attention refuses them packed.
"""

from __future__ import annotations

import sys

import torch

# The model types whose linear attention runs through the two functions below (transformers 5.2x).
FAMILIES = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
CONVOLUTION, DELTA_RULE = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
SEGMENTS = "finetune_segments"  # the keyword the decoder passes on: [(row, start, end)] of every sample


def handles(module: torch.nn.Module) -> bool:
    """Whether `module` is a linear-attention layer whose functions are wrapped here (its convolution included)."""
    modeling = sys.modules.get(type(module).__module__)
    return modeling is not None and getattr(getattr(modeling, DELTA_RULE, None), "finetune_packed", False)


def register(model: torch.nn.Module) -> bool:
    """Wrap the family's convolution and delta rule (once per process) and have the decoder hand its layers the
    samples of packed rows. Returns whether `model` is packed this way."""
    modeling = _modeling(model) if model.config.model_type in FAMILIES else None
    if modeling is None:
        return False
    for name, wrap in ((CONVOLUTION, _per_sample_convolution), (DELTA_RULE, _per_sample_delta_rule)):
        function = getattr(modeling, name)
        if not getattr(function, "finetune_packed", False):
            wrapped = wrap(function)
            wrapped.finetune_packed = True
            setattr(modeling, name, wrapped)
    decoder = next(m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))
    if not getattr(decoder, "finetune_segments_hook", False):
        decoder.register_forward_pre_hook(_segments_of_packed_rows, with_kwargs=True)
        decoder.finetune_segments_hook = True
    return True


def _modeling(model: torch.nn.Module):
    """The transformers modeling module that defines the model's linear attention functions, or None."""
    for module in model.modules():
        modeling = sys.modules.get(type(module).__module__)
        if modeling is not None and hasattr(modeling, DELTA_RULE) and hasattr(modeling, CONVOLUTION) and hasattr(module, "conv1d"):
            return modeling
    return None


def _segments_of_packed_rows(module, args, kwargs):
    """The decoder's forward pre-hook: [(row, start, end)] of every sample where a row's positions restart (a packed
    row), passed on to the layers; nothing for rows of one sample each, or a forward with a cache."""
    positions = kwargs.get("position_ids")
    use_cache = kwargs.get("use_cache")
    if positions is None or kwargs.get("past_key_values") is not None or (use_cache if use_cache is not None else module.config.use_cache):
        return None
    if positions.dim() == 3:
        if positions.shape[0] != 4:  # (time, height, width) alone: where a sample starts is not said
            return None
        positions = positions[0]  # the 4-row form: text positions first
    rows = positions.tolist()  # a host sync, on these families only: the boundaries index the row
    segments = []
    for row, values in enumerate(rows):
        starts = [0] + [t for t in range(1, len(values)) if values[t] != values[t - 1] + 1]
        segments += [(row, start, end) for start, end in zip(starts, [*starts[1:], len(values)])]
    if len(segments) == len(rows):
        return None
    return args, {**kwargs, SEGMENTS: segments}


def _rows(segments: list[tuple[int, int, int]], run, rows: int, dim: int) -> torch.Tensor:
    """run(row, start, end) for each sample, joined along `dim` within each row, the rows stacked."""
    out = [torch.cat([run(row, start, end) for r, start, end in segments if r == row], dim=dim) for row in range(rows)]
    return torch.cat(out, dim=0)


def _per_sample_convolution(convolution):
    def packed(hidden_states, weight, bias=None, activation=None, **kwargs):
        segments = kwargs.pop(SEGMENTS, None)
        if segments is None:
            return convolution(hidden_states, weight, bias, activation=activation, **kwargs)
        return _rows(segments, lambda row, start, end: convolution(hidden_states[row : row + 1, :, start:end], weight, bias,
                                                                    activation=activation, **kwargs), hidden_states.shape[0], dim=2)

    return packed


def _per_sample_delta_rule(delta_rule):
    def packed(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
        segments = kwargs.pop(SEGMENTS, None)
        if segments is None or initial_state is not None or output_final_state:
            return delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state, **kwargs)
        kwargs.pop("cu_seqlens", None)

        def sample(row, start, end):
            part = (slice(row, row + 1), slice(start, end))
            return delta_rule(query[part], key[part], value[part], g=g[part], beta=beta[part], **kwargs)[0]

        return _rows(segments, sample, query.shape[0], dim=1), None

    return packed
