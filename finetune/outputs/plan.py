"""Memory planner: what a run will need per device, from the model's config.json alone (its shape:
outputs/shape; the step's time: outputs/steptime).

The arithmetic (bytes per parameter, per token) is spelled out in docs/planning.md with a worked 7B
example. Rows: weights, gradients, optimizer states, activations (with or without checkpointing) and,
on GPUs, a reserve for the CUDA context and allocator slack.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from finetune.config.errors import UserError
from finetune.config.schema import DTYPE_BYTES, QuantizationConfig, RunConfig
from finetune.config.strategy import Strategy
from finetune.model import experts, families, nf4
from finetune.model.families import Linear
from finetune.outputs.shape import Shape, VisionShape, read_shape, up_width
from finetune.parallel.runtime import LONG_ROWS, glibc_tuned_by_user

GiB = 2**30
# Optimizer state bytes per trainable parameter (None: same as the parameter's own bytes, twice).
OPTIMIZER_STATE_BYTES = {"adamw": None, "paged_adamw_32bit": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "lion": 4, "lion_8bit": 1}
GPU_RESERVE = 1.0 * GiB  # CUDA context + caching-allocator slack, measured-ish; 0 on CPU
# What a CPU training process grows by beyond its tensors once the model is loaded (autograd, the
# optimizer's first step, thread pools, libraries loaded on first use): 151 MiB measured for a model of
# a few MB (tests' tiny Llama, 4 steps).
CPU_RUNTIME = 150 * 2**20
BNB_BLOCK = 64  # bitsandbytes 4-bit block size
# A 4-bit layer's quantization state beyond its per-block scales: the 16-value NF4 code (fp32), and with
# double quantization the 256-value code of the scales' own quantization and their offset (fp32).
NF4_STATE, NF4_STATE_DOUBLE = 16 * 4, (16 + 256 + 1) * 4


@dataclass(frozen=True)
class Setup:
    """The knobs the planner varies when it looks for a plan that fits."""

    method: str  # full | lora | dora | qlora | qdora | 8bit-lora
    bits: int | None
    weight_bytes: int
    optimizer: str
    micro_batch: int
    seq_len: int
    activation_bytes: int
    checkpointing: bool
    strategy: str  # distributed.strategy's names: none | ddp (replicated) | fsdp | zero2 | zero3 | zero3_offload
    devices: int
    fsdp_cpu_offload: bool = False  # distributed.fsdp_cpu_offload
    sequence_parallel: int = 1  # distributed.sequence_parallel: processes sharing each row
    tensor_parallel: int = 1  # distributed.tensor_parallel: processes splitting each layer (of `devices`)
    tiled_mlp: int = 1  # model.tiled_mlp: chunks each MLP runs over
    expert_parallel: int = 1  # distributed.expert_parallel: processes splitting each layer's frozen experts
    accelerator: bool = False  # planned for GPUs (make_plan's gpu): the attention kernels chosen there

    @property
    def tokens(self) -> float:
        """Tokens of a micro-batch one device holds."""
        return self.micro_batch * self.seq_len / self.sequence_parallel

    @property
    def run_as(self) -> Strategy:
        return Strategy.of(self.strategy, self.devices)

    @property
    def shards_states(self) -> bool:
        return self.run_as.shards_states

    @property
    def shards_weights(self) -> bool:
        return self.run_as.shards_weights

    @property
    def offloads(self) -> bool:
        """Sharded weights, gradients and optimizer states kept in CPU RAM (a GPU run)."""
        return self.run_as.offload or (self.run_as.name == "fsdp" and self.fsdp_cpu_offload)


def setup_from_config(cfg: RunConfig, devices: int, strategy: str | None = None) -> Setup:
    q = cfg.model.quantization
    mp = cfg.train.mixed_precision
    weight_bytes = DTYPE_BYTES.get(cfg.model.dtype, 2)  # auto: as stored, most often in 16 bits
    return Setup(
        method=cfg.adapter.method, bits=q.bits if q else None, weight_bytes=weight_bytes, optimizer=cfg.train.optimizer,
        micro_batch=cfg.train.micro_batch_size, seq_len=row_tokens(cfg),
        activation_bytes=2 if mp in ("bf16", "fp16", "fp8") or (weight_bytes == 2 and not (q and q.compute_dtype == "float32")) else 4,
        checkpointing=cfg.train.gradient_checkpointing, devices=devices,
        strategy=Strategy.of(strategy or cfg.distributed.strategy, devices).name,  # one process runs unsharded
        fsdp_cpu_offload=cfg.distributed.fsdp_cpu_offload, sequence_parallel=cfg.distributed.sequence_parallel, tiled_mlp=cfg.model.tiled_mlp,
        tensor_parallel=cfg.distributed.tensor_parallel, expert_parallel=cfg.distributed.expert_parallel,
    )


def row_tokens(cfg: RunConfig) -> int:
    """A micro-batch row's tokens at most: data.max_seq_len, or GRPO's group row: num_generations sequences each of a prompt
    (max_seq_len: the longest) and its completion (an environment's episode: max_episode_tokens in all)."""
    g = cfg.grpo
    if cfg.train.objective != "grpo":
        return cfg.data.max_seq_len
    return g.num_generations * (g.max_episode_tokens if g.environment else cfg.data.max_seq_len + g.max_completion_length)


def completion_tokens(cfg: RunConfig, s: Setup) -> float:
    """GRPO: a micro-batch's trained tokens one device holds, every completion at its longest (an episode's assistant
    turns: max_turns of them)."""
    g = cfg.grpo
    longest = min(g.max_turns * g.max_completion_length, g.max_episode_tokens) if g.environment else g.max_completion_length
    return s.micro_batch * g.num_generations * longest / s.sequence_parallel


def sampling_cache(shape: Shape, s: Setup) -> float:
    """GRPO's sampling: the key/value cache of a micro-batch's group rows, every layer's keys and values at every token
    (a linear-attention layer's state is counted as if it were attention's)."""
    return s.tokens * shape.layers * 2 * shape.kv_dim * s.activation_bytes


def adapted(shape: Shape, cfg: RunConfig) -> list[Linear]:
    """The layers LoRA/DoRA wraps, as model.apply_adapter chooses them: all-linear is every linear layer
    and expert weight but the routers; DoRA cannot wrap expert weights; names peft maps onto the experts
    are left out (loading.mapped_onto_experts)."""
    from finetune.model.loading import mapped_onto_experts

    wanted = cfg.adapter.target_modules
    if wanted == "all-linear":
        layers = [l for l in shape.linears if not l.router]
    else:
        layers = [l for l in shape.linears if (l.expert and "experts" in wanted) or (not l.expert and l.name.rsplit(".", 1)[-1] in wanted)]
    lost = mapped_onto_experts(families.text_config(shape.config).get("model_type", ""))
    return [l for l in layers if not (l.expert and cfg.adapter.method == "dora") and (l.expert or l.name.rsplit(".", 1)[-1] not in lost)]


def trainable_params(shape: Shape, cfg: RunConfig) -> int:
    if cfg.adapter.method == "full":
        return shape.linear_params + shape.other_params
    r, dora = cfg.adapter.r, cfg.adapter.method == "dora"
    return sum((r * (l.fan_in + l.fan_out) + (l.fan_out if dora else 0)) * l.copies for l in adapted(shape, cfg))


def estimate(shape: Shape, cfg: RunConfig, s: Setup) -> tuple[dict[str, float], str, float]:
    """Bytes per device, by row, at the step's peak, that moment (see step_moments), and its activations (where it holds
    none, DeepSpeed's optimizer step, those of the largest moment that holds some)."""
    n_train = trainable_params(shape, cfg)
    full = s.method == "full"
    base = base_weights(shape, cfg.model.quantization, s)
    adapter = 0 if full else n_train * 4  # peft keeps adapter weights in fp32
    param_bytes = s.weight_bytes if full else 4
    grads = n_train * param_bytes
    # DeepSpeed's optimizer steps its fp32 master partition: its states are fp32 whatever the weights' dtype.
    state_bytes = 4 if s.run_as.deepspeed else param_bytes
    state = OPTIMIZER_STATE_BYTES.get(s.optimizer)
    if s.optimizer == "sgd":
        state = state_bytes if cfg.train.momentum > 0 else 0
    optimizer = n_train * (2 * state_bytes if state is None else state)
    # Sharding: ZeRO-2 splits gradients and optimizer states, ZeRO-3/FSDP the weights too.
    if s.shards_states:
        grads, optimizer = grads / s.devices, optimizer / s.devices
    weights = base + adapter
    moments = step_moments(shape, cfg, s)
    moment, peak = max(moments.items(), key=lambda item: item[1].total)
    rows = {"weights": weights, "gradients": grads, "optimizer states": optimizer, "activations": peak.activations}
    if s.shards_weights:
        whole = spread_experts(shape, s)  # each device's share of the experts, outside FSDP2's shards
        rows["weights"] = (weights - whole) / s.devices + whole
        rows["gathered for compute"] = peak.gathered
    if s.run_as.deepspeed:  # DeepSpeed's optimizer keeps an fp32 copy of its partition, even of fp32 weights
        rows["fp32 master weights (DeepSpeed)"] = n_train * 4 / s.devices
    if s.run_as.name == "ddp" and s.devices > 1:  # its reducer's buckets: a copy of every trained gradient (docs/platform-notes.md)
        rows["gradient buckets (DDP)"] = n_train * param_bytes
    if cfg.needs_reference:  # a frozen copy of the base, held as the policy is (adapters: the base with them off)
        rows["reference model"] = base / s.devices if s.shards_weights else base
    if cfg.train.objective == "grpo" and cfg.grpo.async_rollouts:  # the trained weights' copies that sample ahead (frozen ones shared)
        rows["async rollouts' policy copy"] = n_train * param_bytes * cfg.grpo.async_rollouts
    if cfg.train.objective == "distill" and cfg.distill.teacher:
        rows["distill teacher weights"], rows["distill teacher outputs"] = teacher_rows(cfg, s)
    if peak.temporaries:
        rows["dense weight temporaries"] = peak.temporaries
    if peak.fp32_gradients:
        rows["fp32 gradients (DeepSpeed step)"] = peak.fp32_gradients
    if shape.vision is not None:
        rows["vision tower + projector"], rows["vision tower activations"] = vision_rows(shape.vision, cfg, s)
    held = peak if peak.activations else max((m for m in moments.values() if m.activations), key=lambda m: m.total, default=peak)
    return rows, moment, held.activations


def vision_rows(v: VisionShape, cfg: RunConfig, s: Setup) -> tuple[float, float]:
    """(the tower's and projector's weights, never quantized, what its forward holds): one picture a row. Frozen, the
    tower saves nothing for the backward and holds one layer's values at a time; adapted or trained, each
    layer's (a Llama-like block's 6 h + 4 i values per patch) until the backward."""
    layers = v.layers if cfg.adapter.vision != "frozen" else 1
    trained = v.params * (s.weight_bytes + 4 + 8) if cfg.adapter.vision == "full" else 0  # gradients and AdamW's two fp32 states
    patches = v.patches_of(cfg.model.processor)
    return v.params * s.weight_bytes + trained, s.micro_batch * patches * (6 * v.hidden + 4 * v.intermediate) * s.activation_bytes * layers


def spread_experts(shape: Shape, s: Setup) -> float:
    """FSDP2 with the experts spread (distributed.expert_parallel, a 16-bit base): the bytes of this device's share of the
    expert stacks, held whole outside FSDP2's shards and never gathered; 0 otherwise."""
    if not (s.shards_weights and s.expert_parallel > 1):
        return 0.0
    return shape.expert_params / s.expert_parallel * s.weight_bytes


def base_weights(shape: Shape, q: QuantizationConfig | None, s: Setup) -> float:
    """A frozen base's weights, quantized by `q` (the rest in the model's dtype: model/loading.py leaves it as loaded) or
    all in the model's dtype, with its buffers; under expert parallelism this process's share of the experts."""
    if s.expert_parallel > 1:
        shape = replace(shape, linears=tuple(replace(l, copies=l.copies // s.expert_parallel) if l.expert else l for l in shape.linears))
    if q is None:
        return (shape.linear_params + shape.other_params) * s.weight_bytes + shape.buffers(s.weight_bytes)
    packed = shape.quantized_params(q.bits)
    experts = shape.linear_params - packed - sum(l.params for l in shape.linears if l.router)  # 8-bit: the expert stacks, int8 (model/experts)
    kept = shape.linear_params - packed - experts + shape.other_params
    if q.bits == 4:
        per_param = 0.5 + (1 / BNB_BLOCK + 4 / (BNB_BLOCK * 256) if q.double_quant else 4 / BNB_BLOCK)
        base = packed * per_param + kept * s.weight_bytes + quantized_layers(shape, 4) * (NF4_STATE_DOUBLE if q.double_quant else NF4_STATE)
    else:
        # one fp32 scale per output row, of the linear layers (bitsandbytes) and of the expert stacks (model/experts)
        scales = sum(l.fan_out * l.copies for l in shape.linears if not l.router) * 4
        base = packed * 1 + scales + kept * s.weight_bytes + experts * 1
    return base + shape.buffers(s.weight_bytes)  # the rotary frequencies (and Gemma's embedding scale)


def teacher_rows(cfg: RunConfig, s: Setup) -> tuple[float, float]:
    """Distillation's frozen teacher: (its weights, in the student's dtype or distill.teacher_quantization's, sharded as
    the student's are; what its forward leaves for the loss). Without gradients its forward holds one layer's values at a time (as
    wide as the student's in the worst case: counted within the student's activations' peak), and leaves its
    final hidden states at the trained tokens, or (a sharded or biased head) its logits there, in the activations' dtype
    (the divergence takes them to fp32 a chunk at a time: the simulated step of Llama-3.2-1B taught by Llama-3.1-8B's
    widths held 14 bytes a vocabulary entry at the loss, the student's 12 and these 2)."""
    teacher, q = teacher_shape(cfg), cfg.distill.teacher_quantization
    weights = base_weights(teacher, q, s)
    if s.shards_weights:
        weights /= s.devices
    fused = families.plain_head(teacher.config) and not s.shards_weights
    return weights, s.tokens * (teacher.hidden if fused else teacher.vocab) * s.activation_bytes


def teacher_shape(cfg: RunConfig) -> Shape:
    """distill.teacher's shape: an adapter's base's (merged into it as it loads)."""
    folder = Path(cfg.distill.teacher).expanduser()
    if (folder / "adapter_config.json").is_file():
        folder = Path(json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path", folder))
    return read_shape(str(folder))


def quantized_layers(shape: Shape, bits: int) -> int:
    """Quantized weights, each with its quantization state (an expert counted as one: its slice's state is as small)."""
    return sum(layer.copies for layer in shape.quantized(bits))


def dense_temporaries(shape: Shape, cfg: RunConfig, s: Setup) -> float:
    """Weight-sized tensors one adapted linear layer makes in each forward and backward (worst layer): a
    quantized base dequantizes its weight (bitsandbytes' 4-bit: into the compute dtype, then cast for
    the matmul; torchao's NF4 holds 7 times the compute dtype's bytes at its peak, its codes unpacked
    and looked up: 3,143 MiB measured for an 8192 x 28672 weight in bf16, on real and fake tensors alike),
    and peft's DoRA builds B @ A through an identity of fan_in x fan_in, adds it to the weight and takes
    the norm (measured: 259 MB for a 5632 -> 2048 layer; this formula says 253)."""
    layers = adapted(shape, cfg) if s.method != "full" else []
    if not layers:
        return 0.0
    size = 0.0
    if s.bits:  # set from cfg.model.quantization (the QLoRA alternative sets both)
        compute = DTYPE_BYTES[cfg.model.quantization.compute_dtype]
        size = max(l.fan_in * l.fan_out for l in layers if not l.expert) * (7 * compute if torchao_base(cfg, s) else compute + 4)
        if s.bits == 4 and any(l.expert for l in shape.linears):
            # a chunk of a layer's expert stack dequantized (model/experts.py rows_of), beside it its int32 code-pair index
            # (2 bytes a weight) or its cast to the routed tokens' dtype
            stack = max(l.fan_in * l.fan_out for l in shape.linears if l.expert) * max(1, families.num_experts(shape.config))
            beside = max(2, s.activation_bytes if s.activation_bytes != compute else 0)
            size = max(size, min(stack, experts.CHUNK) * (compute + beside))
    if s.method == "dora":
        size = max(size, max((l.fan_in ** 2 + 3 * l.fan_in * l.fan_out) * 4 for l in layers))
    return size


def heap_holes(shape: Shape, cfg: RunConfig, s: Setup) -> float:
    """What glibc's heap holds beyond live tensors on a CPU run (runtime.keep_freed_memory; not under
    FSDP/ZeRO-3): freed blocks split by the small tensors kept after them, which the next layer's
    blocks cannot reuse. DoRA (freed memory kept in the heap): about one fp32 copy of the largest
    adapted weight per layer in the forward and again in the backward's recompute, measured on the
    1.1B model with checkpointing (docs/platform-notes.md); a quantized base: below."""
    if s.shards_weights or s.tokens >= LONG_ROWS or not dense_temporaries(shape, cfg, s) or glibc_tuned_by_user():
        return 0.0  # sharded or long rows (large blocks mapped); nothing weight-sized freed; or glibc tuned by the user (left alone)
    if s.bits:  # with checkpointing (without it every layer's activations are held anyway: counted above)
        # Dequantized weights of MAPPED_FROM and more come from fresh mappings, returned when freed,
        # and glibc trims the heap (runtime.keep_freed_memory); what stays split is each layer's
        # recomputed activations, freed in the backward around the gradient kept for the layer below.
        # Llama-3-8B's widths (fp32 compute, 512 tokens): the runs peaked at 0.95 of this plan with 32
        # layers and 0.92 with 8; the 1.1B model (256 tokens): 0.98 (docs/platform-notes.md).
        return shape.layers * layer_activations(shape, s) if s.checkpointing else 0.0
    return 2 * shape.layers * max(l.fan_in * l.fan_out for l in adapted(shape, cfg)) * 4


def dropped_inputs(shape: Shape, cfg: RunConfig, s: Setup) -> float:
    """LoRA dropout (adapter.dropout > 0): each adapted layer keeps its input after dropout for the backward, and the
    dropout's 1-byte mask, beside what the layer keeps anyway (590 MiB beside Qwen2.5-0.5B's other 1,230 MiB at 512
    tokens; bench/released.py). With checkpointing one rebuilt layer's worth. Experts take no dropout (model/experts.py)."""
    if s.method == "full" or cfg.adapter.dropout == 0:
        return 0.0
    values = sum(l.fan_in * l.copies for l in adapted(shape, cfg) if not l.expert) * s.tokens * (s.activation_bytes + 1)
    return values / shape.layers if s.checkpointing else values


def layer_activations(shape: Shape, s: Setup) -> float:
    """What one decoder layer keeps for its backward without checkpointing, per device: per token a Llama
    block keeps 6*h + 2*kv + 4*i values (the two norms' inputs and outputs, the outputs being the
    projections' inputs; the rotated query, key and value; the attention output; the MLP's gate, up,
    activation and product; i is the MLP width a token passes through, with experts the routed ones' and
    the shared one's), its MLP's share for one chunk where the MLP is tiled. Sequence parallelism: a
    device holds 1/N of each row's tokens (and, inside attention, the whole row for 1/N of the heads:
    as many values). With experts (model/experts.py) the routed copies of a token are not kept (their LoRA makes them
    again in the backward), but where the routing weight scales each expert's output (UNFOLDED_ROUTING) that output is;
    where the rest of the layer runs a chunk of rows at a time (chunked_width) only the first projection's 2 of their 4."""
    values = shape.attention_values + 4 * shape.mlp_width / s.tiled_mlp + routed_outputs(shape) - 2 * chunked_width(shape, s)
    fp32 = shape.fp32_values * 4 + shape.norm_inputs * max(0, 4 - s.activation_bytes)  # the norms' inputs: the rest of fp32's bytes
    return values * s.activation_bytes * s.tokens + fp32 * s.tokens + sink_attention(shape, s)[0]


def routed_copies(shape: Shape) -> float:
    """How many experts a token is routed to in a layer (0 without experts)."""
    return next((l.active for l in shape.linears if l.expert), 0) / shape.layers


def routed_outputs(shape: Shape) -> float:
    """The experts' outputs a MoE layer keeps a token, for the routing weights' gradient: where they scale the outputs."""
    return shape.hidden * routed_copies(shape) if unfolded(shape) else 0.0


def unfolded(shape: Shape) -> bool:
    """Whether the routing weight scales each expert's output rather than the down projection's input (UNFOLDED_ROUTING)."""
    return families.text_config(shape.config).get("model_type") in families.UNFOLDED_ROUTING


def chunked_width(shape: Shape, s: Setup) -> float:
    """The experts' width a token passes through (top_k times each one's) where the rest of a MoE layer runs a chunk of
    routed rows at a time (experts.RoutedDown: frozen experts whose routing weight folds into the down projection's input),
    else 0."""
    if s.method == "full" or unfolded(shape):
        return 0.0
    return up_width([layer for layer in shape.linears if layer.expert]) / shape.layers


def routed_backward(shape: Shape, s: Setup) -> float:
    """What a MoE layer's backward holds a token beyond a dense MLP's (model/experts.py): where the rest of the layer runs
    chunked (chunked_width) nothing, the first projection's output gradient being two of the experts' width, the rest a
    chunk's; else the gradient of each routed copy's output, hidden-wide, while the down projection's backward reads it.
    The routed copies' input gradients are summed into the tokens' a chunk at a time (experts.per_token), and the LoRA's
    product added a chunk at a time (experts.AddedLow)."""
    return 0.0 if chunked_width(shape, s) else shape.hidden * routed_copies(shape)


def adapter_outputs(shape: Shape, cfg: RunConfig, s: Setup) -> float:
    """peft's LoRA adds its B matrix's output, scaled, to the base layer's: two more outputs of the widest adapted layer
    while it computes, kept for no backward (Llama-3.1-70B's widths over 64, checkpointed: the simulated first layer's
    forward held 0.40 GiB beyond the layer's saved values; these are 0.44)."""
    if s.method == "full":
        return 0.0
    return 2 * max((l.fan_out for l in adapted(shape, cfg) if not l.expert), default=0) * s.activation_bytes * s.tokens


def sink_attention(shape: Shape, s: Setup) -> tuple[float, float]:
    """Attention with sinks (gpt-oss), per device: (what a layer keeps for its backward beyond the plain attention's
    values, what its backward holds while it computes). One sample a row, of seq_len tokens: the planner's worst case.

    Through torch's sdpa (a GPU's rows, a CPU's samples over short_sample() tokens: model/attention.py's _with_sink_key) a
    layer keeps its query, keys, values and output widened by the sink's column and padded to a multiple of 8; its
    backward holds their gradients, and the forward's additive mask of len x (1 + len), made once for every layer (a
    GPU's a row, a CPU's a sample length).
    Through finetune's textbook kernel (a CPU's shorter samples) its fp32 probabilities, heads x len² a sample: up to
    KEPT_PROBS a layer keeps them all; past it none, and the backward computes them again a chunk of heads at a time,
    holding a chunk's scores, probabilities and their gradients (4 of them) at once."""
    c = families.text_config(shape.config)
    if c.get("model_type") not in families.ATTENTION_SINKS:
        return 0.0, 0.0
    import torch

    from finetune.model.attention import KEPT_PROBS, short_sample, sink_width

    heads, length = c["num_attention_heads"], s.seq_len
    kv_heads, dim = c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads
    if s.accelerator or length > short_sample(torch.bfloat16 if s.activation_bytes == 2 else torch.float32, dim, dim**-0.5):
        width = sink_width(dim)
        widened = (2 * heads + 2 * kv_heads) * s.tokens * s.activation_bytes
        mask = (s.micro_batch if s.accelerator else 1) * length * (length + 1) * s.activation_bytes
        return widened * (width - dim), (heads + 2 * kv_heads) * width * s.tokens * s.activation_bytes + mask
    one_head = length * (length + 1) * 4
    whole = s.micro_batch * heads * one_head
    if whole <= KEPT_PROBS:
        return whole, 3 * whole
    groups = heads // kv_heads
    return 0.0, 4 * groups * one_head * max(1, KEPT_PROBS // (groups * one_head))


@dataclass(frozen=True)
class Moment:
    activations: float  # what the forward saved for the backward, and what this moment adds to it
    gathered: float = 0.0  # weights (and full fine-tuning's gradients) held unsharded: FSDP/ZeRO-3
    temporaries: float = 0.0  # dense weight temporaries of the layer computing (dense_temporaries)
    fp32_gradients: float = 0.0  # DeepSpeed's step: its fp32 copy of the gradient partition (deepspeed_step)

    @property
    def total(self) -> float:
        return self.activations + self.gathered + self.temporaries + self.fp32_gradients


def step_moments(shape: Shape, cfg: RunConfig, s: Setup) -> dict[str, Moment]:
    """The moments of the step that may hold the most beyond the weights, gradients and optimizer states, and
    what each holds then (the plan's peak is the largest). Moments, not rows added up: the loss's logits are gone before the backward
    rebuilds a layer, and FSDP2 reshards the root (embeddings, lm_head) after the forward, so no weight
    is gathered while the loss runs. Measured against `finetune plan --simulate` (docs/planning.md).

    With checkpointing each layer keeps its input (the residual stream) until its backward; a layer's
    backward rebuilds that layer's saved tensors and, while the MLP's input gradients form, two more
    of its intermediates (2*i values a token: its product is freed by then, as the simulation's tensors show at
    Llama-3.1-8B's widths). A tiled MLP keeps only its input, and holds its
    intermediates for one chunk at a time, in the backward."""
    full = s.method == "full"
    per_layer, dropped = layer_activations(shape, s), dropped_inputs(shape, cfg, s)
    # what a layer's backward holds beside its saved tensors: the MLP's input gradients, and sink attention's chunk
    in_backward = (2 * shape.mlp_width / s.tiled_mlp + routed_backward(shape, s)) * s.activation_bytes * s.tokens + sink_attention(shape, s)[1]
    if s.checkpointing:
        saved, rebuilt = shape.layers * s.tokens * shape.hidden * s.weight_bytes, per_layer + dropped + in_backward
    else:
        chunk = 4 * shape.mlp_width / s.tiled_mlp * s.activation_bytes * s.tokens if s.tiled_mlp > 1 else 0.0
        saved, rebuilt = shape.layers * (per_layer - chunk) + dropped, chunk + in_backward
    temporaries = dense_temporaries(shape, cfg, s)
    moments = {"the loss": Moment(saved + loss_activations(shape, cfg, s))}
    if cfg.train.objective == "grpo":  # before the step's forward: nothing saved yet, each layer gathered in turn
        root, layer = gathered_weights(shape, cfg, s) if s.shards_weights else (0.0, 0.0)
        moments["GRPO's sampling"] = Moment(sampling_cache(shape, s), 2 * root + layer)
    if s.run_as.deepspeed and not s.offloads:
        moments["the optimizer's step"] = Moment(0.0, fp32_gradients=deepspeed_step(shape, cfg, s))
    if not s.shards_weights:
        moments["a layer's backward"] = Moment(saved + rebuilt, temporaries=temporaries)
        return moments
    root, layer = gathered_weights(shape, cfg, s)
    # FSDP2 keeps the last all-gather's output until the next one is copied out: the root's while the
    # first layer computes (a 4-bit base's layer: only until its weights are dequantized, which comes first), and a
    # layer's beside its per-parameter copies (ZeRO-3 prefetches instead). Checkpointed, that forward keeps nothing for a
    # backward: a delta rule's fp32 intermediates go chunk by chunk.
    forward = (per_layer - shape.fp32_values * 4 * s.tokens if s.checkpointing else per_layer) + adapter_outputs(shape, cfg, s)
    if not torchao_base(cfg, s):
        moments["the first layer's forward"] = Moment(forward, 2 * root + layer)
    else:  # held while the 4-bit layer gathers, or while it computes
        moments["the first layer's forward"] = Moment(0.0, 2 * root + layer) if forward < root else Moment(forward, root + layer)
    if cfg.runs_reference:  # the policy's forward done: its saved tensors and kept fp32 log-softmax beside the reference's
        # first layer, gathered with the next (GRPO's Llama-3.1-8B LoRA step over 8, simulated: 2 roots and 2 layers)
        kept = (completion_tokens(cfg, s) if cfg.train.objective == "grpo" else s.tokens) * shape.vocab * 4
        transient = shape.mlp_width * s.tokens * s.activation_bytes  # a layer's forward without gradients keeps nothing
        moments["the reference's forward"] = Moment(saved + kept + transient, 2 * root + 2 * layer)
    # The forward's end: every layer's saved tensors kept, the root gathered again (with its all-gather buffer) for the head, whose
    # logits it makes (under FSDP the loss takes them whole). Tensor parallelism leaves the root whole and its layers
    # small: Llama-3.1-405B's step over 64 x 8 peaks here (bench/results/scale.md).
    if s.run_as.name == "fsdp":
        moments["the head's forward"] = Moment(saved + s.tokens * head_width(shape, cfg) * s.activation_bytes, 2 * root)
    # Full fine-tuning: the lm_head's gradient, unsharded until the root's reduce-scatter at the backward's
    # end, and the layer's, in the weights' dtype and cast to fp32 for its reduce-scatter (3 layers' worth).
    grads = head_width(shape, cfg) * shape.hidden * s.weight_bytes + 3 * layer if full else 0.0
    moments["the last layer's backward"] = Moment(saved + rebuilt, root + 2 * layer + grads, temporaries)
    if full and s.run_as.name == "fsdp":  # then the root's: one of its matrices' gradients still held, and all of them in fp32
        moments["the root's reduce-scatter"] = Moment(0.0, shape.vocab * shape.hidden * s.weight_bytes + 2 * root)
    return moments


def deepspeed_step(shape: Shape, cfg: RunConfig, s: Setup) -> float:
    """DeepSpeed's optimizer step casts the gradient partition to fp32 beside the 16-bit one it reduced (what its own
    estimator counts as 4 bytes of fp32 gradients a parameter): ZeRO-2 the whole partition at once, ZeRO-3 one sub-group at
    a time, which finetune sizes to the largest decoder layer (parallel/distributed.deepspeed_config)."""
    partition = trainable_params(shape, cfg) / s.devices
    if s.run_as.zero_stage == 3:
        partition = min(partition, shape.linear_params / shape.layers)
    return partition * 4


def gathered_weights(shape: Shape, cfg: RunConfig, s: Setup) -> tuple[float, float]:
    """FSDP/ZeRO-3: the root's weights (embeddings, lm_head, norms) and one decoder layer's, gathered as
    they are held: a quantized base's linear weights packed (4 or 8 bits), the rest as loaded."""
    if s.bits:
        packed = shape.quantized_params(s.bits)
        return shape.other_params * s.weight_bytes, (packed * (0.5 if s.bits == 4 else 1) + (shape.linear_params - packed) * s.weight_bytes) / shape.layers
    spread = shape.expert_params if s.expert_parallel > 1 else 0  # the experts stay where they are
    return shape.other_params * s.weight_bytes, (shape.linear_params - spread) / shape.layers * s.weight_bytes


def torchao_base(cfg: RunConfig, s: Setup) -> bool:
    """A 4-bit base quantized by torchao, not bitsandbytes (model.quantization.backend; auto: torchao under FSDP)."""
    q = cfg.model.quantization
    return q is not None and q.backend_for(s.strategy if s.strategy != "none" else cfg.distributed.strategy) == "torchao"


def run_shape(cfg: RunConfig) -> Shape:
    """The model's shape as the run holds it: a reward model has no lm_head (its score head, one output a token:
    head_width, is too small to count)."""
    shape = read_shape(cfg.model.name_or_path)
    return replace(shape, tied=True) if cfg.train.objective == "reward" else shape


def head_width(shape: Shape, cfg: RunConfig) -> int:
    """The head's outputs a token: the vocabulary's logits, or a reward model's one score."""
    return 1 if cfg.train.objective == "reward" else shape.vocab


def loss_activations(shape: Shape, cfg: RunConfig, s: Setup) -> float:
    """The loss's share. Where the fused loss runs (SFT, a plain lm_head, unsharded: loss.fusable_parts) the
    logits exist a chunk at a time: it holds the trained tokens' final hidden states and their
    gradient, and a chunk's logits, log-softmax and gradient in fp32. Otherwise 12 bytes per vocabulary
    entry at the log-softmax's backward: its saved fp32 output, the gradient coming in and the one going
    out (the forward held less: the model's logits, an fp32 copy and the log-softmax). A preference objective
    takes its answers' log-probabilities so (objective.token_logps); DPO's and KTO's reference forward then makes
    its own logits, fp32 copy and log-softmax beside the policy's kept log-softmax: 14 bytes (the simulation of
    Llama-3.1-8B's DPO step). GRPO takes its completions' so, its KL term's reference forward as DPO's. Every token is
    counted as trained (GRPO's: every completion token)."""
    if cfg.train.objective == "grpo":
        return completion_tokens(cfg, s) * shape.vocab * (14 if cfg.runs_reference else 12)
    if cfg.train.objective in ("dpo", "orpo", "cpo", "simpo", "kto"):
        return s.tokens * shape.vocab * (14 if cfg.train.objective in ("dpo", "kto") else 12)
    if cfg.train.objective == "reward":  # the final hidden states the score head keeps, and their gradient
        return 2 * s.tokens * shape.hidden * s.activation_bytes
    if families.plain_head(shape.config) and not s.shards_weights:
        from finetune.objectives.loss import CHUNK_ELEMENTS

        return 2 * s.tokens * shape.hidden * s.activation_bytes + 3 * CHUNK_ELEMENTS * 4
    # beside the final norm's fp32 input, and under full fine-tuning its fp32 output for the norm weight's gradient (the
    # simulated loss of Llama-3.1-8B over 8: 64 MiB more under LoRA, 130 under full fine-tuning)
    return s.tokens * shape.vocab * 12 + s.tokens * shape.hidden * (8 if s.method == "full" else 4)


def longest_row(cfg: RunConfig, s: Setup, budget: float, gpu: bool) -> int:
    """The longest row (tokens, a multiple of 64) whose plan fits `budget` per device, micro-batches of one row."""
    low, high = 0, 64
    fits = lambda n: make_plan(cfg, gpu=gpu, setup=replace(s, micro_batch=1, seq_len=n)).total <= budget  # noqa: E731
    while fits(high) and high < 2**24:
        low, high = high, high * 2
    while high - low > 64:
        middle = (low + high) // 2 // 64 * 64
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@dataclass
class Plan:
    rows: dict[str, float]
    total: float
    setup: Setup
    trainable: int
    total_params: int
    active_params: int  # per token: differs from total_params with experts
    unquantized_experts: int  # router (and at 8 bits expert) weights a quantized base keeps unquantized
    host: dict[str, float] = field(default_factory=dict)  # offloaded to CPU RAM, per process
    refused: str | None = None  # what `finetune train` would refuse in this setup (the schema's own checks)
    moment: str = ""  # when in the step the rows are held together (step_moments)
    activations: float = 0.0  # the peak moment's activations, or (it holds none: DeepSpeed's step) the largest moment's that holds some
    loading: float = 0.0  # what a process holds while its base loads, where that is more than the base (load_peak), or 0
    loads_on_host: bool = False  # that load is in CPU RAM, not on the GPU (a torchao base: quantized on the host, then moved)
    unloaded_mtp: int = 0  # the checkpoint's multi-token-prediction layers (Qwen3.5's mtp.*), which transformers does not load


def refusal(cfg: RunConfig, s: Setup) -> str | None:
    """Why `finetune train` would refuse the config changed to this setup, in the line it would say, or None."""
    from finetune.config.schema import validate_config

    raw = cfg.model_dump()
    raw["distributed"].update(strategy=s.strategy if s.devices > 1 else raw["distributed"]["strategy"], fsdp_cpu_offload=s.fsdp_cpu_offload,
                              sequence_parallel=s.sequence_parallel, tensor_parallel=s.tensor_parallel)
    raw["train"].update(optimizer=s.optimizer, micro_batch_size=s.micro_batch, gradient_checkpointing=s.checkpointing)
    raw["model"]["tiled_mlp"] = s.tiled_mlp
    try:
        validate_config(raw, "config", check_paths=False)
    except UserError as err:
        return str(err).removeprefix("config: ")
    return None


def make_plan(cfg: RunConfig, devices: int = 1, strategy: str | None = None, gpu: bool = False, setup: Setup | None = None) -> Plan:
    """strategy: as distributed.strategy names it (default: the config's). On GPUs, ZeRO-3 offload and
    FSDP's CPU offload keep the sharded weights, gradients and optimizer states in CPU RAM (`host`); the
    device holds what is gathered for compute, the activations and the temporaries."""
    whole = run_shape(cfg)
    setup = setup or setup_from_config(cfg, devices, strategy)
    shape, per_split = split_shape(whole, setup.tensor_parallel), replace(setup, devices=setup.devices // setup.tensor_parallel, accelerator=gpu)
    rows, moment, activations = estimate(shape, cfg, per_split)
    host = {}
    if gpu and setup.offloads:
        host = {name: rows.pop(name) for name in ("weights", "gradients", "optimizer states", "fp32 master weights (DeepSpeed)") if name in rows}
    if gpu:
        rows["CUDA context + allocator slack"] = GPU_RESERVE
    else:
        rows["process runtime (CPU)"] = CPU_RUNTIME
        if heap_holes(shape, cfg, setup):
            rows["freed but held by the heap (CPU)"] = heap_holes(shape, cfg, setup)
    pictures = whole.vision.params if whole.vision else 0
    loading, on_host = load_peak(shape, cfg, per_split)
    if loading and gpu and not on_host:
        loading += GPU_RESERVE
    return Plan(rows, sum(rows.values()), setup, trainable_params(whole, cfg), whole.linear_params + whole.other_params + pictures,
                whole.active_params + pictures, whole.linear_params - whole.quantized_params(setup.bits or 16), host, moment=moment,
                activations=activations, loading=loading, loads_on_host=on_host and gpu,
                unloaded_mtp=int(families.text_config(shape.config).get("mtp_num_hidden_layers") or 0))


def load_peak(shape: Shape, cfg: RunConfig, s: Setup) -> tuple[float, bool]:
    """(What a process holds while a quantized base loads, on the host or not), where it is not quantized layer by layer
    as transformers loads it. The expert stacks of a 4-bit or 8-bit base are quantized as they load
    (experts.quantized_as_loaded: the largest held in the model's dtype with its quantizing copies beside the quantized
    rest); a torchao base's linear layers are quantized once the adapter is on, on the host (accelerate then moves the 4-bit
    model): until then the base holds them as loaded, with the adapter, and quantizing the largest holds its copy in the
    compute dtype and what nf4.to_nf4 holds beside it.
    Under DeepSpeed (ZeRO-2) the stacks load as stored and stay so. No training has run yet: a CPU process has not grown by
    CPU_RUNTIME. Sharded loads (FSDP, ZeRO-3) go layer by layer: (0, False)."""
    q = cfg.model.quantization
    if q is None or s.shards_weights:
        return 0.0, False
    torchao, stored = torchao_base(cfg, s), s.run_as.deepspeed
    late = [l for l in shape.linears if not l.router and ((torchao and not l.expert and l in shape.quantized(q.bits)) or (stored and l.expert))]
    stacks = [l for l in shape.linears if l.expert and not stored]
    if not late and not stacks:
        return 0.0, False
    quantized_bytes = 0.5 + (1 / BNB_BLOCK + 4 / (BNB_BLOCK * 256) if q.double_quant else 4 / BNB_BLOCK) if q.bits == 4 else 1
    compute, experts = DTYPE_BYTES[q.compute_dtype], max(1, families.num_experts(shape.config))

    def quantizing(layers: list, loaded: float) -> float:
        """The largest of `layers` quantized: `loaded` bytes a weight more than `held` counts, its copy in the compute dtype
        and what 4-bit quantizing holds beside it, or bitsandbytes' 8-bit (8 bytes a weight, bf16 or fp32: platform-notes)."""
        largest = max((l.fan_in * l.fan_out * (experts if l.expert else 1) for l in layers), default=0)
        beside = 8 * largest if q.bits == 8 else largest * (compute if compute != s.weight_bytes else 0) + nf4.quantizing_bytes(largest, compute)
        return largest * loaded + beside if largest else 0.0

    held = base_weights(shape, q, s) + sum(l.params for l in late) * (s.weight_bytes - quantized_bytes)
    adapting = held + trainable_params(shape, cfg) * 4 + quantizing(late, 0) if late else 0.0
    return max(held + quantizing(stacks, s.weight_bytes - quantized_bytes), adapting), torchao


def split_shape(shape: Shape, size: int) -> Shape:
    """What one of `size` tensor-parallel processes holds of each layer (parallel/tensor_parallel.py): column-wise layers
    a 1/size share of their outputs, row-wise ones of their inputs (an adapter's matrices follow), the MLP's width and the
    attention's heads split; norms, embeddings and the head whole. The plan then shards that over the other devices."""
    if size == 1:
        return shape
    from finetune.parallel.tensor_parallel import styles

    style = styles(shape.config)
    linears = tuple(replace(l, fan_out=l.fan_out // size) if style.get(l.name.rsplit(".", 1)[-1]) == "colwise" else
                    replace(l, fan_in=l.fan_in // size) if style.get(l.name.rsplit(".", 1)[-1]) == "rowwise" else l for l in shape.linears)
    split_attention = 2 * shape.hidden + 2 * shape.kv_dim  # the query, key, value and attention output a layer keeps
    return replace(shape, linears=linears, mlp_width=shape.mlp_width // size, kv_dim=shape.kv_dim // size,
                   attention_values=shape.attention_values - split_attention + split_attention // size)


def checked_plan(cfg: RunConfig, devices: int = 1, strategy: str | None = None, gpu: bool = False, setup: Setup | None = None) -> Plan:
    """make_plan, with what `finetune train` would refuse in that setup (a schema validation: not for the searches)."""
    plan = make_plan(cfg, devices, strategy, gpu, setup)
    return replace(plan, refused=refusal(cfg, plan.setup) or uneven_nf4_rows(read_shape(cfg.model.name_or_path), cfg, plan.setup))


def uneven_nf4_rows(shape: Shape, cfg: RunConfig, s: Setup) -> str | None:
    """torchao's 4-bit weights under FSDP split by rows into equal shards: the line training refuses with
    where a weight's rows do not divide (Qwen2.5-72B's 29,568-row MLP over 512 processes), or None."""
    if not (torchao_base(cfg, s) and s.shards_weights):
        return None
    return nf4.uneven_rows({l.name: l.fan_out for l in shape.linears if not (l.expert or l.router)}, cfg.distributed.fsdp_shard_size or s.devices)


def alternatives(cfg: RunConfig, plan: Plan, gpu: bool) -> list[tuple[str, Plan]]:
    """Single switches that shrink the plan, each re-planned."""
    s = plan.setup
    options = []
    if not s.checkpointing:
        options.append(("train.gradient_checkpointing: true", replace(s, checkpointing=True)))
    if s.micro_batch > 1:
        half = max(1, s.micro_batch // 2)
        options.append((f"train.micro_batch_size: {half} (raise grad_accum to keep the batch)", replace(s, micro_batch=half)))
    if s.optimizer in ("adamw", "paged_adamw_32bit"):
        options.append(("train.optimizer: adamw_8bit", replace(s, optimizer="adamw_8bit")))
    if s.devices > 1 and not s.shards_weights:
        options.append((f"FSDP over {s.devices} devices (distributed.strategy: fsdp)", replace(s, strategy="fsdp")))
    if gpu and s.shards_weights and not s.offloads:
        options.append(("sharded states in CPU RAM (distributed.fsdp_cpu_offload: true, or strategy zero3_offload)",
                        replace(s, strategy="fsdp", fsdp_cpu_offload=True) if s.strategy == "fsdp" else replace(s, strategy="zero3_offload")))
    if s.tiled_mlp == 1:
        options.append(("model.tiled_mlp: 4 (long rows)", replace(s, tiled_mlp=4)))
    if s.devices > 1 and s.sequence_parallel == 1 and cfg.train.objective == "sft":
        options.append((f"distributed.sequence_parallel: {s.devices} (each row's tokens over the {s.devices} devices)",
                        replace(s, sequence_parallel=s.devices)))
    if plan.refused and s.devices > 1:  # the strategies train would run instead
        options += [(f"distributed.strategy: {name}", replace(s, strategy=name)) for name in ("ddp", "zero2", "zero3", "fsdp") if name != s.strategy]
    out = [(label, checked_plan(cfg, gpu=gpu, setup=alt)) for label, alt in options]
    if s.bits is None and cfg.adapter.method != "full":
        from finetune.config.schema import QuantizationConfig

        q = cfg.model_copy(deep=True)
        q.model.quantization = QuantizationConfig()
        out.append(("model.quantization: {bits: 4} (QLoRA)", checked_plan(q, gpu=gpu, setup=replace(s, bits=4))))
    return sorted([(label, p) for label, p in out if not p.refused], key=lambda item: item[1].total)


def render_rows(cfg: RunConfig, plan: Plan, budget: float, gpu: bool) -> str:
    """Long rows: the activations with and without a tiled MLP, and the longest row that fits a device
    as planned, with the MLP tiled, and (several devices) with each row over all of them. A mixture of experts has no
    tiled line: model.tiled_mlp tiles dense MLPs only."""
    s = plan.setup
    if plan.active_params < plan.total_params:
        return (f"activations per device: {plan.activations / GiB:.2f} GiB (model.tiled_mlp tiles dense MLPs only, not experts)\n"
                f"longest row that fits a device, one row a micro-batch: {longest_row(cfg, s, budget, gpu):,} tokens as planned")
    tiled = s if s.tiled_mlp > 1 else replace(s, tiled_mlp=4)
    other = make_plan(cfg, gpu=gpu, setup=replace(s, tiled_mlp=1) if s.tiled_mlp > 1 else tiled)
    pair = (plan, other) if s.tiled_mlp > 1 else (other, plan)
    lines = [f"activations per device: {pair[1].activations / GiB:.2f} GiB untiled, {pair[0].activations / GiB:.2f} GiB "
             f"with the MLP tiled x{tiled.tiled_mlp}"]
    longest = [f"{longest_row(cfg, s, budget, gpu):,} tokens as planned"]
    if s.tiled_mlp == 1:
        longest.append(f"{longest_row(cfg, tiled, budget, gpu):,} with the MLP tiled x4")
    if s.devices > 1 and s.sequence_parallel == 1 and cfg.train.objective == "sft":
        longest.append(f"{longest_row(cfg, replace(tiled, sequence_parallel=s.devices), budget, gpu):,} tiled and each row over the "
                       f"{s.devices} devices (distributed.sequence_parallel: {s.devices})")
    lines.append("longest row that fits a device, one row a micro-batch: " + "; ".join(longest))
    return "\n".join(lines)


def parse_size(text: str, option: str) -> float:
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    try:
        size = float(number) * units[t[len(number):]]
    except (KeyError, ValueError):
        size = 0.0
    if not size > 0:
        raise UserError(f"{option} {text}: expected a size like 80GiB or 24GB")
    return size


def available_memory() -> tuple[float, str]:
    """Memory of one device here: the GPU's, else this machine's available RAM."""
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024, "CPU RAM (available)"
    return math.inf, "CPU RAM"


def render(plan: Plan, budget: float, where: str, alts: list[tuple[str, Plan]]) -> str:
    s = plan.setup
    method = s.method if s.bits is None else f"{s.method} on a {s.bits}-bit base"
    unit, scale = ("GiB", GiB) if plan.total >= GiB else ("MiB", 2**20)
    lines = [
        f"plan: {method}, {plan.trainable:,} trainable of {plan.total_params:,} params"
        + (f" ({plan.active_params:,} active per token)" if plan.active_params != plan.total_params else "") + f", optimizer {s.optimizer}, "
        f"micro-batch {s.micro_batch} x {s.seq_len} tokens, activations in {8 * s.activation_bytes}-bit, "
        f"checkpointing {'on' if s.checkpointing else 'off'}, strategy {s.strategy} over {s.devices} device(s)"
        + (f", each row over {s.sequence_parallel} of them (sequence parallel)" if s.sequence_parallel > 1 else "")
        + (f", each layer split over {s.tensor_parallel} of them (tensor parallel)" if s.tensor_parallel > 1 else "")
        + (f", each layer's experts split over {s.expert_parallel} of them (expert parallel)" if s.expert_parallel > 1 else "")
        + (f", MLPs tiled x{s.tiled_mlp}" if s.tiled_mlp > 1 else ""),
        "",
        f"per device, at the step's peak ({plan.moment}):",
        "",
        f"| {'per device':<32} | {unit:>9} |",
        f"| {'-' * 32} | {'-' * 9} |",
    ]
    lines += [f"| {name:<32} | {value / scale:>9.2f} |" for name, value in plan.rows.items()]
    lines.append(f"| {'total':<32} | {plan.total / scale:>9.2f} |")
    if plan.host:
        lines.append("offloaded to CPU RAM, per process: " + ", ".join(f"{name} {value / GiB:.2f} GiB" for name, value in plan.host.items())
                     + f" ({sum(plan.host.values()) / GiB:.2f} GiB; x {s.devices} processes over the nodes)")
    if s.bits and plan.unquantized_experts:
        lines.append(f"note: {plan.unquantized_experts:,} router" + (" parameters stay unquantized" if s.bits == 4 else
                     " and expert parameters stay unquantized (8-bit quantizes linear layers; a 4-bit base its experts too)"))
    if plan.unloaded_mtp:
        lines.append(f"note: the checkpoint's {plan.unloaded_mtp} multi-token-prediction layer(s) (mtp.*) are not counted: transformers does not "
                     "load them, so finetune neither holds nor trains them (and its merge and GGUF export leave them out)")
    if plan.loading > (0 if plan.loads_on_host else plan.total):
        where_loaded = "of CPU RAM (torchao quantizes on the host, then the 4-bit model moves to the GPU)" if plan.loads_on_host else "per device"
        lines.append(f"loading: {plan.loading / GiB:.2f} GiB {where_loaded} while the base loads: each expert stack is quantized as "
                     "it loads, the largest held in the model's dtype meanwhile (a torchao base's linear layers: as loaded until the adapter is on)")
    fits = max(plan.total, 0 if plan.loads_on_host else plan.loading) <= budget
    if plan.refused:
        lines += ["", f"{where}: {budget / GiB:.1f} GiB per device -> finetune train refuses this setup: {plan.refused}"]
        good = [f"  - {label}: {p.total / GiB:.2f} GiB" for label, p in alts if p.total <= budget]
        lines += ["what runs and fits instead:", *good] if good else ["nothing a single switch changes both runs and fits"]
        return "\n".join(lines)
    lines += ["", f"{where}: {budget / GiB:.1f} GiB per device -> {'fits' if fits else 'does NOT fit'}"]
    if not fits:
        good = [(label, p) for label, p in alts if p.total <= budget]
        if good:
            lines.append("switches that make it fit:")
            lines += [f"  - {label}: {p.total / GiB:.2f} GiB" for label, p in good]
        else:
            lines.append("no single switch makes it fit; combine them or use more devices (--gpus N with ZeRO-3/FSDP)")
    return "\n".join(lines)
