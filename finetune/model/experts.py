"""Mixture-of-experts layers computed grouped, with LoRA on the experts and 4-bit expert weights.

transformers holds the experts of every current MoE family as fused 3-D weights and lets a model pick how
they run (`experts_implementation`, its ExpertsInterface); its default sorts the tokens by expert and runs
one grouped matmul per projection. peft adapts those weights (`target_parameters`) by parametrizing them:
each forward builds W + B·A for every expert of the layer, a tensor the size of the layer's experts,
and its gradient another. Here the same peft adapter (its modules, its saved files) is computed on the
routed tokens only: x·Aᵀ·Bᵀ per expert as two more grouped matmuls of rank r, beside the base's.

A frozen expert weight can be 4-bit: torchao's NF4, as the linear layers of a torchao base are
(model/nf4.py), or 8-bit: bitsandbytes' LLM.int8 row-wise quantization (int8 codes, one absmax scale a row),
as an 8-bit base's linear layers are. Either is stored 2-D, an expert stack (E, d1, d2) as (E·d1, d2), and
the grouped matmul dequantizes it a few experts at a time, in the forward and again in the backward: only
the codes stay alive between them. The routers and norms stay as loaded.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from finetune.config.errors import UserError
from finetune.model import nf4
from finetune.model.attention import compute_dtype

IMPLEMENTATION = "finetune_grouped"  # the name registered in transformers' ExpertsInterface
SCALES = "_int8_scales"  # an experts module's {parameter name: per-row scales} of its 8-bit stacks
LORA = "_finetune_lora"  # an experts module's {parameter name: peft wrapper}, kept outside its submodules
SPLIT = "_finetune_expert_split"  # an experts module's Split where its experts are spread over processes
_BALANCED = ContextVar("finetune_balanced_routing", default=False)


def named_fused_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules whose weights are fused 3-D tensors that transformers dispatches through
    its ExpertsInterface (the ones `experts_implementation` switches), by name; stacks quantized as they loaded included."""
    return [(name, m) for name, m in model.named_modules()
            if is_experts(m) and (any(p.dim() == 3 for p in m.parameters(recurse=False)) or m.__dict__.get(nf4.SHAPES))]


def is_experts(module: torch.nn.Module) -> bool:
    """Whether this module holds a layer's experts as fused stacks that `group` runs grouped: one transformers dispatches
    through its ExpertsInterface (what `experts_implementation` switches), or Llama 4's (LLAMA4_EXPERTS)."""
    return (hasattr(module, "is_transposed") and hasattr(module, "num_experts")) or any(c.__name__ == LLAMA4_EXPERTS for c in type(module).__mro__)


def transposed(experts: torch.nn.Module) -> bool:
    """Whether an experts module computes x @ W_e, its stacks (E, in, out): transformers' flag, or Llama 4's, which holds none."""
    return getattr(experts, "is_transposed", True)


# transformers' Llama 4 experts and their layer, outside its ExpertsInterface: every expert computes every token, its input
# scaled by the router's sigmoid score (zero for the experts not chosen). Their stacks are (E, in, out), gate before up,
# no bias, no norm after: `group` runs them as grouped_forward on each token's chosen experts (_ScaledRouting).
# peft reads no `is_transposed` on them and lays their LoRA out as (E, out, in) (lora_weights turns it round).
LLAMA4_EXPERTS, LLAMA4_MOE = "Llama4TextExperts", "Llama4TextMoe"


def fused_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for _, m in named_fused_experts(model)]


def group(model: torch.nn.Module) -> int:
    """Run every fused experts module of `model` (a peft model or a plain one) through `grouped_forward`,
    with the LoRA that peft put on its weights. Returns how many experts modules that is."""
    from peft.tuners.lora.layer import ParamWrapper
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts = fused_experts(model)
    if not experts:
        return 0
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, grouped_forward)
    for module in experts:
        module.__dict__[LORA] = {}
        if not hasattr(module, "is_transposed"):  # Llama 4's
            module.__class__ = _grouped_class(type(module), _Llama4Experts)
    for module in model.modules():
        if type(module).__name__ == LLAMA4_MOE:
            module.__class__ = _grouped_class(type(module), _ScaledRouting)
    for module in model.modules():
        if isinstance(module, ParamWrapper) and LORA in module.get_base_layer().__dict__:
            module.get_base_layer().__dict__[LORA][module.parameter_name] = module
            module.__class__ = _grouped_wrapper(type(module))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if any(hasattr(m, "is_transposed") for m in experts):
        base.set_experts_implementation(IMPLEMENTATION)
    return len(experts)


class _Llama4Experts:
    """What grouped_forward reads of an experts module, for Llama 4's: one stack of gate then up projections, no bias, no norm after."""
    has_gate, has_bias, has_post_expert_norm, grouped = True, False, False, True

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return grouped_forward(self, hidden_states, top_k_index, top_k_weights)


