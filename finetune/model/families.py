"""What differs between model families, read from a model's config (a dict: config.json or
`model.config.to_dict()`). One place for it, no torch: the planner, the loader, the loss and the
adapter all ask here instead of testing model types of their own.

The families tested (tests/test_families.py): Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3,
Mixtral, Qwen2-MoE, Qwen3-MoE. Other decoders with the same config keys work the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Linear:
    """One linear layer of the decoder, summed over layers (and experts): `copies` instances of
    (fan_in -> fan_out), of which `active` run for each token."""

    name: str
    fan_in: int
    fan_out: int
    copies: int
    active: int
    expert: bool = False  # a slice of a fused 3-D experts parameter, not an nn.Linear
    router: bool = False

    @property
    def params(self) -> int:
        return self.fan_in * self.fan_out * self.copies


def text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal configs nest it)."""
    return config.get("text_config") or config


def attention_softcap(config: dict) -> float | None:
    """Logit soft-capping inside attention (Gemma 2): sdpa kernels cannot do it."""
    return text_config(config).get("attn_logit_softcapping")


def plain_head(config: dict) -> bool:
    """Whether the logits are exactly lm_head(final hidden state): no soft-capping or scaling of them. Not where the
    model cuts its rows to the kept positions itself (Gemma 4's KV-shared layers run only on an integer logits_to_keep's
    positions, which the fused loss's 1 would make the last one)."""
    c = text_config(config)
    scaled = any(c.get(k) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"))
    return not scaled and not c.get("num_kv_shared_layers") and c.get("model_type") in PLAIN_HEAD_MODELS


# Causal LMs whose forward ends in a bias-free lm_head over the last hidden state (the fused loss checks
# the head module itself too). Gemma 2's default final soft-capping is caught by plain_head's key check.
PLAIN_HEAD_MODELS = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2",
                     "mixtral", "qwen2_moe", "qwen3_moe", "mllama_text_model", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text",
                     "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gemma4_text"}


# The families whose layers linear_layers() spells out, each tested against the loaded model and the
# published counts (tests/test_families.py); the planner reads any other architecture off the model
# built on the meta device.
SPELLED_OUT = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"}


# Attention with a learned sink logit per head (passed to the attention function as s_aux): finetune's packed
# attention takes it (model/attention.py), transformers' sdpa does not.
ATTENTION_SINKS = {"gpt_oss"}


# Experts with a bias or a norm after their down projection (transformers' use_experts_implementation with has_bias or
# has_post_expert_norm): the routing weight scales their outputs, not the down projection's inputs (model/experts.py).
UNFOLDED_ROUTING = {"gpt_oss", "openai_privacy_filter", "muse_spark"}


def num_experts(config: dict) -> int:
    c = text_config(config)
    return int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)


def router_aux_loss_coef(config: dict) -> float:
    """The coefficient of the router's load-balancing loss that the model's config asks for (0: dense)."""
    return float(text_config(config).get("router_aux_loss_coef") or 0.0) if num_experts(config) else 0.0


def sparse_layers(config: dict) -> list[bool]:
    """For each decoder layer: does its MLP route to experts (Qwen-MoE may keep some layers dense)?"""
    c = text_config(config)
    n, experts = c["num_hidden_layers"], num_experts(config)
    step, dense = c.get("decoder_sparse_step") or 1, set(c.get("mlp_only_layers") or [])
    return [bool(experts) and i not in dense and (i + 1) % step == 0 for i in range(n)]


def linear_layers(config: dict) -> list[Linear]:
    """Every linear layer of the decoder stack with its shape and count (embeddings and head excluded).

    Phi-3 fuses q/k/v into qkv_proj and gate/up into gate_up_proj; MoE models hold their experts as
    fused 3-D parameters (gate_up_proj, down_proj per expert) and route each token to a few of them."""
    c = text_config(config)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    sparse = sparse_layers(config)
    layers, moe = len(sparse), sum(sparse)
    dense = layers - moe
    fused = c.get("model_type") == "phi3"
    out = [Linear("qkv_proj", h, q + 2 * kv, layers, layers)] if fused else [
        Linear("q_proj", h, q, layers, layers), Linear("k_proj", h, kv, layers, layers), Linear("v_proj", h, kv, layers, layers)]
    out.append(Linear("o_proj", q, h, layers, layers))
    i = c.get("intermediate_size") or 0
    if dense:
        out += [Linear("gate_up_proj", h, 2 * i, dense, dense)] if fused else [
            Linear("gate_proj", h, i, dense, dense), Linear("up_proj", h, i, dense, dense)]
        out.append(Linear("down_proj", i, h, dense, dense))
    if moe:
        experts, k = num_experts(config), c.get("num_experts_per_tok") or 1
        m = c.get("moe_intermediate_size") or i
        out += [Linear("gate", h, experts, moe, moe, router=True),
                Linear("experts.gate_up_proj", h, 2 * m, moe * experts, moe * k, expert=True),
                Linear("experts.down_proj", m, h, moe * experts, moe * k, expert=True)]
        s = c.get("shared_expert_intermediate_size") or 0
        if s:
            out += [Linear("shared_expert.gate_proj", h, s, moe, moe), Linear("shared_expert.up_proj", h, s, moe, moe),
                    Linear("shared_expert.down_proj", s, h, moe, moe), Linear("shared_expert_gate", h, 1, moe, moe, router=True)]
    return out


