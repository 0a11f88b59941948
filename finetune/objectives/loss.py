"""The training loss: summed cross-entropy over the trained tokens only.

Two savings over `model(...).logits` + cross-entropy, both exact:
- logits are computed only where a label is trained (transformers' `logits_to_keep` mask): with the
  prompt masked, as in instruction tuning, that skips a large share of the lm_head work;
- where the lm_head is a plain linear layer of a known architecture and the model is not sharded,
  `linear_cross_entropy` takes the loss and its gradients a chunk of tokens at a time, so the
  (tokens x vocab) logits never exist in full, in fp32 or at all after the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.data.images import MODEL_INPUTS
from finetune.data.rows import IGNORE
from finetune.model import families
from finetune.model.attention import PACKED_SDPA, accelerator_path, attention_of, base_model, mask_placeholder, packed_positions, packed_rows, with_bounds

# Logits held at once: 16 MiB in fp32 on CPU. Each chunk reads the whole head weight twice, so smaller
# chunks make the matmuls memory-bound (8 MiB ran the bench's steps ~6% slower); much larger ones leave
# the cache. A GPU takes 256 MiB (2,048 tokens of a 32k vocabulary): its chunks of 128 tokens were a
# dozen small kernel launches each, on a step that was already host-bound (docs/platform-notes.md).
CHUNK_ELEMENTS = 2**22
CHUNK_ELEMENTS_CUDA = 2**26


def picture_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a vision-language model's batch gives its forward besides the tokens (pixels, grids, token types)."""
    return {key: batch[key] for key in MODEL_INPUTS if key in batch}


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["keep"].sum() if "keep" in batch else (batch["labels"][:, 1:] != IGNORE).sum())


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A host micro-batch on `device`, with what the forward and the loss would otherwise learn from the
    device by a host sync each (GPU): the sample bounds, and which positions are trained ("trained_at", as
    flat indices) with their targets. A slice of a row (sequence_parallel.shard) also takes the whole
    row's position_ids to its attention."""
    keep, targets = next_token_targets(batch)
    extra = {"keep": keep, "trained_at": keep.flatten().nonzero().squeeze(1), "targets": targets}
    moved = {k: v.to(device, non_blocking=True) for k, v in {**batch, **extra}.items()}
    with_bounds(moved["position_ids"], batch["position_ids"])
    if "full_position_ids" in batch:
        whole = with_bounds(moved.pop("full_position_ids"), batch["full_position_ids"])
        whole.sequence_group, whole.route = batch["full_position_ids"].sequence_group, batch["full_position_ids"].route
        moved["position_ids"].sequence_parallel = whole
    return moved


def next_token_targets(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, targets): the positions whose next token is trained, and those tokens. A slice of a row
    carries them, taken from the whole row; otherwise they come from its labels."""
    if "keep" in batch:
        return batch["keep"], batch["targets"]
    keep = trained_mask(batch["labels"])
    return keep, batch["labels"][:, 1:][keep[:, :-1]]


def trained_mask(labels: torch.Tensor) -> torch.Tensor:
    """True at each position whose next token is trained: where its logits are needed."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE
    return keep


@dataclass
class Losses:
    tokens: torch.Tensor  # cross-entropy summed over the trained tokens
    router: torch.Tensor | None = None  # mixture-of-experts models: the router's load-balancing loss of this forward
    metrics: torch.Tensor | None = None  # an objective's metrics (finetune/objectives/objective.py), as sums over this micro-batch


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed cross-entropy over trained tokens. Logits at t predict the token at t+1."""
    return losses(model, batch).tokens


def losses(model, batch: dict[str, torch.Tensor], router: bool = False) -> Losses:
    """The cross-entropy sum and, with `router`, the MoE router's auxiliary loss (as the model computes
    it with output_router_logits; transformers adds it only when labels are passed, which we do not)."""
    kept = forward_kept(model, batch, router)
    if kept.weight is None:
        return Losses(F.cross_entropy(kept.logits.float(), kept.targets, reduction="sum"), kept.aux)
    return Losses(linear_cross_entropy(kept.hidden, kept.weight, kept.targets), kept.aux)


@dataclass
class Kept:
    """A forward's outputs at the positions whose next token is trained: the logits, or (fused) the decoder's
    hidden states with the head weight that makes them logits, in the forward's autocast dtype."""

    targets: torch.Tensor  # the trained next tokens
    aux: torch.Tensor | None = None  # the MoE router's loss, if asked
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None


def forward_kept(model, batch: dict[str, torch.Tensor], router: bool = False, fuse: bool = True) -> Kept:
    """The model's forward with what a loss needs at the trained positions only (`fuse`: the hidden states where
    the model allows it; else the logits).

    No attention_mask (but for a vision-language model's unpacked rows): the restarting position_ids say where
    samples (and padding) begin, to finetune's packed attention (train and eval alike) and to the masks transformers builds.
    """
    labels = batch["labels"]
    keep, targets = next_token_targets(batch)
    # A vision-language model's unpacked rows take its own attention mask (Qwen-VL then computes its 3-D positions);
    # packed rows (LLaVA's too) restarting positions.
    apart = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {"position_ids": packed_positions(model, batch)}
    inputs = {"input_ids": batch["input_ids"], **apart, "use_cache": False, **picture_inputs(batch)}
    if router:  # Mixtral-style load balancing reads a 2-D attention_mask if there is one: none then
        inputs["output_router_logits"] = True
    elif attention_of(model) == PACKED_SDPA:
        inputs["attention_mask"] = mask_placeholder(labels.device)
    parts = fusable_parts(model) if fuse else None
    captured = []

    def grab(_module, _args, out):
        # Inside the forward, where accelerate's autocast (if any) is on: the head would run in its dtype.
        device = out[0].device.type
        captured.append((out[0], torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None))

    # Fused: the decoder's output is taken by a hook and the lm_head sees one position a row (an integer
    # logits_to_keep: a mask would cost a host sync to index with).
    hook = parts[0].register_forward_hook(grab) if parts else None
    try:
        with packed_rows():
            out = model(**inputs, logits_to_keep=keep if parts is None else 1)
    finally:
        if hook is not None:
            hook.remove()
    aux = out.aux_loss if router else None
    if parts is None:
        return Kept(targets, aux, logits=out.logits)
    hidden, autocast_dtype = captured[0]
    hidden = hidden.flatten(0, 1).index_select(0, batch["trained_at"]) if "trained_at" in batch else hidden[keep]
    weight = parts[1].weight
    if autocast_dtype is not None:
        hidden, weight = hidden.to(autocast_dtype), weight.to(autocast_dtype)
    return Kept(targets, aux, hidden=hidden, weight=weight)


