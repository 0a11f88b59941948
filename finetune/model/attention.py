"""Attention over packed rows at the cost of the samples in them, not of the whole row.

A packed row holds several samples whose `position_ids` restart at 0. Plain sdpa attends over the
whole row with a block-diagonal mask: every query meets every key of the row (L² work), and a mask
keeps the CPU kernels off their causal fast path. Here each sample runs as its own causal sdpa call,
Σ len² / 2 work, the way flash-attention's varlen kernels treat packed rows on GPUs.

On CPU, samples up to SHORT_SAMPLE tokens take `causal_attention` instead of torch's CPU flash
kernel, whose backward ran at ~25 GFLOP/s on ~200-token samples on an AMD EPYC: batched matmuls at the bf16
matmul rate around an fp32 softmax, 1.6x faster fwd+bwd on such samples, for heads x len² fp32
probabilities saved per sample (the reason for the length cap). On an Intel Xeon with AMX torch's kernel is the
faster one (`short_sample`).

Sliding-window layers (Mistral, Qwen2, Phi-3, Gemma 2/3) pass `sliding_window`: each query then sees
itself and the `sliding_window - 1` keys before it, as transformers' masks define it. Logit soft-capping
(Gemma 2) is not done here: `model.load_model` runs such models with eager attention instead.

On CUDA, per-sample calls made a 1.1B step host-bound (docs/platform-notes.md), so a layer makes one
call there: torch's flash-attention varlen kernel (`torch.nn.attention.varlen`) in bf16/fp16, otherwise
transformers' own sdpa over the block-diagonal mask it builds from the restarting position_ids.

Registered with transformers' AttentionInterface under PACKED_SDPA; models whose attention goes
through that interface load with it when the config asks for sdpa. It splits rows in training (also
when gradient checkpointing recomputes a layer in the backward) and in eval forwards over packed rows,
which run inside `packed_rows()`; any other forward (generation with a KV cache or padding) is plain
sdpa over the mask transformers builds.

Qwen-VL takes its 3-D rotary positions (time, height, width of a picture's tokens) with the restarting
text positions above them, the 4-row form its forward reads packed rows from (`packed_positions`).

Not every architecture keeps packed samples apart: some build their masks from an attention mask alone
(ALiBi, learned positions), some never route attention through the interface (`leak` measures both on
the loaded model itself), and SSM, linear-attention and short-convolution layers carry a state along
the row whatever the masks say (model/mixers finds them).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading

import torch
import torch.nn.functional as F

PACKED_SDPA = "sdpa_packed"
PACKED_SINKS = "packed_sinks"  # the same, for attention with sinks (register)
SHORT_SAMPLE = 1024  # tokens: above it the saved probabilities outweigh the speed (and torch's kernel does better)


def _has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


# Intel Xeons with AMX (bench/results/attention.md): torch's sdpa took 0.27-0.60 of finetune's kernel's time in fp32 at
# every length measured, and less in bf16 past ~256 tokens; on the AMD EPYC that SHORT_SAMPLE was measured on, finetune's
# kernel was the faster. Other CPUs keep it. FINETUNE_CPU_ATTENTION=finetune or sdpa chooses (tests/conftest.py: finetune,
# so that the suite computes alike on every CPU, its launched processes included).
_CHOSEN = os.environ.get("FINETUNE_CPU_ATTENTION", "auto")
SDPA_FIRST = _CHOSEN == "sdpa" or (_CHOSEN == "auto" and _has_amx())


def short_sample(dtype: torch.dtype, head_dim: int, scale: float) -> int:
    """The longest sample finetune's kernel takes on this CPU (longer ones: torch's sdpa), for heads of `head_dim` computed
    in `dtype`, their scores scaled by `scale`. Heads scaled otherwise than by 1/sqrt(head_dim) keep finetune's kernel
    (Gemma 4's q/k-normed heads, scale 1: torch's fp32 CPU flash drifts there, docs/platform-notes.md)."""
    if not SDPA_FIRST or abs(scale * head_dim**0.5 - 1) > 1e-6:
        return SHORT_SAMPLE
    return min(SHORT_SAMPLE, 256 if dtype in (torch.bfloat16, torch.float16) else 0)


# Per thread (the async rollouts sample in a thread of their own while the step trains): `last` (position_ids, its version,
# its bounds), as every layer of a forward sees the same position_ids; `packed`: inside packed_rows().
_state = threading.local()


def accelerator_path(tensor: torch.Tensor) -> bool:
    """Whether a computation on `tensor` takes the GPU branch: one varlen call a layer, large loss chunks.
    (tests/conftest.py's gpu_branch_on_cpu and bench/host.py replace it, here and in finetune.objectives.loss, to run that
    branch's Python on CPU tensors.)"""
    return tensor.is_cuda


@contextlib.contextmanager
def packed_rows():
    """An eval forward over packed rows: attention follows the restarting position_ids, as in training,
    whatever mask the model built. Outside it, generation keeps plain sdpa over its padding mask."""
    before, _state.packed = in_packed_rows(), True
    try:
        yield
    finally:
        _state.packed = before


def in_packed_rows() -> bool:
    """Whether this thread is inside packed_rows()."""
    return getattr(_state, "packed", False)


def sample_bounds(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row, the offsets where a sample starts (its positions restart: at 0, or at p > 0 for a sample that shares
    a prompt, see sample_prefixes), plus the row length at the end. Training batches carry them from the host
    (`with_bounds`); any other device tensor costs a host sync per forward."""
    return _segments(position_ids)[0]


def sample_prefixes(position_ids: torch.Tensor) -> list[dict[int, tuple[int, int]]]:
    """Per row, {a sample's start: (its prefix's start, length)} for each sample whose positions begin at p > 0 after one
    that began at 0: it reads that sample's first p tokens as its own first p (GRPO's group rows, the prompt written
    once for all its completions: grpo.group_row). Empty for rows of samples that each begin at 0."""
    return _segments(position_ids)[1]


def restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """True where a sample starts: each row's first token, and every position that does not follow the one before."""
    restart = torch.ones_like(position_ids, dtype=torch.bool)
    restart[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return restart


def _segments(position_ids: torch.Tensor) -> tuple[list[list[int]], list[dict[int, tuple[int, int]]]]:
    known = getattr(position_ids, "sample_bounds", None)
    if known is not None:
        return known, getattr(position_ids, "sample_prefixes", [{} for _ in known])
    last = getattr(_state, "last", None)
    if last is not None and last[0] is position_ids and last[1] == position_ids._version:
        return last[2]
    length = position_ids.shape[-1]
    rows, cols = restarts(position_ids).nonzero(as_tuple=True)
    firsts = position_ids[rows, cols]
    bounds: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
    prefixes: list[dict[int, tuple[int, int]]] = [{} for _ in bounds]
    prompt = {}  # row -> the start of its last sample that began at 0
    for row, col, first in zip(rows.tolist(), cols.tolist(), firsts.tolist()):
        bounds[row].append(col)
        if first == 0:
            prompt[row] = col
        elif row in prompt and col > 0:
            prefixes[row][col] = (prompt[row], first)
    result = ([b + [length] for b in bounds], prefixes)
    _state.last = (position_ids, position_ids._version, result)
    return result


SEGMENTS = "finetune_segments"  # the keyword a model hands its layers: [(row, start, end)] of every sample of its rows (model/mixers)


def segment_positions(segments: list[tuple[int, int, int]], like: torch.Tensor) -> torch.Tensor:
    """The position ids of the rows `segments` describes, their sample bounds attached (no host sync), on `like`'s device:
    for attention layers a model hands no position ids. Made once a forward: every layer is handed the same list."""
    made = getattr(_state, "segment_positions", None)
    if made is not None and made[0] is segments:
        return made[1]
    rows = max(row for row, _, _ in segments) + 1
    values = [[p for r, start, end in segments if r == row for p in range(end - start)] for row in range(rows)]
    tensor = torch.tensor(values, device=like.device)
    tensor.sample_bounds = [[start for r, start, _ in segments if r == row] + [len(values[row])] for row in range(rows)]
    _state.segment_positions = (segments, tensor)
    return tensor


def base_model(model):
    """The transformers model inside DDP, DeepSpeed and peft wrappers."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def packed_positions(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Packed rows' position_ids as the model takes them. Qwen-VL's 3-D rotary positions (time, height, width: its own
    get_rope_index over each row) made each sample's own by taking off its first token's, below the restarting text
    positions its attention keeps the samples apart by: the 4-row form its forward takes for packed rows."""
    text = batch["position_ids"]
    rope_index = getattr(getattr(base_model(model), "model", None), "get_rope_index", None)
    if rope_index is None:
        return text
    if "image_grid_thw" in batch:
        rope, _ = rope_index(batch["input_ids"], batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"])
    else:
        rope = text[None].expand(3, -1, -1)
    columns = torch.arange(text.shape[-1], device=text.device).expand_as(text)
    first = torch.where(text == 0, columns, 0).cummax(-1).values  # each token's sample's first column
    return torch.cat([text[None], rope - rope.gather(2, first[None].expand(3, -1, -1))])


def attention_of(model) -> str | None:
    return getattr(base_model(model).config, "_attn_implementation", None)


def mask_placeholder(device: torch.device | str) -> torch.Tensor:
    """An attention_mask for forwards over packed rows with this attention: transformers takes a 4-D mask
    as built and builds none (its test for packed rows costs a host sync per forward, and the block
    mask L² work) while packed_sdpa_forward works from the sample bounds, or builds the mask itself."""
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
    placeholder.finetune_placeholder = True
    return placeholder


def _block_mask(position_ids: torch.Tensor, bounds: list[list[int]], window: int | None, sink: torch.dtype | None = None) -> torch.Tensor:
    """(B, 1, L, L), True where a query may see a key: the same sample, causal, within the window (transformers' packed mask).
    sink: sdpa's additive form in that dtype instead, (B, 1, L, 1 + L), with a first key every query sees (_with_sink_key's).
    Made once a forward: every layer shares it."""
    key = ("finetune_block_mask", window, sink)
    cached = getattr(position_ids, "finetune_masks", {})
    if key not in cached:
        length, device = position_ids.shape[-1], position_ids.device
        sample = torch.tensor([[i for i, (s, e) in enumerate(zip(row, row[1:])) for _ in range(e - s)] for row in bounds]).to(device)
        mask = (sample[:, :, None] == sample[:, None, :]) & _allowed(length, window, device)
        prefixes = sample_prefixes(position_ids)
        if any(prefixes):  # a sample that shares a prefix also sees it: each query its prefix's columns, within the window by position
            edges = [[prefix.get(s, (0, 0)) for s, e in zip(row, row[1:]) for _ in range(e - s)] for row, prefix in zip(bounds, prefixes)]
            first, count = torch.tensor(edges, device=device).unbind(-1)
            columns = torch.arange(length, device=device)
            seen = (columns >= first[:, :, None]) & (columns < (first + count)[:, :, None])
            if window is not None:
                seen &= (position_ids[:, :, None] - position_ids[:, None, :]) < window
            mask |= seen
        mask = mask[:, None]
        if sink is not None:
            mask = _additive(F.pad(mask, (1, 0), value=True), sink)
        cached[key] = mask
        position_ids.finetune_masks = cached
    return cached[key]


def with_bounds(position_ids: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`position_ids` (on the device) with the sample bounds and prefixes of its host copy attached, computed there."""
    position_ids.sample_bounds, position_ids.sample_prefixes = _segments(host)
    return position_ids


def _chunk(module) -> int | None:
    """The chunk a layer's tokens attend within (Llama 4's chunked layers: attention_chunk_size positions), or None."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None) or []
    return config.attention_chunk_size if layer is not None and layer < len(kinds) and kinds[layer] == "chunked_attention" else None


def row_places(config, row_tokens: int) -> str:
    """Why packed rows of `row_tokens` would train otherwise than their samples alone in a model that reads a token's place
    in the row, not in its sample ("" where none does): Llama 4 scales the queries of its layers without rotary positions
    by a temperature of the place in the row, 1 for the first floor_scale - 1 tokens."""
    text = config.get_text_config()
    if getattr(text, "attn_temperature_tuning", False) and not all(getattr(text, "no_rope_layers", None) or [1]) and row_tokens >= text.floor_scale:
        return (f"{config.model_type} scales the queries of its layers without rotary positions by their place in the row from token "
                f"{text.floor_scale} on (floor_scale), not in their sample; rows of {row_tokens} tokens reach it (data.max_seq_len below "
                f"{text.floor_scale} packs it)")
    return ""


@torch.compiler.disable  # its loop follows where samples start (a host sync): under model.compile it runs eagerly between graphs
def packed_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """query (B, H, L, D), key/value (B, H_kv, L, D) -> (B, L, H, D), as transformers' sdpa returns."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None:  # load_model picks eager attention for these models; reaching here would be silently wrong
        raise NotImplementedError(f"{PACKED_SDPA} does not implement softcap; load this model with eager attention")
    sinks = kwargs.pop("s_aux", None)  # gpt-oss: a learned logit per head that every query's softmax also spreads over
    position_ids = kwargs.get("position_ids")
    if position_ids is None and kwargs.get(SEGMENTS) is not None:  # a layer handed no position ids (GPT-BigCode, GraniteMoE-Hybrid)
        position_ids = segment_positions(kwargs[SEGMENTS], query)
    whole_row = getattr(position_ids, "sequence_parallel", None)
    if whole_row is not None:  # this process holds a slice of each row: attention over the whole row, through Ulysses
        return whole_row.route(packed_sdpa_forward, module, query, key, value, attention_mask, whole_row, dropout=dropout, scaling=scaling, **kwargs)
    placeholder = getattr(attention_mask, "finetune_placeholder", False)
    if not (module.training or in_packed_rows()) or position_ids is None or query.shape[2] != key.shape[2] or position_ids.dim() != 2:
        if placeholder:
            raise RuntimeError(f"{PACKED_SDPA}: a packed-row forward without its position_ids (mask_placeholder needs them)")
        if sinks is not None:  # sdpa has no sinks: the model's own eager attention (generation, unpacked eval)
            own = sys.modules[type(module).__module__].eager_attention_forward
            return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    window = kwargs.get("sliding_window")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if position_ids.shape[0] != query.shape[0]:
        position_ids = position_ids.expand(query.shape[0], -1)
    chunk = _chunk(module)
    if chunk and position_ids.shape[-1] > chunk:  # Llama 4's chunked layers: each chunk of a sample's positions attends as a
        position_ids = position_ids % chunk  # sample of its own (a new tensor: its bounds found again, a host sync on a GPU)
    if sinks is not None:
        if dropout:
            raise NotImplementedError(f"{PACKED_SDPA}: attention dropout with sinks")
        return _attention_with_sinks(query, key, value, position_ids, scale, window, sinks), None
    prefixes = sample_prefixes(position_ids)
    if accelerator_path(query):
        dtype = _varlen_dtype(query, value, dropout)
        # Shared prompts (sample_prefixes) take the block mask: how torch's varlen kernel aligns a sample's causal mask
        # when it reads more keys than it has queries is not yet checked on a GPU.
        if dtype is None or any(prefixes):
            if placeholder or any(prefixes):
                attention_mask = _block_mask(position_ids, sample_bounds(position_ids), window)
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return varlen_attention(query, key, value, sample_bounds(position_ids), scale, dtype, window), None
    bounds = sample_bounds(position_ids)
    spans = [(b, s, e, *prefixes[b].get(s, ())) for b, row in enumerate(bounds) for s, e in zip(row, row[1:])]
    ours = query.device.type == "cpu" and dropout == 0.0
    limit = short_sample(compute_dtype(query), query.shape[-1], scale)
    short, long = [], []
    for span in spans:
        (short if ours and span[2] - span[1] <= limit else long).append(span)
    # Values narrower than the keys (DeepSeek's latent attention) padded with zeros for torch's kernel: its flash kernel takes
    # equal widths only (else its math kernel runs), and the zero columns add nothing to the kept ones.
    width, padded = value.shape[-1], value
    if long and width < query.shape[-1]:
        padded = F.pad(value, (0, query.shape[-1] - width))
    if not short and not any(prefixes):
        return _split_sdpa(query, key, padded, bounds, window, scale, dropout, gqa)[..., :width], None
    # Each sample's output goes straight to its place in the (B, L, H, D) result: no concatenation
    # and transposed copy of the whole output per layer.
    if short:
        out = causal_attention(query, key, value, short, scale, window)
    else:
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], width, dtype=compute_dtype(query))
    for span in long:
        b, s, e = span[:3]
        read = _read(span)  # a shared prefix's keys first (sample_prefixes): the queries are the causal mask's last rows
        keys, values = (_read_rows(x, span)[None] for x in (key, padded))
        banded = read > e - s or (window is not None and window < e - s)
        mask = _allowed(read, window, query.device)[read - (e - s) :] if banded else None
        out[b, s:e] = F.scaled_dot_product_attention(query[b : b + 1, :, s:e], keys, values, attn_mask=mask, dropout_p=dropout, is_causal=not banded,
                                                     scale=scale, enable_gqa=gqa)[0, ..., :width].transpose(0, 1)
    return out, None


def _split_sdpa(query, key, value, bounds: list[list[int]], window: int | None, scale: float, dropout: float, gqa: bool) -> torch.Tensor:
    """torch's sdpa per sample, the samples of a row taken by one split and put back by one concatenation.

    Slicing each sample out instead costs a zero-filled gradient of the whole (B, H, L, D) tensor per
    sample and slice in backward, and writing each output into place a copy per sample."""
    rows = []
    for b, edges in enumerate(bounds):
        lengths = [e - s for s, e in zip(edges, edges[1:])]
        outs = []
        for q, k, v in zip(query[b].split(lengths, 1), key[b].split(lengths, 1), value[b].split(lengths, 1)):
            banded = window is not None and window < q.shape[1]
            mask = _allowed(q.shape[1], window, q.device) if banded else None
            outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, dropout_p=dropout, is_causal=not banded,
                                                       scale=scale, enable_gqa=gqa)[0])
        rows.append(torch.cat(outs, 1).transpose(0, 1))
    return torch.stack(rows)


def _attention_with_sinks(query, key, value, position_ids: torch.Tensor, scale: float, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's attention over packed rows: on a CPU, samples up to short_sample() tokens through finetune's kernel (which
    takes sinks, keeping its probabilities), longer ones through torch's sdpa one at a time; on an accelerator each row in
    one sdpa call over its block mask (the flash kernels' varlen calls cannot keep the sink in a sliding window's view)."""
    bounds, dtype = sample_bounds(position_ids), compute_dtype(query)
    if any(sample_prefixes(position_ids)):
        raise NotImplementedError(f"{PACKED_SINKS}: samples sharing a prefix (grpo.group_row writes them only where attention has no sinks)")
    if accelerator_path(query):
        return _with_sink_key(query, key, value, _block_mask(position_ids, bounds, window, sink=dtype), scale, sinks)
    spans, limit = [(b, s, e) for b, row in enumerate(bounds) for s, e in zip(row, row[1:])], short_sample(dtype, query.shape[-1], scale)
    short = [span for span in spans if span[2] - span[1] <= limit]
    long = [span for span in spans if span[2] - span[1] > limit]
    if short:
        out = causal_attention(query, key, value, short, scale, window, sinks)
    else:  # sdpa's results written in place: no empty call of finetune's kernel, whose backward makes zero gradients
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=dtype)
    masks = getattr(position_ids, "finetune_masks", {})  # made once a forward (every layer shares them), not kept past it
    for b, s, e in long:
        made = ("finetune_sink_mask", e - s, window, dtype)
        mask = masks[made] = masks[made] if made in masks else _sink_mask(e - s, window, dtype, query.device)
        out[b, s:e] = _with_sink_key(query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e], mask, scale, sinks)[0]
    position_ids.finetune_masks = masks
    return out