class _ScaledRouting:
    """Llama 4's MoE layer with its experts run on each token's chosen ones only: each chosen expert's copy of the token
    scaled by the router's score, as the model scales every expert's (the others' by zero, adding nothing), computed
    grouped with a routing weight of one, the copies summed, the shared expert's output added. Returns what the layer's own
    forward does (the output, the router's logits)."""
    grouped = True

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        scores, logits = self.router(hidden_states)
        chosen = torch.topk(logits, self.top_k, dim=1).indices  # the router's own choice (its scores are zero elsewhere)
        copies = (hidden_states.unsqueeze(1) * scores.gather(1, chosen).unsqueeze(-1)).reshape(-1, self.hidden_dim)
        routed = self.experts(copies, chosen.reshape(-1, 1), torch.ones(len(copies), 1, dtype=copies.dtype, device=copies.device))
        out = self.shared_expert(hidden_states)
        out.add_(routed.view(-1, self.top_k, routed.shape[-1]).sum(dim=1))
        return out, logits


def _grouped_class(cls: type, layout: type) -> type:
    """cls with `layout`'s attributes and forward first (once a class; a class already so, as it is)."""
    if getattr(cls, "grouped", False):
        return cls
    if cls not in _WRAPPERS:
        _WRAPPERS[cls] = type(f"Grouped{cls.__name__}", (layout, cls), {})
    return _WRAPPERS[cls]


_WRAPPERS: dict[type, type] = {}


def _grouped_wrapper(cls: type) -> type:
    """peft's ParamWrapper, but leaving its weight as it is: grouped_forward adds the LoRA itself."""
    if getattr(cls, "grouped", False):
        return cls
    if cls not in _WRAPPERS:
        @contextmanager
        def _activate_lora(self, active_adapters):
            yield

        _WRAPPERS[cls] = type(f"Grouped{cls.__name__}", (cls,), {"_activate_lora": _activate_lora, "grouped": True})
    return _WRAPPERS[cls]


class Split(NamedTuple):
    """Where an experts module's experts are spread over processes (parallel/expert_parallel.py): this process holds experts
    first..first+count of them, its stacks sliced so; `group` the processes that together hold them all, `size` of them."""
    group: object
    size: int
    first: int
    count: int


def local_experts(module: torch.nn.Module) -> int:
    """How many experts of `module` this process holds."""
    split = module.__dict__.get(SPLIT)
    return module.num_experts if split is None else split.count


def held_whole(model: torch.nn.Module) -> int:
    """Experts, over all layers, whose stacks this process holds whole: all of them in one process or under DDP, its share
    under expert parallelism, none where FSDP2 shards them."""
    return sum(local_experts(m) for m in fused_experts(model) if not any(hasattr(p, "to_local") for p in m.parameters(recurse=False)))