def buffer_bytes(config: dict, weight_bytes: int) -> int:
    """The model's buffers: the rotary embedding's inverse frequencies in fp32, kept twice (as they are
    and as first computed), per attention kind (Gemma 3: full and sliding); Gemma's embedding scale, a
    scalar in the weights' dtype."""
    c = text_config(config)
    kind = c.get("model_type")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    frequencies = int(head_dim * c.get("partial_rotary_factor", 1.0)) // 2
    return (2 if kind == "gemma3_text" else 1) * 2 * frequencies * 4 + (weight_bytes if kind in ("gemma2", "gemma3_text") else 0)


QK_NORMS = ("qwen3", "qwen3_moe", "gemma3_text")  # families that norm each head's query and key


def saved_attention_values(config: dict) -> int:
    """Values a decoder layer keeps per token for its backward outside the MLP: each norm's input and output,
    the rotated query, key and value and the attention output twice (the kernel's, and the output projection's input
    in its own layout; queries and output are heads x head size wide, which Qwen3 and Gemma 3 set apart from the
    width), and the q/k norms' inputs. The norms keep their inputs in fp32 (norm_inputs)."""
    c = text_config(config)
    kind, h, heads = c.get("model_type"), c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    return 2 * h * _norms(kind) + 3 * q + 2 * kv + (q + kv if kind in QK_NORMS else 0)


def _norms(kind: str | None) -> int:
    return 4 if kind in ("gemma2", "gemma3_text") else 2


def norm_inputs(config: dict) -> int:
    """Of saved_attention_values, the norms' inputs (the q/k norms' too): RMSNorm casts its input to fp32 and keeps that,
    whatever the activations' dtype (read from `plan --simulate`'s tensors at Qwen3-30B-A3B's and Llama-3.1-8B's widths)."""
    c = text_config(config)
    kind, h, heads = c.get("model_type"), c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    return h * _norms(kind) + (q + kv if kind in QK_NORMS else 0)


# Qwen3-Next's and Qwen3.5's layers: Gated DeltaNet (linear attention) in most, gated attention in the others, both
# with norms that compute in fp32 (weight + 1).
GATED_DELTANET = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
DELTA_CHUNK = 64  # transformers' PyTorch delta rule (torch_chunk_gated_delta_rule) runs the row in chunks of 64 tokens


def saved_hybrid_values(config: dict) -> tuple[float, float] | None:
    """(values in the activations' dtype, fp32 values) a Gated DeltaNet hybrid's layer keeps per token for its backward
    outside the MLP, averaged over its layers; None for other families. Read tensor by tensor from `plan --simulate`
    (FSDPMemTracker, LoRA, bf16) at Qwen3.5-27B's widths, 2,048 tokens: a DeltaNet layer kept 722,700 bytes a token with
    its MLP, this 697,472; a gated attention layer 295,400, this 294,912 (docs/platform-notes.md). The delta rule computes
    in fp32 whatever the model's dtype: its chunked queries, keys and values, each chunk's 64 x 64 matrices and the
    recurrent state at each chunk's start (heads x key x value dims). The attention layer's query projection also
    makes the output gate (3 more query-wide values), and its q/k norms keep their fp32 inputs."""
    c = text_config(config)
    if c.get("model_type") not in GATED_DELTANET:
        return None
    h, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    v_heads, dk, dv = c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = 2 * c["linear_num_key_heads"] * dk + v_heads * dv  # the short convolution's channels: queries, keys, values
    # each norm's fp32 input and its output (the projections' input), then the mixer's own
    delta = (2 * h + 2 * conv + 2 * v_heads * dv,
             2 * h + v_heads * (6 * dk + 7 * dv + 5 * DELTA_CHUNK + dk * dv / DELTA_CHUNK + 6))
    attention = (2 * h + 5 * q + 2 * kv, 2 * h + q + kv)
    kinds = c.get("layer_types") or ["full_attention" if (i + 1) % c.get("full_attention_interval", 4) == 0 else "linear_attention"
                                     for i in range(c["num_hidden_layers"])]
    linear = sum(kind == "linear_attention" for kind in kinds) / len(kinds)
    return tuple(linear * d + (1 - linear) * a for d, a in zip(delta, attention))


def small_params(config: dict) -> int:
    """Norm weights and biases of the decoder: few, never quantized, but counted so that totals match
    the published ones (Gemma 2/3 have four norms a layer, Qwen3 and Gemma 3 norm queries and keys,
    Qwen2 has q/k/v biases)."""
    c = text_config(config)
    kind, h, layers = c.get("model_type"), c["hidden_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
    per_layer = h * (4 if kind in ("gemma2", "gemma3_text") else 2)
    if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
        per_layer += 2 * head_dim
    if kind in ("qwen2", "qwen2_moe"):
        per_layer += q + 2 * kv
    elif c.get("attention_bias"):
        per_layer += q + 2 * kv + h
    return layers * per_layer + h  # + the final norm