def _sink_mask(length: int, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """sdpa's additive mask for one sample with _with_sink_key's sink key first: (length, 1 + length)."""
    return _additive(_allowed(length, window, device, sink=True), dtype)


def sink_width(dim: int) -> int:
    """_with_sink_key's head width: the head's columns and the sink's, padded to a multiple of 8 (the fused kernels' rule)."""
    return -(-(dim + 1) // 8) * 8


def _with_sink_key(query, key, value, allowed: torch.Tensor, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per query head through torch's sdpa, which has no sinks: a key put before the others,
    with no value behind it, whose score is that logit for every query. Each head dimension gains one column: the query's
    holds its head's sink, the sink key's 1/scale, every other key's 0; so the sink key's score is the sink, the others'
    unchanged, and the sink's gradient is its query column's. The sink key is the same for every key/value head, so
    grouped-query heads stay grouped. Padded to a multiple of 8 columns (the fused kernels' rule); `allowed` (…, L, 1 + L):
    sdpa's additive mask, 0 where a query may look (the sink's column) and -inf elsewhere.
    query (B, H, L, D), key/value (B, H_kv, L, D) -> (B, L, H, D); exact to fp32 rounding against eager attention's sinks."""
    batch, heads, length, dim = query.shape
    width = sink_width(dim)
    # Each widened tensor made once and filled in place (autograd copies the gradient slices back): no chain of copies.
    wide_query = query.new_zeros(batch, heads, length, width)
    wide_query[..., :dim] = query
    wide_query[..., dim] = sinks.to(query.dtype).view(1, heads, 1)
    wide_key, wide_value = (x.new_zeros(batch, x.shape[1], 1 + length, width) for x in (key, value))
    wide_key[:, :, 0, dim] = 1 / scale
    wide_key[:, :, 1:, :dim] = key
    wide_value[:, :, 1:, : value.shape[-1]] = value
    out = F.scaled_dot_product_attention(wide_query, wide_key, wide_value, attn_mask=allowed, scale=scale, enable_gqa=key.shape[1] != heads)
    return out[..., : value.shape[-1]].transpose(1, 2)


def _varlen_dtype(query: torch.Tensor, value: torch.Tensor, dropout: float) -> torch.dtype | None:
    """The dtype torch's varlen kernel would compute in (sdpa's: autocast's if on), or None where it cannot
    run: torch without `varlen_attn(window_size=...)` (before 2.11), fp32, dropout, or head sizes
    flash-attention does not take (over 256, not a multiple of 8, or value heads of another size: MLA's)."""
    dtype = compute_dtype(query)
    if dropout or dtype not in (torch.float16, torch.bfloat16) or query.shape[-1] > 256 or query.shape[-1] % 8 or _varlen() is None \
            or value.shape[-1] != query.shape[-1]:
        return None
    return dtype


@functools.cache
def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[list[int]], scale: float,
                     dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """All samples of a packed batch in one call of torch's flash-attention varlen kernel (CUDA, bf16/fp16):
    query (B, H, L, D), key/value (B, H_kv, L, D) -> (B, L, H, D); `bounds` as sample_bounds gives them.

    The rows are laid end to end as one (B*L, H, D) sequence cut at every sample start, each sample
    causal; a window keeps a query to itself and the `window - 1` keys before it (transformers' masks)."""
    varlen_attn = _varlen()
    batch, heads, length, dim = query.shape
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[-1]).to(dtype) for x in (query, key, value))
    extra = {}
    if k.shape[1] != heads:
        if "enable_gqa" in inspect.signature(varlen_attn).parameters:
            extra["enable_gqa"] = True
        else:  # torch 2.11 takes as many key/value heads as query heads
            k, v = (x.repeat_interleave(heads // x.shape[1], 1) for x in (k, v))
    starts = [b * length + s for b, edges in enumerate(bounds) for s in edges[:-1]] + [batch * length]
    longest = max(e - s for s, e in zip(starts, starts[1:]))
    cu = torch.tensor(starts, dtype=torch.int32).to(query.device, non_blocking=True)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1 if window is None else window - 1, 0), **extra)
    return out.view(batch, length, heads, value.shape[-1])


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[tuple[int, int, int]], scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale + causal mask) v for each sample (row, start, end) of a packed batch:
    query (B, H, L, D), key/value (B, H_kv, L, D) -> (B, L, H, D), zero outside the spans.
    window: a query sees only the `window` most recent keys (itself included), as in sliding-window layers.
    sinks (H,): a logit per head in every query's softmax with no value behind it (gpt-oss), as its eager attention.

    Computes in the dtype sdpa would (autocast's, if on), the softmax in fp32."""
    device, dtype = query.device.type, compute_dtype(query)
    with torch.autocast(device, enabled=False):
        return _CausalAttention.apply(query, key, value, spans, scale, dtype, window, sinks)


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype `tensor` is computed in where autocast may be on (sdpa, finetune's kernel, the experts' grouped LoRA): autocast's, if on."""
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sdpa's additive form of a mask: 0 where `allowed`, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _allowed(length: int, window: int | None, device: torch.device, sink: bool = False) -> torch.Tensor:
    """True where query i may see key j: j <= i, and i - j < window when there is a window. sink: a first column of
    True before the keys (_with_sink_key's sink key), (length, 1 + length)."""
    first = int(sink)  # the keys' first column
    ones = torch.ones(length, length + first, dtype=torch.bool, device=device)
    allowed = ones.tril(first) if window is None else ones.tril(first) & ~ones.tril(first - window)
    if sink:
        allowed[:, 0] = True
    return allowed


_masks: dict[tuple, torch.Tensor] = {}


def _causal_mask(length: int, dtype: torch.dtype, device: torch.device, window: int | None) -> torch.Tensor:
    """-inf where a query may not look: a view into one mask per dtype, device and window, as long as the
    longest sample yet (a band's top-left corner is the band of a shorter sample)."""
    # Fake tensors (finetune plan --simulate) keep masks of their mode's own: a fake one must never stand in
    # for a real mask in the process's next real forward.
    key = (dtype, device, window, torch._guards.detect_fake_mode())
    mask = _masks.get(key)  # read once: another thread may put a longer one in its place meanwhile
    if mask is None or mask.shape[0] < length:
        mask = _masks[key] = _additive(_allowed(length, window, device), dtype)
    return mask[:length, :length]


# Probabilities (fp32) a call keeps for its backward at most; past it (gpt-oss's sink attention on long samples: 64
# heads x 4,096² are 4.3 GB a layer) the backward computes them again, a few heads at a time.
KEPT_PROBS = 1 << 28


class _CausalAttention(torch.autograd.Function):
    """Textbook attention's numerics (transformers' eager): matmuls in the input dtype, softmax and its
    backward in fp32 from fp32 probabilities. Not flash-attention's rowsum(dO ∘ O) shortcut: with
    bf16 O and dP, where a row puts nearly all its weight on one key (an attention sink, common in
    trained models) that sum and dP round apart and their difference is all error; it made the demo's
    gradient norm spike 20x and its run stop.

    One function for all samples of the batch, not one per sample: autograd would otherwise hand each
    sample's gradient back as a zero-filled tensor the size of the whole batch, and add them all up.

    Short samples keep their probabilities for the backward (the faster path on a CPU). Where they would pass
    KEPT_PROBS, none are kept: forward and backward compute them a few heads at a time (whole groups of a key/value
    head, KEPT_PROBS a chunk), the backward again from q and k, to the same values, as flash-attention recomputes."""

    @staticmethod
    def forward(ctx, query, key, value, spans, scale, dtype, window, sinks):
        batch, heads, length, _ = query.shape
        out = query.new_zeros(batch, length, heads, value.shape[-1], dtype=dtype)  # MLA's value heads are narrower than its query's
        groups = heads // key.shape[1]
        kept = sum(heads * (span[2] - span[1]) * (_read(span) + 1) * 4 for span in spans) <= KEPT_PROBS
        probs = []
        for span in spans:
            (b, s, e), read = span[:3], _read(span)
            q, k, v = _sample(query, key, value, span, dtype)
            for h in [slice(0, heads)] if kept else _head_chunks(heads, groups, e - s, read):
                p = _probs(q[h], k[h], e - s, scale, dtype, window, None if sinks is None else sinks[h])
                out[b, s:e, h] = torch.bmm(p[..., :read].to(dtype), v[h]).transpose(0, 1)
                if kept:
                    probs.append(p)
        ctx.save_for_backward(query, key, value, *probs)
        ctx.spans, ctx.scale, ctx.dtype, ctx.window, ctx.sinks = spans, scale, dtype, window, sinks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, *probs = ctx.saved_tensors
        heads, groups = query.shape[1], query.shape[1] // key.shape[1]
        grad_query, grad_key, grad_value = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        grad_sinks = None if ctx.sinks is None else torch.zeros(ctx.sinks.shape, dtype=torch.float32, device=ctx.sinks.device)
        for i, span in enumerate(ctx.spans):
            (b, s, e), read = span[:3], _read(span)
            q, k, v = _sample(query, key, value, span, ctx.dtype)
            whole = grad_out[b, s:e].transpose(0, 1)
            for h in [slice(0, heads)] if probs else _head_chunks(heads, groups, e - s, read):
                p = probs[i] if probs else _probs(q[h], k[h], e - s, ctx.scale, ctx.dtype, ctx.window, None if ctx.sinks is None else ctx.sinks[h])
                g = whole[h]
                # The input-dtype probabilities are cast again, not saved: one len² tensor per sample, not two.
                grad_v = torch.bmm(p[..., :read].to(ctx.dtype).transpose(1, 2), g)
                grad_probs = torch.bmm(g, v[h].transpose(1, 2)).float()
                if grad_sinks is not None:  # the sink's column has no value: no gradient flows into it from the output
                    grad_probs = torch.nn.functional.pad(grad_probs, (0, 1))
                grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, p, -1, torch.float32)
                if grad_sinks is not None:
                    grad_sinks[h] += grad_scores[..., -1].sum(-1)
                    grad_scores = grad_scores[..., :-1]
                grad_scores = grad_scores.to(ctx.dtype)
                grad_query[b, h, s:e] = torch.bmm(grad_scores, k[h]).mul_(ctx.scale)
                grad_k = torch.bmm(grad_scores.transpose(1, 2), q[h]).mul_(ctx.scale)
                # The heads that shared a key/value head add up in the inputs' dtype (fp32 under autocast
                # with fp32 weights), as autograd would sum them after the cast back.
                grad_k, grad_v = grad_k.to(key.dtype), grad_v.to(value.dtype)
                if groups > 1:
                    grad_k, grad_v = (x.unflatten(0, (-1, groups)).sum(1) for x in (grad_k, grad_v))
                shared = slice(h.start // groups, h.stop // groups)
                if len(span) > 3:  # the prefix's keys and values, read by every sample of its group: their gradients add up
                    first, prefix = span[3], span[4]
                    grad_key[b, shared, first : first + prefix] += grad_k[:, :prefix]
                    grad_value[b, shared, first : first + prefix] += grad_v[:, :prefix]
                    grad_k, grad_v = grad_k[:, prefix:], grad_v[:, prefix:]
                grad_key[b, shared, s:e] += grad_k
                grad_value[b, shared, s:e] += grad_v
        return grad_query, grad_key, grad_value, None, None, None, None, None if grad_sinks is None else grad_sinks.to(ctx.sinks.dtype)


def _probs(q: torch.Tensor, k: torch.Tensor, length: int, scale: float, dtype: torch.dtype, window: int | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ · scale + the causal mask) in fp32, with each head's sink as a last column where there are sinks."""
    read = k.shape[1]  # a sample that shares a prefix reads it first: its queries are the last rows of the causal mask
    scores = torch.baddbmm(_causal_mask(read, dtype, q.device, window)[read - length :], q, k.transpose(1, 2), alpha=scale)
    if sinks is not None:  # the sink's column, kept in the probabilities: its share of each row is what the keys lose
        scores = torch.cat([scores, sinks.to(dtype).view(-1, 1, 1).expand(-1, length, 1)], dim=-1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32)


def _head_chunks(heads: int, groups: int, length: int, read: int | None = None) -> list[slice]:
    """Slices of the query heads, each whole groups of a key/value head, whose probabilities (length queries x `read`
    keys, length if not given) fit KEPT_PROBS."""
    step = groups * max(1, KEPT_PROBS // (groups * length * ((read or length) + 1) * 4))
    return [slice(h, min(h + step, heads)) for h in range(0, heads, step)]


def _read(span: tuple[int, ...]) -> int:
    """The keys a sample (row, start, end[, prefix start, prefix length]) reads: its prefix's and its own."""
    return span[2] - span[1] + (span[4] if len(span) > 3 else 0)


def _read_rows(x: torch.Tensor, span: tuple[int, ...]) -> torch.Tensor:
    """The keys (or values) of x (B, H, L, D) a sample reads, (H, _read(span), D): its prefix's first where it shares one
    (sample_prefixes), then its own."""
    b, s, e = span[:3]
    if len(span) == 3:
        return x[b, :, s:e]
    return torch.cat([x[b, :, span[3] : span[3] + span[4]], x[b, :, s:e]], 1)


def _sample(query, key, value, span: tuple[int, ...], dtype: torch.dtype):
    """One sample's q, and the k, v it reads (_read_rows), in the compute dtype; grouped-query keys and values repeated
    per query head."""
    b, s, e = span[:3]
    q, k, v = query[b, :, s:e], _read_rows(key, span), _read_rows(value, span)
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# A packed sample's logits may move by rounding (bf16 kernels over rows of other lengths), a small
# share of what the sample before it would move them as context; samples that see each other move them
# most of the way.
LEAK_TOLERANCE = 0.05


@torch.no_grad()
def leak(model, vocab_size: int, device: torch.device | str) -> float:
    """How far a packed sample's logits move towards having the sample before it as context: 0 where
    the model keeps packed samples apart, near 1 where they see each other (nan: context changes nothing).

    A sample of 8 tokens is run alone, after 12 others in a packed row (positions restarting), and after
    them as plain context; the first is its difference from alone, measured in units of the last. Run on
    every process at once (a sharded model gathers its weights in each forward), in eval mode: no dropout.
    `model` may be wrapped (DDP, FSDP, a DeepSpeed engine): it is only called."""
    generator = torch.Generator().manual_seed(0)
    before, sample = (torch.randint(0, vocab_size, (n,), generator=generator) for n in (12, 8))
    runs = {"alone": (sample, torch.arange(8)),
            "packed": (torch.cat([before, sample]), torch.cat([torch.arange(12), torch.arange(8)])),
            "context": (torch.cat([before, sample]), torch.arange(20))}
    was_training = model.training
    model.eval()
    logits = {}
    try:
        # As training runs it: with finetune's attention, transformers is handed no mask to build (mask_placeholder).
        mask = {"attention_mask": mask_placeholder(device)} if attention_of(model) == PACKED_SDPA else {}
        with packed_rows():
            for name, (ids, positions) in runs.items():
                row = {"input_ids": ids[None].to(device), "position_ids": positions[None].to(device)}
                out = model(input_ids=row["input_ids"], position_ids=packed_positions(model, row), use_cache=False, **mask)
                logits[name] = out.logits[0, -8:].float()
    finally:
        model.train(was_training)
    moved, context = ((logits[name] - logits["alone"]).abs().max().item() for name in ("packed", "context"))
    return moved / context if context > 0 else float("nan")


def register(sinks: bool = False) -> str:
    """Make PACKED_SDPA a name transformers accepts for attn_implementation (idempotent). sinks: PACKED_SINKS
    instead, for a model transformers gives no sdpa (gpt-oss): the same packed attention under a name without
    "sdpa" in it (transformers refuses those for such models), with eager's additive masks for the rows it
    hands to the model's own eager attention (generation, unpacked eval)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    name = PACKED_SINKS if sinks else PACKED_SDPA
    AttentionInterface.register(name, packed_sdpa_forward)
    AttentionMaskInterface.register(name, eager_mask if sinks else sdpa_mask)
    return name
