"""A step's time, as the planner estimates it: the matmuls' FLOPs at a given throughput and utilisation
against the bytes each step must move (weights gathered, gradients reduced) at a given bandwidth."""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.config.schema import RunConfig
from finetune.outputs.plan import BNB_BLOCK, Setup, estimate, head_width, run_shape, split_shape, spread_experts, teacher_rows, teacher_shape, trainable_params
from finetune.parallel.tensor_parallel import styles


@dataclass(frozen=True)
class StepTime:
    """A step's time on `devices` devices from its arithmetic alone: FLOPs at a stated share of the
    peak (MFU) and collective bytes at a stated bandwidth per device."""

    flops_per_token: float
    tokens: int  # per device per optimizer step
    compute_s: float
    comm_bytes: float  # sent per device per step
    comm_s: float
    experts_gathered: float = 0.0  # of comm_bytes, the experts' weights gathered (FSDP/ZeRO-3 over a mixture of experts)
    all_to_all: float = 0.0  # what expert parallelism over the devices would send instead: the routed tokens

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.comm_s)


def step_time(cfg: RunConfig, s: Setup, tflops: float, mfu: float, bandwidth: float) -> StepTime:
    """FLOPs per token: each matmul weight costs 2 FLOPs a token forward, 2 for the gradient of its input
    and 2 more for its own gradient when it is trained (full fine-tuning; an adapter's are negligible);
    checkpointing runs the forward again (+2). Causal attention adds 2 * seq * q_dim per layer forward
    (QK^T and AV over half the keys on average), twice that backward. Communication, ring collectives,
    each moving (d-1)/d of the tensor per device: FSDP/ZeRO-3 gather the weights in every micro-batch's
    forward and again in its backward, and reduce-scatter the trained gradients once a step; DDP and
    ZeRO-2 all-reduce (twice the bytes) the trained gradients once a step. Not counted: FSDP2 pads each
    weight's first dimension to a multiple of the processes, which at hundreds of them makes LoRA's
    r-row A matrices gathered as hundreds of rows (the simulation sent 4-9% more at 512 GPUs). Tensor parallelism over
    t of the devices: each computes and gathers its split of the layers (plan.split_shape) over the devices / t that
    shard it, and all-reduces the residual stream: each row-wise layer's output in the forward (and the recompute),
    each column-wise layer's input gradient in the backward (q, k and v one each: the simulation counts them apart).
    DPO's reference takes one more forward of each micro-batch without gradients (the adapter off, or the frozen copy),
    KTO's three (its reference, and the policy and reference on the mismatched pairs), GRPO's one with a KL term (grpo.beta):
    as many more gathers under FSDP/ZeRO-3. GRPO's sampling is not timed.
    Distillation's teacher one forward of its own, its weights gathered for it."""
    t = s.tensor_parallel
    shape = split_shape(run_shape(cfg), t)
    full, s = s.method == "full", replace(s, devices=s.devices // t)
    d = s.devices
    matmul = sum(l.fan_in * l.fan_out * l.active for l in shape.linears) + head_width(shape, cfg) * shape.hidden  # the head too
    frozen_forwards = (3 if cfg.train.objective == "kto" else 1) if cfg.runs_reference else 0
    per_weight = 2 + 2 + (2 if full else 0) + (2 if s.checkpointing else 0) + 2 * frozen_forwards
    q_dim = next((l.fan_out for l in shape.linears if l.name.rsplit(".", 1)[-1] == "q_proj"), shape.hidden)
    span = s.seq_len / cfg.grpo.num_generations if cfg.train.objective == "grpo" else s.seq_len  # GRPO's sequences attend within themselves
    attention = shape.layers * 2 * span * q_dim * (1 + 2 + (1 if s.checkpointing else 0) + frozen_forwards)
    flops = per_weight * matmul + attention
    tokens = s.tokens * cfg.train.grad_accum
    # the whole model as held, gathered (not the experts' shares, where they are spread under FSDP2)
    weight_bytes = estimate(shape, cfg, replace(s, strategy="none", devices=1))[0]["weights"] - spread_experts(shape, s)
    teacher_bytes = 0.0
    if cfg.train.objective == "distill" and cfg.distill.teacher:  # its forward, and its weights as held, gathered for it
        teacher = teacher_shape(cfg)
        flops += 2 * (sum(l.fan_in * l.fan_out * l.active for l in teacher.linears) + teacher.vocab * teacher.hidden) \
            + teacher.layers * 2 * s.seq_len * teacher.hidden
        teacher_bytes = teacher_rows(cfg, replace(s, strategy="none", devices=1))[0]
    # Adapters train in fp32; FSDP reduce-scatters full fine-tuning's 16-bit gradients in fp32 too (its
    # MixedPrecisionPolicy's reduce_dtype: the simulated 70B step sent 483 GB at 8 GPUs, not 362)
    grads = trainable_params(shape, cfg) * (4 if not full or s.run_as.name == "fsdp" else s.weight_bytes)
    share = (d - 1) / d
    if d == 1:
        sent = 0.0
    elif s.shards_weights:
        sent = share * (((2 + frozen_forwards) * weight_bytes + teacher_bytes) * cfg.train.grad_accum + grads)
    else:
        sent = share * 2 * grads
    if s.sequence_parallel > 1:  # Ulysses: q, k, v and the output through an all-to-all per layer, forward and backward (and the recompute)
        kv_dim = shape.kv_dim
        sp_share = (s.sequence_parallel - 1) / s.sequence_parallel
        sent += sp_share * tokens * (2 * q_dim + 2 * kv_dim) * s.activation_bytes * shape.layers * (2 + (1 if s.checkpointing else 0))
    if t > 1:  # a row-wise layer's output summed in the forward (and the recompute), a column-wise one's input gradient in the backward
        style = list(styles(shape.config).values())
        per_layer = style.count("rowwise") * (2 if s.checkpointing else 1) + style.count("colwise")
        sent += 2 * (t - 1) / t * tokens * shape.hidden * s.activation_bytes * per_layer * shape.layers
    if s.expert_parallel > 1:  # the routed tokens to their experts' processes and back
        sent += routed_exchange(shape, s, tokens, s.expert_parallel)
    experts_gathered, all_to_all = expert_traffic(shape, cfg, s, tokens) if s.shards_weights and d > 1 and s.expert_parallel == 1 else (0.0, 0.0)
    # a tensor-parallel group computes its rows together: each device's share of the tokens is 1/t of them
    return StepTime(flops, tokens // t, tokens * flops / (tflops * 1e12 * mfu), sent, sent / bandwidth if bandwidth else 0.0, experts_gathered, all_to_all)


def expert_traffic(shape, cfg: RunConfig, s: Setup, tokens: int) -> tuple[float, float]:
    """A mixture of experts under FSDP/ZeRO-3: the bytes each device sends gathering the experts' weights in every
    micro-batch's forward and backward (as held: 4-bit stacks packed with their scales, else the weights' dtype), and
    what an expert-parallel layout (each device keeping 1/d of the experts whole) would send instead: each routed copy
    of a token to its expert's device and its output back, in the activations' dtype, in the forward, the backward and
    the checkpointed forward again, (d-1)/d of them leaving the device under balanced routing."""
    params = shape.expert_params
    if not params:
        return 0.0, 0.0
    share = (s.devices - 1) / s.devices
    held = params * (0.5 + 1 / BNB_BLOCK) if s.bits == 4 else params * s.weight_bytes  # 8-bit bases keep the experts as loaded
    gathered = share * 2 * held * cfg.train.grad_accum
    return gathered, routed_exchange(shape, s, tokens, s.devices)


def routed_exchange(shape, s: Setup, tokens: int, size: int) -> float:
    """The bytes a device sends with the experts spread over `size` devices (distributed.expert_parallel): each routed copy of
    a token to its expert's device and its output back, in the activations' dtype, in the forward, the backward and the
    checkpointed forward again, (size-1)/size of them leaving the device under balanced routing."""
    copies = next((layer.active for layer in shape.linears if layer.expert), 0)  # routed copies of a token over all layers (top-k x the routed layers)
    passes = 2 + (1 if s.checkpointing else 0)
    return (size - 1) / size * tokens * copies * shape.hidden * s.activation_bytes * 2 * passes


def render_time(t: StepTime, tflops: float, mfu: float, bandwidth: float) -> str:
    return (f"time: {t.flops_per_token / 1e9:.1f} GFLOP per token; {t.tokens:,} tokens per device per step at {tflops:g} TFLOP/s x MFU {mfu:g}: "
            f"compute {t.compute_s:.2f} s; communication {t.comm_bytes / 1e9:.1f} GB per device"
            + (f" at {bandwidth / 1e9:g} GB/s: {t.comm_s:.2f} s" if bandwidth else "")
            + f"; step {t.overlapped_s:.2f} s overlapped ({t.compute_s + t.comm_s:.2f} s if not), "
            f"{t.tokens / t.overlapped_s:,.0f} tokens/s per device"
            + (f"\nexperts: {t.experts_gathered / 1e9:.1f} GB of that communication gathers the experts' weights; expert parallelism "
               f"(distributed.expert_parallel) would send {t.all_to_all / 1e9:.1f} GB of routed tokens instead" if t.experts_gathered else ""))
