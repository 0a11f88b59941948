"""Router replay for mixture-of-experts RL (`grpo.router_replay`): the experts each token was routed to while the
sampler drew it are recorded, and the training forwards route each token to those experts.

The sampler (generate, KV cache) and the trainer (one forward over the packed row) compute a token's router logits
in different orders of floating-point operations; where two experts nearly tie, they pick different ones, and the
token's log-probability jumps (Megatron-LM #4168: Qwen3-30B-A3B GRPO runs collapsing without replay). Replaying
the sampler's choice keeps the trainer on the experts that made the token; the gate weights are recomputed from the
trainer's own logits at those experts, by the family's rule, so the router and the hidden states still get
gradients.

A forward hook on each router (transformers' TopKRouter modules, which return logits, weights and expert indices)
does both: while `recording`, it keeps the indices of every call; while a replay is set, it swaps in the replayed
indices and their weights. The state lives on the router module itself, so a deep copy of the model has its own.
"""

from __future__ import annotations

import contextlib

import torch

STATE = "_finetune_routing"  # a router's {"record": index tensors or None, "replay": (tokens, k) indices or None, "differing": counts}
FREE = -1  # a replayed position that keeps the router's own choice (a token the sampler never ran: a completion's last)
# transformers' router classes by how their weights follow from the logits at the chosen experts
RULES = {
    "softmax": ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter",
                "Qwen3VLMoeTextTopKRouter", "OlmoeTopKRouter"),  # softmax over all experts, the chosen renormalized (norm_topk_prob)
    "softmax_of_chosen": ("GptOssTopKRouter",),  # softmax over the chosen experts' logits
    "sigmoid": ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"),  # sigmoid scores, renormalized (norm_topk_prob), times routed_scaling_factor
}
_RULE = {name: rule for rule, names in RULES.items() for name in names}


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers whose choices can be replayed, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in _RULE]


def unreplayable(model: torch.nn.Module) -> str | None:
    """Why grpo.router_replay cannot run on this model (a dense model, or routers of a family not replayed), else None."""
    from finetune.model.experts import named_fused_experts

    if routers(model):
        return None
    if not named_fused_experts(model):
        return f"{model.config.model_type} is a dense model: no router to replay"
    others = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))})
    return (f"{model.config.model_type}'s routers ({', '.join(others) or 'not transformers TopKRouter modules'}) are not among those "
            f"replayed ({', '.join(sorted(_RULE))})")


def install(model: torch.nn.Module) -> int:
    """Hook every router once; returns how many there are."""
    found = routers(model)
    for router in found:
        if not hasattr(router, STATE):
            setattr(router, STATE, {"record": None, "replay": None, "differing": None})
            router.register_forward_hook(_hook)
    return len(found)


def _hook(router, args, output):
    state = getattr(router, STATE)
    logits, weights, indices = output
    if state["record"] is not None:
        state["record"].append(indices.detach())
    replay = state["replay"]
    if replay is not None and replay.shape != indices.shape:  # another forward than the batch's (generation after training): its own routes
        state["replay"] = replay = None
    if replay is None:
        return None
    replay = replay.to(device=indices.device, dtype=indices.dtype)
    own = replay[:, :1] == FREE
    chosen = torch.where(own, indices, replay)
    fixed = ~own[:, 0]
    differ = (indices.sort(-1).values != chosen.sort(-1).values).any(-1) & fixed
    state["differing"] = state["differing"].to(differ.device) + torch.stack([differ.sum(), fixed.sum()])  # no host sync
    return logits, torch.where(own, weights, _weights(router, logits, chosen).to(weights.dtype)), chosen


def _weights(router, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The gate weights the router gives the `chosen` experts, from its logits, by its family's rule."""
    rule = _RULE[type(router).__name__]
    if rule == "softmax_of_chosen":
        return torch.softmax(logits.gather(1, chosen), dim=1, dtype=logits.dtype)
    if rule == "sigmoid":
        picked = logits.sigmoid().gather(1, chosen)
        if router.norm_topk_prob:
            picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
        return picked * router.routed_scaling_factor
    picked = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
    if getattr(router, "norm_topk_prob", True):  # Mixtral and Qwen3.5-MoE always renormalize
        picked = picked / picked.sum(-1, keepdim=True)
    return picked


@contextlib.contextmanager
def recording(model: torch.nn.Module, rows: int):
    """Record every router's choices over the forwards inside (a `generate` call of `rows` rows: the prompt's forward,
    then a token a row each step), no replay set. Yields a function: () -> (rows, columns, layers, k) expert indices, the
    columns those of the calls' tokens in turn (the left-padded prompts', then each step's token)."""
    found = routers(model)
    for router in found:
        getattr(router, STATE).update(record=[], replay=None)

    def taken() -> torch.Tensor:
        per_layer = [torch.cat([call.view(rows, -1, call.shape[-1]) for call in getattr(r, STATE)["record"]], dim=1) for r in found]
        return torch.stack(per_layer, dim=2).cpu()

    try:
        yield taken
    finally:
        for router in found:
            getattr(router, STATE)["record"] = None


def per_sequence(taken: torch.Tensor, prompt_lengths: list[int], completion_lengths: list[int]) -> list[torch.Tensor]:
    """Each `generate` row's recorded experts (`recording`'s table: left-padded prompts, then a token a step) as its sequence
    prompt + completion holds them: (tokens, layers, k), int16. A completion's last token was drawn but never run: FREE."""
    width = max(prompt_lengths)
    out = []
    for row, (prompt, completion) in enumerate(zip(prompt_lengths, completion_lengths)):
        ran = taken[row, width - prompt : width + completion - 1]
        out.append(torch.cat([ran, torch.full_like(ran[:1], FREE)]).to(torch.int16))
    return out


def replay(model: torch.nn.Module, choices: torch.Tensor | None) -> None:
    """Route the next forwards (and their recomputation in the backward) by `choices`: (tokens, layers, k) expert indices, the
    tokens in the order the routers see them (rows of the batch one after another), FREE where the router's own choice stands;
    None: the routers' own choices again."""
    for layer, router in enumerate(routers(model)):
        getattr(router, STATE).update(replay=None if choices is None else choices[:, layer], differing=torch.zeros(2, dtype=torch.long))


def differing(model: torch.nn.Module) -> torch.Tensor:
    """The share of replayed (token, layer) choices the router would have made otherwise, over the forwards since `replay`
    (counted from the first forward on: read it before a backward recomputes them)."""
    counts = sum(getattr(r, STATE)["differing"] for r in routers(model))
    return counts[0] / counts[1].clamp(min=1)