def grouped_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped experts forward (its grouped_mm_experts_forward: tokens sorted by expert, one
    grouped matmul per projection, the routing weights applied, summed per token), with each projection's
    LoRA and 4-bit weights as `project` computes them."""
    split = self.__dict__.get(SPLIT)
    if split is not None:
        return routed_apart(self, hidden_states, top_k_index, top_k_weights, split)
    tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    rows = order // top_k
    if _BALANCED.get():
        ends = [len(expert_ids) * (e + 1) // self.num_experts for e in range(self.num_experts)]
        offsets = torch.tensor(ends, dtype=torch.int32, device=hidden_states.device)
    else:
        offsets = torch.cumsum(torch.bincount(expert_ids, minlength=self.num_experts), dim=0, dtype=torch.int32)
        ends = offsets.tolist() if holds_quantized(self) else None  # one host sync, quantized stacks only
    first = "gate_up_proj" if self.has_gate else "up_proj"
    if getattr(self, first).requires_grad:  # full fine-tuning: autograd's gather, and grouped_mm's weight gradient
        up = project(self, first, hidden_states[rows], offsets, ends, expert_ids)
    else:  # the routed copies made outside autograd, and only while their projection computes
        up = project(self, first, hidden_states.detach()[rows], offsets, ends, expert_ids, Gathered(hidden_states, rows))
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    folded = folds_routing(self)
    if folded and not self.down_proj.requires_grad:  # frozen: the rest of the layer a chunk of rows at a time (RoutedDown)
        lora = [t for wrapper, adapter in active_loras(self, "down_proj") for t in lora_weights(wrapper, adapter)]
        summed = RoutedDown.apply(up, weights.to(up.dtype), self, Stack.of(self, "down_proj"), offsets, ends, rows, tokens, *lora)
        return summed.to(hidden_states.dtype)
    up = activated(self, up)
    if folded:  # w·(W u) = W (w·u): the down projection's input is scaled, not its hidden-wide output
        out = project(self, "down_proj", up * weights.to(up.dtype), offsets, ends, expert_ids)
    else:
        out = project(self, "down_proj", up, offsets, ends, expert_ids)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    if not folded:
        out = out * weights.to(out.dtype)
    inverse = _inverse(order)
    return Combined.apply(out, inverse, rows, tokens).to(hidden_states.dtype)


def routed_apart(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, split: Split) -> torch.Tensor:
    """grouped_forward with the experts spread over `split.group`: each routed copy of a token sent to the process holding
    its expert (torch's all-to-all, whose backward sends the gradients back), the experts there run on what they received
    (their stacks' share, the adapter's LoRA of those experts), the outputs sent back, weighted and summed per token."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    rows, owner = order // top_k, expert_ids // split.count
    counts = torch.bincount(owner, minlength=split.size)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=split.group)
    sent, got = counts.tolist(), received.tolist()  # the split sizes: one host sync a layer

    def exchanged(x: torch.Tensor, back: bool = False) -> torch.Tensor:
        return wait_tensor(all_to_all_single_autograd(x, sent if back else got, got if back else sent, split.group))

    here = torch.empty(sum(got), dtype=expert_ids.dtype, device=expert_ids.device)
    dist.all_to_all_single(here, expert_ids - owner * split.count, got, sent, group=split.group)
    local, regroup = torch.sort(here, stable=True)  # what came, from each process sorted by expert: sorted by expert again
    offsets = torch.cumsum(torch.bincount(local, minlength=split.count), dim=0, dtype=torch.int32)
    ends = offsets.tolist() if holds_quantized(self) else None
    x = exchanged(hidden_states[rows])[regroup]
    weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
    folded = folds_routing(self)
    if folded:  # as grouped_forward: the weights travel with their tokens and scale the down projection's input
        weights = exchanged(weights)[regroup]
    up = activated(self, project(self, "gate_up_proj" if self.has_gate else "up_proj", x, offsets, ends, local))
    out = project(self, "down_proj", up * weights.to(up.dtype) if folded else up, offsets, ends, local)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    out = exchanged(out[_inverse(regroup)], back=True)
    if not folded:
        out = out * weights.to(out.dtype)
    inverse = _inverse(order)
    return Combined.apply(out, inverse, rows, tokens).to(hidden_states.dtype)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order` (where each element of the original went)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))


def holds_quantized(experts: torch.nn.Module) -> bool:
    """Whether any of the module's stacks is stored quantized (its chunked dequantization needs the groups' ends as numbers)."""
    return any(quantized(w) for w in experts.parameters(recurse=False))


class Combined(torch.autograd.Function):
    """Each token's routed outputs summed in a fixed order (transformers' deterministic sum: `out` is sorted by expert, out[i]
    token rows[i]'s). The backward hands each routed copy its token's gradient with one gather, where autograd's own
    (of a gather and a sum) builds two tensors of the routed copies' size, and keeps `out` for neither. The forward gathers
    CHUNK values at a time: the sum of a chunk of tokens is the sum of them all, bit for bit."""

    @staticmethod
    def forward(ctx, out, inverse, rows, tokens):
        ctx.save_for_backward(rows)
        copies = inverse.view(tokens, -1)
        summed, step = out.new_empty(tokens, out.shape[-1]), max(1, CHUNK // (copies.shape[1] * out.shape[-1]))  # tokens a chunk
        for first in range(0, tokens, step):
            part = copies[first:first + step]
            summed[first:first + step] = out[part.reshape(-1)].view(part.shape[0], -1, out.shape[-1]).sum(dim=1)
        return summed

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None, None


class RoutedDown(torch.autograd.Function):
    """What a MoE layer does once its first projection is made (`up`, routed copies sorted by expert: rows[i] the token of
    up[i]), where the experts are frozen and the routing weight folds into the down projection's input (folds_routing):
    the gate (activated), the routing weight, the down projection with its LoRAs (each an (a, b) of lora_weights), each
    token's outputs summed. A chunk of rows at a time, in the forward and again in the backward, where autograd takes
    each chunk's gate and LoRA (the frozen weight's input gradient is one grouped matmul, as before): it keeps `up` and
    the routing weights, where the same ops whole keep three more tensors of the routed copies and make two hidden-wide
    ones (their outputs, and in the backward their gradient: 128 MiB each at Qwen3-30B-A3B's widths and 4,096 tokens in
    bf16). The sums gather in fp32, cast once: each token's outputs, and the LoRA's gradients over the chunks."""

    @staticmethod
    def forward(ctx, up, weights, experts, stack, offsets, ends, rows, tokens, *lora):
        ctx.experts, ctx.stack, ctx.ends = experts, stack, ends
        ctx.save_for_backward(up, weights, rows, offsets, *lora)
        summed = up.new_zeros(tokens, stack.width if transposed(experts) else stack.per_expert, dtype=torch.float32)
        lora = [t.detach() for t in lora]
        for w, first, last, offs, every in _down_pieces(stack, offsets, ends, len(rows), _compute(stack, up)):
            x = activated(experts, up.detach()[first:last]) * weights.detach()[first:last]
            part = torch.nn.functional.grouped_mm(x.to(w.dtype), w if transposed(experts) else w.transpose(-2, -1), offs=offs)
            if lora:
                part += _lora_part(x, lora, every).to(part.dtype)
            add_rows(summed, rows[first:last], part)
            del w, x, part  # the generator's is the weights' only reference left: freed before the next piece's are made
        return summed.to(_compute(stack, up))

    @staticmethod
    def backward(ctx, grad):
        up, weights, rows, offsets, *lora = ctx.saved_tensors
        grad_up, grad_weights = torch.empty_like(up), torch.empty_like(weights)
        sums = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in lora]
        for w, first, last, offs, every in _down_pieces(ctx.stack, offsets, ctx.ends, len(rows), _compute(ctx.stack, up)):
            g = grad.index_select(0, rows[first:last])
            with torch.enable_grad():
                u, r = up[first:last].detach().requires_grad_(), weights[first:last].detach().requires_grad_()
                leaves = [t.detach().requires_grad_() for t in lora]
                x = activated(ctx.experts, u) * r
                outputs, grads = [x], [torch.nn.functional.grouped_mm(g.to(w.dtype), w.transpose(-2, -1) if transposed(ctx.experts) else w,
                                                                      offs=offs).to(x.dtype)]
                if leaves:
                    outputs.append(_lora_part(x, leaves, every))
                    grads.append(g.to(outputs[-1].dtype))
                torch.autograd.backward(outputs, grads)
            grad_up[first:last], grad_weights[first:last] = u.grad, r.grad
            for total, leaf in zip(sums, leaves):
                total.add_(leaf.grad)
            del w, g, u, r, x, leaves, outputs, grads
        return (grad_up, grad_weights, None, None, None, None, None, None, *(total.to(t.dtype) for total, t in zip(sums, lora)))


def _lora_part(x: torch.Tensor, lora: list[torch.Tensor], every: torch.Tensor) -> torch.Tensor:
    """The LoRAs' share of a down projection's outputs for routed rows x: (x·A_e)·B_e summed over the (a, b) pairs in `lora`."""
    parts = [torch.nn.functional.grouped_mm(torch.nn.functional.grouped_mm(x.to(a.dtype), a, offs=every), b, offs=every)
             for a, b in zip(lora[0::2], lora[1::2])]
    return sum(parts[1:], parts[0])


def _compute(stack: Stack, x: torch.Tensor) -> torch.dtype:
    """The dtype a stack's grouped matmul computes in: the input's for a quantized stack (as torchao's linear_nf4), else its own."""
    return x.dtype if quantized(stack.weight) else stack.weight.dtype


def activated(experts: torch.nn.Module, up: torch.Tensor) -> torch.Tensor:
    """The first projection's outputs through the experts' gate (or their activation, where they have none)."""
    return experts._apply_gate(up) if experts.has_gate else experts.act_fn(up)


def _down_pieces(stack: Stack, offsets: torch.Tensor, ends: list[int] | None, count: int, dtype: torch.dtype):
    """(w, first, last, offs, every) for rows first..last of `count` routed rows sorted by expert, CHUNK values of the
    stack's widest row at a time, within its dequantization steps: w the step's experts' weights (E', d1, d2) in `dtype`,
    offs their groups' ends among those rows and `every` all the experts' (for the LoRA)."""
    per, step = stack.per_expert, max(1, CHUNK // max(stack.per_expert, stack.width))
    for first_expert, last_expert, start, stop in _steps(stack, ends, count):
        w = stack.rows(first_expert * per, last_expert * per).view(last_expert - first_expert, per, -1).to(dtype)
        for first in range(start, stop, step):
            last = min(first + step, stop)
            yield w, first, last, (offsets[first_expert:last_expert] - first).clamp(0, last - first), (offsets - first).clamp(0, last - first)
        del w


def _steps(stack: Stack, ends: list[int] | None, count: int):
    """(first, last, start, stop): the experts first..last a dequantization step of `stack` holds, and the routed rows
    start..stop they take of `count` (`ends`: each expert's rows' end; steps no token reached skipped)."""
    if stack.step >= stack.experts:
        yield 0, stack.experts, 0, count
        return
    for first in range(0, stack.experts, stack.step):
        last = min(first + stack.step, stack.experts)
        start, stop = (ends[first - 1] if first else 0), ends[last - 1]
        if stop > start:
            yield first, last, start, stop


class Gathered(NamedTuple):
    """The source of routed copies x = hidden[rows] made outside autograd: a projection that reads them hands its input's
    gradient to `hidden`, each token's copies summed a chunk of rows at a time, where autograd's own gather takes each
    reader's (the base weight's, the LoRA's) for all the routed copies at once: two tensors of the routed copies' size."""
    hidden: torch.Tensor
    rows: torch.Tensor


def folds_routing(experts: torch.nn.Module) -> bool:
    """Whether the routing weight can multiply the down projection's input instead of its output: the projection is
    linear in it (no bias after it, no norm)."""
    return not experts.has_bias and not experts.has_post_expert_norm


@contextmanager
def balanced_routing():
    """Every expert takes an equal share of the routed tokens, whatever the router chose: what `finetune plan --simulate`
    assumes, its fake tensors holding no values to count them by."""
    token = _BALANCED.set(True)
    try:
        yield
    finally:
        _BALANCED.reset(token)


def project(experts: torch.nn.Module, name: str, x: torch.Tensor, offsets: torch.Tensor, ends: list[int] | None,
            expert_ids: torch.Tensor, source: Gathered | None = None) -> torch.Tensor:
    """One projection of the routed tokens `x` (sorted by expert, `offsets` ending each expert's rows, `ends` the
    same as numbers where a 4-bit stack needs them): the base weight's, its bias, and the LoRA of every active
    adapter on it. source: x made outside autograd (the input's gradient goes to the tokens)."""
    weight = getattr(experts, name)
    gathered = source or ()
    if quantized(weight) or gathered:  # a quantized stack computes in x's dtype (as torchao's linear_nf4), one kept as loaded in its own
        out = FrozenGrouped.apply(x if quantized(weight) else x.to(weight.dtype), Stack.of(experts, name), offsets, ends, transposed(experts),
                                  *gathered)
    else:
        out = torch.nn.functional.grouped_mm(x.to(weight.dtype), weight if transposed(experts) else weight.transpose(-2, -1), offs=offsets)
    if experts.has_bias:
        out = out + getattr(experts, f"{name}_bias")[expert_ids]
    for wrapper, adapter in active_loras(experts, name):
        out = AddedLow.apply(out, *lora_low(wrapper, adapter, x, offsets, source), offsets)
    return out


def active_loras(experts: torch.nn.Module, name: str) -> list[tuple[object, str]]:
    """(peft's wrapper, adapter name) of each active LoRA on the projection `name` of an experts module."""
    wrapper = experts.__dict__.get(LORA, {}).get(name)
    if wrapper is None or wrapper.disable_adapters or wrapper.merged:
        return []
    return [(wrapper, adapter) for adapter in wrapper.active_adapters if adapter in wrapper.lora_A]


def lora_weights(wrapper, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_eᵀ stacked (E, in, r), scaling · B_eᵀ stacked (E, r, out)) of the experts this process computes: with them a
    projection's LoRA adds scaling · (x·A_eᵀ)·B_eᵀ for each routed token's expert e. peft's layout: lora_A (E·r, in) holds
    A_e in rows e·r..(e+1)·r, lora_B (out, r·E) holds B_e in columns e, e+E, e+2E, ...
    Under autocast in the autocast's dtype, as the dense layers' LoRA computes there (loading.adapter_input_casting_off;
    torch's autocast leaves grouped_mm alone): the adapter's weights cast, not a copy of every routed token in fp32."""
    a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    experts, dtype = wrapper.num_experts, compute_dtype(a)
    split = wrapper.get_base_layer().__dict__.get(SPLIT)
    held = slice(None) if split is None else slice(split.first, split.first + split.count)  # the experts this process computes
    a = a.view(experts, -1, a.shape[-1])[held].transpose(-2, -1).to(dtype).contiguous()  # (E, in, r)
    b = (b.view(b.shape[0], -1, experts).permute(2, 1, 0)[held] * wrapper.scaling[adapter]).to(dtype).contiguous()  # (E, r, out), scaled: r·out
    if wrapper._did_swap_in_out_features and transposed(wrapper.get_base_layer()):  # Llama 4's: peft's (E, out, in) of a stack computed x @ W_e
        a, b = b.transpose(-2, -1).contiguous(), a.transpose(-2, -1).contiguous()
    pad = -a.shape[-1] % (16 // a.element_size())  # grouped_mm takes strides of whole 16 bytes: r 4 in bf16 gets 4 zeros
    if pad:
        a, b = torch.nn.functional.pad(a, (0, pad)), torch.nn.functional.pad(b, (0, 0, 0, pad))
    return a, b


def lora_low(wrapper, adapter: str, x: torch.Tensor, offsets: torch.Tensor, source: Gathered | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x·A_eᵀ, scaling · B_eᵀ stacked): lora_weights, and x through the first."""
    a, b = lora_weights(wrapper, adapter)
    if source is None:
        return torch.nn.functional.grouped_mm(x.to(a.dtype), a, offs=offsets), b
    return RebuiltLow.apply(x.to(a.dtype), a, offsets, *source), b


class AddedLow(torch.autograd.Function):
    """out += low·B_e per expert group, in place and CHUNK values at a time: no product the size of `out` beside it (autograd's
    grouped_mm and add make one), and no backward keeps `out`."""

    @staticmethod
    def forward(ctx, out, low, b, offsets):
        ctx.mark_dirty(out)
        ctx.save_for_backward(low, b, offsets)
        for first, last, offs in row_chunks(out.shape[0], out.shape[-1], offsets):
            out[first:last] += torch.nn.functional.grouped_mm(low[first:last], b, offs=offs).to(out.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        low, b, offsets = ctx.saved_tensors
        grad_low = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_low = torch.nn.functional.grouped_mm(grad.to(b.dtype).contiguous(), b.transpose(-2, -1), offs=offsets)
        if ctx.needs_input_grad[2]:
            grad_b = torch.nn.functional.grouped_mm(low.transpose(0, 1), grad.to(low.dtype).contiguous(), offs=offsets)
        return grad, grad_low, grad_b, None


class RebuiltLow(torch.autograd.Function):
    """x·A_e per expert group (grouped_mm) for routed copies x = hidden[rows] made outside autograd (Gathered), keeping
    for the backward, instead of x (top_k copies of each token), the layer's input and the row index: x's gradient goes
    to the input, summed per token, and x is made again there for A's gradient, CHUNK values at a time, A's gradient
    summed over the chunks in fp32."""

    @staticmethod
    def forward(ctx, x, a, offsets, hidden, rows):
        ctx.save_for_backward(a, offsets, hidden, rows)
        return torch.nn.functional.grouped_mm(x, a, offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        a, offsets, hidden, rows = ctx.saved_tensors
        grad, grad_a, grad_hidden = grad.contiguous(), None, None
        if ctx.needs_input_grad[3]:
            grad_hidden = per_token(lambda first, last, offs: torch.nn.functional.grouped_mm(grad[first:last], a.transpose(-2, -1), offs=offs),
                                    rows, offsets, (hidden.shape, hidden.dtype))
        if ctx.needs_input_grad[1]:
            sums = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
            for first, last, offs in row_chunks(len(grad), a.shape[1], offsets):
                sums += torch.nn.functional.grouped_mm(hidden[rows[first:last]].to(a.dtype).transpose(0, 1), grad[first:last], offs=offs)
            grad_a = sums.to(a.dtype)
        return None, grad_a, None, grad_hidden, None


def per_token(product, rows: torch.Tensor, offsets: torch.Tensor, tokens: tuple) -> torch.Tensor:
    """Each token's sum over its routed copies of a grouped matmul's rows, made CHUNK values at a time: product(first, last,
    offs) the rows first..last (offs: the expert groups' ends among them), summed in fp32 (add_rows) into a tensor of the
    tokens' (shape, dtype)."""
    out = offsets.new_zeros(tokens[0], dtype=torch.float32)
    for first, last, offs in row_chunks(len(rows), out.shape[-1], offsets):
        add_rows(out, rows[first:last], product(first, last, offs))
    return out.to(tokens[1])


def add_rows(out: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """out[rows] += values, rows repeated summed in order, in out's dtype: index_add_ on a CPU (index_put_'s accumulation
    runs serially there: 11 ms against 0.3 for 8,192 rows of 512), index_put_ elsewhere (its sorted accumulation is
    deterministic where CUDA's index_add_ takes atomics)."""
    if out.device.type == "cpu":
        out.index_add_(0, rows, values.to(out.dtype))
    else:
        out.index_put_((rows,), values.to(out.dtype), accumulate=True)


def row_chunks(count: int, width: int, offsets: torch.Tensor):
    """(first, last, offs) for rows first..last of `count` routed rows sorted by expert, CHUNK values `width` wide at a time:
    offs, the expert groups' ends among those rows (clamped from `offsets`, on the device: no host sync), for grouped_mm."""
    step = max(1, CHUNK // width)
    for first in range(0, count, step):
        last = min(first + step, count)
        yield first, last, (offsets - first).clamp_(0, last - first)


CHUNK = 1 << 24  # expert weights dequantized at a time (64 MiB in bf16 with rows_of's index beside them)


def quantized(weight: torch.Tensor) -> bool:
    """An expert stack stored quantized (4-bit NF4, or 8-bit codes)."""
    return nf4.is_nf4(weight) or weight.dtype == torch.int8


class Stack:
    """An expert stack stored (E·d1, d2): `rows(first, last)` gives rows first..last as values (a quantized stack dequantized:
    torchao's NF4, or bitsandbytes' int8 codes times their row scales), `step` experts at a time fit CHUNK (whole
    double-quantization groups for NF4). A stack kept in 16 or 32 bits is one step: its rows are views."""

    def __init__(self, weight: torch.Tensor, experts: int, scales: torch.Tensor | None = None):
        self.weight, self.experts, self.scales = weight, experts, scales
        self.per_expert, self.width = weight.shape[0] // experts, weight.shape[1]
        step = max(1, CHUNK // (self.per_expert * self.width)) if quantized(weight) else experts
        if nf4.is_nf4(weight) and not slices_evenly(weight, self.per_expert * step):
            step = experts  # a tiny NF4 stack whose scale groups straddle experts: whole
        self.step = step

    @classmethod
    def of(cls, module: torch.nn.Module, name: str) -> Stack:
        weight = getattr(module, name)
        weight = weight if quantized(weight) else weight.detach().view(-1, weight.shape[-1])
        return cls(weight, local_experts(module), module.__dict__.get(SCALES, {}).get(name))

    def rows(self, first: int, last: int) -> torch.Tensor:
        if not quantized(self.weight):
            return self.weight[first:last]
        if self.scales is None:
            return rows_of(self.weight, first, last)
        from bitsandbytes.functional import int8_vectorwise_dequant

        return int8_vectorwise_dequant(self.weight[first:last], self.scales[first:last])


class FrozenGrouped(torch.autograd.Function):
    """x @ W_eᵀ per expert group for a frozen expert stack. A quantized one is dequantized a few experts at a time (CHUNK
    weights), in the forward and again for the input's gradient, so a layer's whole dequantized stack is never held, and
    experts no token reached are skipped. Given the tokens and the row index x was gathered by (Gathered), the input's
    gradient goes to the tokens, each token's copies summed chunk by chunk (per_token)."""

    @staticmethod
    def forward(ctx, x, stack, offsets, ends, transposed, hidden=None, rows=None):
        ctx.stack, ctx.ends, ctx.transposed = stack, ends, transposed
        ctx.tokens = None if hidden is None else (hidden.shape, hidden.dtype)  # not the tensor: checkpointing frees it
        ctx.save_for_backward(offsets, rows)
        return _chunked(x, stack, offsets, ends, lambda w: w if transposed else w.transpose(-2, -1))

    @staticmethod
    def backward(ctx, grad):
        offsets, rows = ctx.saved_tensors
        oriented = (lambda w: w.transpose(-2, -1)) if ctx.transposed else (lambda w: w)
        grad_x = grad_hidden = None
        if rows is None:
            grad_x = _chunked(grad.contiguous(), ctx.stack, offsets, ctx.ends, oriented)
        else:
            grad_hidden = _chunked(grad.contiguous(), ctx.stack, offsets, ctx.ends, oriented, rows, ctx.tokens)
        return grad_x, None, None, None, None, grad_hidden, None


def _chunked(x: torch.Tensor, stack: Stack, offsets: torch.Tensor, ends: list[int] | None, oriented,
             rows: torch.Tensor | None = None, tokens: tuple | None = None) -> torch.Tensor:
    """grouped_mm of x's expert groups with `oriented(W_e)`, the stack dequantized chunk by chunk (in x's dtype,
    as torchao's linear_nf4 computes), each chunk's weights freed before the next chunk's are made and its products
    written into the one output; or, given the row index x was gathered by, each token's rows summed into a tensor of
    the tokens' (shape, dtype) (as per_token)."""
    if stack.step >= stack.experts:  # one step: no host-side ends needed
        whole = oriented(stack.rows(0, stack.weight.shape[0]).view(stack.experts, stack.per_expert, -1).to(x.dtype))
        if rows is None:
            return torch.nn.functional.grouped_mm(x, whole, offs=offsets)
        return per_token(lambda first, last, offs: torch.nn.functional.grouped_mm(x[first:last], whole, offs=offs), rows, offsets, tokens)
    per = stack.per_expert
    shape = (x.shape[0], oriented(torch.empty(1, per, stack.width, device="meta")).shape[-1])
    out = x.new_empty(shape) if rows is None else x.new_zeros(tokens[0], dtype=torch.float32)
    for first, last, start, stop in _steps(stack, ends, x.shape[0]):
        w = stack.rows(first * per, last * per).view(last - first, per, -1).to(x.dtype)
        part = torch.nn.functional.grouped_mm(x[start:stop], oriented(w), offs=offsets[first:last] - start)
        del w
        if rows is None:
            out[start:stop] = part
        else:
            add_rows(out, rows[start:stop], part)
    return out if rows is None else out.to(tokens[1])


def slices_evenly(weight: torch.Tensor, rows: int) -> bool:
    """Whether `rows` rows of an NF4 weight hold whole double-quantization groups (a chunk can be dequantized alone)."""
    return (rows * weight.shape[1]) % (weight.block_size * weight.scaler_block_size) == 0


def rows_of(weight: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Rows first..last of an NF4 weight, the values torchao's get_original_weight gives (bit for bit: the same table values
    times the same scalers, tested), holding less while it makes them: each byte's two codes looked up at once in a table
    of the 256 code pairs (an int32 index, 2 bytes a weight) and scaled in place, where torchao takes an int64 index for each
    code and scales copies (7x the output's bytes in bf16; this: 2 bytes a weight beside the output)."""
    width, group = weight.shape[1], weight.scaler_block_size
    lo, hi = first * width // weight.block_size, last * width // weight.block_size  # blocks
    scalers = weight.dequantize_scalers(weight.quantized_scalers[lo:hi], weight.quantization_factor[lo // group:hi // group], group)
    pairs = torch.stack([weight.nf4.repeat_interleave(16), weight.nf4.repeat(16)], dim=-1)  # byte b: (nf4[b >> 4], nf4[b & 15])
    codes = weight.quantized_data[first * width // 2:last * width // 2]
    values = pairs.index_select(0, codes.int()).view(-1, weight.block_size)
    return values.mul_(scalers.unsqueeze(-1)).view(last - first, width)


def quantize(module: torch.nn.Module, dtype: torch.dtype, shards: int = 1, bits: int = 4) -> int:
    """Every frozen fused expert weight (E, d1, d2) under `module` as its (E·d1, d2) rows quantized (`codes`), in blocks
    `shards` processes can split. Only experts that `group` runs: no other forward reads the 2-D form. Stacks quantized as
    they loaded (quantized_as_loaded) are 2-D already. Returns how many were replaced."""
    chosen = [(m, name, w) for m in module.modules() if LORA in m.__dict__ for name, w in m.named_parameters(recurse=False)
              if w.dim() == 3 and not w.requires_grad and (bits == 8 or w.numel() % nf4.BLOCK == 0)]
    why = nf4.uneven_rows({f"experts.{name}": w.shape[0] * w.shape[1] for _, name, w in chosen}, shards) if bits == 4 else None
    if why:
        raise UserError(why)
    for m, name, w in chosen:
        setattr(m, name, codes(m, name, w, dtype, shards, bits))
    return len(chosen)


def codes(module: torch.nn.Module, name: str, weight: torch.Tensor, dtype: torch.dtype, shards: int, bits: int) -> torch.nn.Parameter:
    """An expert stack (E, d1, d2) of `module` as its (E·d1, d2) rows quantized, its shape (and 8-bit scales) kept on the
    module: 4 bits, torchao's NF4 of the weight cast to `dtype` (the compute dtype); 8 bits, bitsandbytes' int8 codes with a
    scale a row of the weight as loaded (its LLM.int8 row-wise quantization, no outliers kept apart)."""
    rows = weight.detach().to(dtype if bits == 4 else weight.dtype).reshape(-1, weight.shape[-1])
    module.__dict__.setdefault(nf4.SHAPES, {})[name] = tuple(weight.shape)
    if bits == 4:
        stored = nf4.to_nf4(rows, shards)
    else:
        from bitsandbytes.functional import int8_vectorwise_quant

        stored, module.__dict__.setdefault(SCALES, {})[name], _ = int8_vectorwise_quant(rows)
    return torch.nn.Parameter(stored, requires_grad=False)


@contextmanager
def quantized_as_loaded(dtype: torch.dtype, bits: int | None, share: tuple[int, int] | None = None):
    """Each fused expert stack quantized (`codes`) as transformers sets it on its module while loading, through torch's
    parameter-registration hook: the process holds a stack or two of the experts in the model's dtype at a time, not all of
    them (where they would be quantized once the adapter is on: a 4-bit base on one GPU held them all there in bf16). The
    model's experts then run grouped (`group`); the adapter sees their own shapes (shaped_for_peft). share (index, size):
    expert parallelism's (parallel/expert_parallel.py), only this process's share of each stack kept: quantized whole in
    blocks the processes split, then its share of the codes (the codes one process holds), or its share as loaded (bits None)."""
    def quantized_stack(module, name, param):
        if param is None or param.dim() != 3 or param.device.type == "meta" or not is_experts(module):
            return None
        if bits is None or (bits == 4 and param.numel() % nf4.BLOCK):
            stored = torch.nn.Parameter(param.detach()[share_slice(module.num_experts, *share)].clone() if share else param, requires_grad=False)
        else:  # the whole stack quantized (in blocks the processes split), then this process's share: the codes one process has
            stored = codes(module, name, param, dtype, share[1] if share else 1, bits)
            if share:
                stored = _codes_share(module, name, stored, *share)
        stored._is_hf_initialized = True  # transformers initializes the parameters a checkpoint lacked: this one it had
        return stored

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(quantized_stack)
    try:
        yield
    finally:
        handle.remove()


def _codes_share(module: torch.nn.Module, name: str, stored: torch.nn.Parameter, index: int, size: int) -> torch.nn.Parameter:
    """This process's experts of a quantized stack (`codes`): rows index/size of its NF4 codes, or of its int8 codes and
    their row scales; its shape on the module, that share's."""
    shape = module.__dict__[nf4.SHAPES][name]
    kept = share_slice(shape[0], index, size)
    module.__dict__[nf4.SHAPES][name] = (kept.stop - kept.start, *shape[1:])
    if nf4.is_nf4(stored):
        return torch.nn.Parameter(nf4.share(stored, index, size), requires_grad=False)
    rows = slice(kept.start * shape[1], kept.stop * shape[1])
    module.__dict__[SCALES][name] = module.__dict__[SCALES][name][rows].clone()
    return torch.nn.Parameter(stored.detach()[rows].clone(), requires_grad=False)


def share_slice(total: int, index: int, size: int) -> slice:
    """The experts process `index` of `size` holds, of `total` (a multiple of `size`: expert_parallel.check)."""
    return slice(index * total // size, (index + 1) * total // size)


@contextmanager
def shaped_for_peft(model: torch.nn.Module):
    """peft reads a fused expert weight's shape (and dtype: it casts the new LoRA to it) to make its LoRA: each stack
    quantized as it loaded is, meanwhile, a placeholder of its own shape in the model's dtype as loaded (one value,
    repeated: no memory), then its codes again. A stack split over processes (expert parallelism) is one of all the
    experts' shape: the adapter is every expert's, on every process."""
    swapped, dtype = [], model.get_input_embeddings().weight.dtype
    for module in model.modules():
        shapes = module.__dict__.get(nf4.SHAPES, {})
        for name, stored in list(module.named_parameters(recurse=False)) if is_experts(module) else []:
            shape = shapes.get(name, tuple(stored.shape)) if stored.dim() == 2 else tuple(stored.shape)
            if len(shape) == 3 and (stored.dim() == 2 or shape[0] != module.num_experts):
                whole = (module.num_experts, *shape[1:])
                held = stored.dtype if stored.dim() == 3 else dtype
                setattr(module, name, torch.nn.Parameter(torch.zeros((), dtype=held, device=stored.device).expand(whole), requires_grad=False))
                swapped.append((module, name, stored))
    try:
        yield
    finally:
        for module, name, stored in swapped:
            setattr(module, name, stored)


def dequantized(module: torch.nn.Module, name: str) -> torch.Tensor:
    """An 8-bit expert stack's weight in its own shape, as the grouped forward computes with it (float32)."""
    stack = Stack.of(module, name)
    return stack.rows(0, stack.weight.shape[0]).view(module.__dict__[nf4.SHAPES][name])


def dequantize_model(model: torch.nn.Module) -> torch.nn.Module:
    """Every 4-bit weight (torchao's NF4: a torchao base's linear layers, any 4-bit base's expert stacks) and 8-bit expert
    stack replaced by its dequantized values, in its own shape (an expert stack, stored 2-D, in 3-D again): what merging
    into the trained-on base takes."""
    for module in model.modules():
        shapes = module.__dict__.get(nf4.SHAPES, {})
        for name, param in list(module.named_parameters(recurse=False)):
            if nf4.is_nf4(param):
                value = param.get_original_weight().view(shapes.get(name, param.shape))
            elif name in module.__dict__.get(SCALES, {}):
                value = dequantized(module, name)
            else:
                continue
            setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    return model