def fusable_parts(model) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) when the loss may bypass the model's logits; None to take the plain path."""
    base = base_model(model)
    if not hasattr(base, "get_decoder") or not families.plain_head(base.config.to_dict()):
        return None
    head = base.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if type(head) is not torch.nn.Linear or head.bias is not None or weight is None:
        return None  # an adapter on the head itself, or a head with more to it
    if hasattr(weight, "ds_id") or hasattr(weight, "_local_tensor"):
        return None  # DeepSpeed-partitioned or FSDP-sharded (a DTensor): the weight is whole only inside the forward
    return base.get_decoder(), head


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """sum(cross_entropy(hidden @ weight.T, targets)), computed in chunks of tokens.

    Same arithmetic as the plain path (logits in the weights' dtype, softmax in fp32), but the gradient
    is taken in the forward, chunk by chunk, and only d(hidden) (and d(weight) if it trains) is kept.
    """

    def cross_entropy(logits: torch.Tensor, rows: slice, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = targets[rows]
        # Widen first (the caller): log_softmax(bf16, dtype=float32) took a path 5x slower on CPU (torch 2.13).
        log_probs = torch.log_softmax(logits, dim=-1)
        total = -log_probs.gather(1, t[:, None]).sum()
        if not with_grad:
            return total[None], None
        probs = log_probs.exp_()  # d(loss)/d(logits) = softmax - one_hot, in the same memory
        probs[torch.arange(len(t), device=t.device), t] -= 1.0
        return total[None], probs

    return chunked_head(hidden, weight, cross_entropy)[0]


def chunk_rows(rows: torch.Tensor, vocab: int) -> int:
    """Tokens a chunk of logits holds: CHUNK_ELEMENTS (CUDA: CHUNK_ELEMENTS_CUDA) over the vocabulary."""
    return max(1, (CHUNK_ELEMENTS_CUDA if accelerator_path(rows) else CHUNK_ELEMENTS) // vocab)


def chunked_head(hidden: torch.Tensor, weight: torch.Tensor, per_chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """(a loss summed over tokens, its metrics' sums) from a linear head's logits (hidden @ weight.T), made a chunk of tokens
    at a time: the (tokens x vocabulary) logits never exist whole. `per_chunk(logits, rows, with_grad)` takes one chunk's
    logits (fp32 at least) and gives (sums: the loss first, then any metrics; d(loss)/d(logits) when with_grad, else None).
    The gradient is taken in the forward and only d(hidden), d(weight) kept; none at all under no_grad (eval) or when
    neither input trains. The cross-entropy (above) and distillation's divergence both run through it."""
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _ChunkedHead.apply(hidden, weight, per_chunk, with_grad)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, per_chunk, with_grad):
        need_hidden, need_weight = with_grad and hidden.requires_grad, with_grad and weight.requires_grad
        ctx.weight_dtype = weight.dtype
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        wide = torch.promote_types(weight.dtype, torch.float32)  # softmax and d(weight) sums: fp32 at least
        grad_weight = torch.zeros_like(weight, dtype=wide) if need_weight else None
        sums = None
        chunk = chunk_rows(hidden, weight.shape[0])
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]
            part, grad_logits = per_chunk((h @ weight.t()).to(wide), rows, need_hidden or need_weight)
            sums = part.detach().to(wide) if sums is None else sums + part.detach()
            if grad_logits is not None:
                chunk_grads(grad_logits, h, weight, grad_hidden, grad_weight, rows)
        if sums is None:  # no trained token: the loss is 0 (a row of metrics sized by a call on nothing)
            sums = per_chunk(hidden.new_zeros((0, weight.shape[0]), dtype=wide), slice(0, 0), False)[0].to(wide)
        ctx.save_for_backward(grad_hidden, grad_weight)
        metrics = sums[1:].clone()
        ctx.mark_non_differentiable(metrics)
        return sums[0].clone(), metrics

    @staticmethod
    def backward(ctx, grad_total, _grad_metrics):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_total.to(grad_hidden.dtype) if grad_hidden is not None else None,
            (grad_weight * grad_total).to(ctx.weight_dtype) if grad_weight is not None else None,
            None,
            None,
        )


def chunk_grads(grad_logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, grad_hidden: torch.Tensor | None,
                grad_weight: torch.Tensor | None, rows: slice) -> None:
    """A chunk's d(loss)/d(logits) (logits = hidden @ weight.T) into the rows of d(hidden) and the sum of d(weight)
    (fp32 at least: grad_weight's dtype)."""
    g = grad_logits.to(weight.dtype)
    if grad_hidden is not None:
        grad_hidden[rows] = g @ weight
    if grad_weight is not None:
        grad_weight += g.t().to(grad_weight.dtype) @ hidden.to(grad_weight.dtype)
