"""Mixture-of-experts models on this machine: our grouped expert LoRA against HF + peft, and the plan against the peak.

Four scaled-down released shapes (the expert count, top-k and the expert-to-hidden ratio kept; hidden 512, 2 layers;
random weights, the demo tokenizer):
  - qwen3-moe: Qwen3-30B-A3B's 128 experts, 8 routed, MoE width 3/8 of hidden
  - gpt-oss: gpt-oss-20b's 32 experts, 4 routed, biased experts stored (E, in, out), attention sinks
  - deepseek-v3: DeepSeek-V3's latent attention, a dense first layer, 64 routed experts of 8 (scaled from 256), a shared one
  - llama4: Llama 4 Scout's 16 experts, 1 routed, MoE width 1.6 x hidden, a shared expert; transformers runs every expert
    on every token (the router's score scaling the input), finetune the chosen one (model/experts.py)

speed: one process, fp32, LoRA r 16 on attention and experts, 1 x 1024 tokens, a forward and backward of the model's
own loss per step (3 timed after 1, in 3 rounds taken in turn, the best of each side's). "HF + peft" is transformers'
default experts path (grouped_mm; Llama 4: its own, every expert on every token) with peft's `target_parameters` LoRA
(each expert weight parametrized as W + B·A); "ours" is the same adapter through finetune's load and adapter
(model/experts.py: the LoRA on the routed tokens only). Same weights, same adapter values, the same attention
(finetune's, which its load registers): the first losses must agree. The MoE block alone: the first layer's router,
experts (and shared expert) forward and backward on the same random hidden states, on each side (5 times the steps),
what the two expert paths differ in without the rest of the model. The matrix products' FLOPs of a step and of the block on each side
(torch.profiler's count of every mm, those inside grouped_mm included): what bounds the speed-up where both sides
multiply as fast. HF + peft's experts make each weight's gradient (W + B·A takes one) beside the input's: three products of
the routed tokens to our two, and B·A for every expert.

memory: `finetune train` on the qwen3-moe shape (LoRA in fp32; QLoRA with torchao's NF4 on the linear layers and
the experts), 1 x 1024 tokens, 3 steps, a process each, two runs of each (the higher peak kept), glibc's heap set to hand large blocks back
(MALLOC_MMAP_THRESHOLD_, as tests/test_plan.py measures); measured = peak anonymous RSS - anonymous RSS before the model
loaded (bench/large.py's sampling), the load included; planned = `finetune plan`'s total for the same config, or what
it plans while the base loads where that is more.

plan: `finetune plan` for the released shapes (docs/examples/NAME/config.json; llama-4-scout-text: Llama 4 Scout's text
side, as finetune trains it: llama4_text), configs/qlora.yaml and configs/lora.yaml
as shipped (LoRA r 16 on every linear layer and the experts; QLoRA: 4-bit NF4 linear layers and experts) with one row of
4,096 tokens a micro-batch and activation checkpointing, on 80 GiB GPUs: one GPU, or FSDP2 over 8 and 64 (torchao's NF4 and AdamW, which it shards).
On one GPU each expert stack is quantized as transformers sets it on its module: what the GPU holds while the base loads is
its own column (FSDP2 loads layer by layer: -).

parallel: the same configs' step time under FSDP2 (`finetune plan --bandwidth --tflops`) against what expert parallelism
would send in place of the experts' gathers; with the experts spread over the GPUs (distributed.expert_parallel) under
FSDP2 (LoRA) and under DDP, the plan and the step time; and `finetune plan --simulate` of Qwen3-30B-A3B over 8.

quantizing: what quantizing one 128M-weight tensor to NF4 holds beside it, torchao's to_nf4 against model/nf4.py's.

Usage: python bench/moe.py [--steps 3] [--only speed,memory,plan,quantizing,parallel]   (make bench-moe, ~8 min)
Prints the tables and writes them to bench/results/moe.md.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from common import DATA, REPO, cpu, head_commit, report, steps_and_parts
from large import train

CACHE = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "bench-moe"
TOKENS = 1024
RUNS = 2  # memory: runs of each, the highest peak kept
BLOCK_STEPS = 5  # speed: the MoE block alone, a fraction of a step, timed over this many times the steps
ROUNDS = 5  # speed: each side timed in turn this many times, its best kept (a 2-core machine's runs vary by a fifth)
COMMON = dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
SHAPES = {
    "qwen3-moe": ("qwen3_moe", dict(intermediate_size=1536, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=192)),
    "gpt-oss": ("gpt_oss", dict(intermediate_size=512, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                                layer_types=["sliding_attention", "full_attention"])),
    "deepseek-v3": ("deepseek_v3", dict(num_key_value_heads=8, head_dim=32, intermediate_size=1536, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32,
                                        qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                                        moe_intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1)),
    # Scout's ratios: 16 experts of 1.6 x the width, one chosen, a shared expert beside them; HF computes every expert for every token
    "llama4": ("llama4_text", dict(intermediate_size=768, intermediate_size_mlp=1536, num_local_experts=16, num_experts_per_tok=1)),
}


def model(name: str) -> Path:
    """The scaled-down shape, saved once with random weights and the demo tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.tiny import build_tokenizer

    out = CACHE / name
    if not (out / "config.json").is_file():
        texts = [json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
        tok = build_tokenizer(texts)
        kind, extra = SHAPES[name]
        config = AutoConfig.for_model(kind, **{**COMMON, **extra, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                                               "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id})
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        tok.save_pretrained(out)
    return out


def model_step(model, ids):
    """One forward and backward of the model's own loss; its loss."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item()


def block_step(block, hidden) -> None:
    """One forward and backward of a mixture-of-experts block (its router, experts and shared expert) on `hidden`, taking
    the hidden states' gradient too, as a step does."""
    out = block(hidden)
    (out[0] if isinstance(out, tuple) else out).pow(2).mean().backward()


def timed(step, tokens: int, steps: int) -> tuple[float, object]:
    """(tokens/s over `steps` calls of step() after one untimed, what the first call returned)."""
    first = step()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * tokens / (time.perf_counter() - began), first


PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def products(step) -> float:
    """The matrix products' FLOPs in one call of step() (torch.profiler's count: every mm, grouped_mm's per-group ones too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        step()
    return sum(e.flops for e in prof.key_averages() if e.key in PRODUCTS)


def speed(name: str, steps: int) -> str:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.config.schema import AdapterConfig, ModelConfig
    from finetune.model import experts
    from finetune.model.loading import apply_adapter, load_model

    folder = model(name)
    ours = apply_adapter(load_model(ModelConfig(name_or_path=str(folder)), say=lambda _: None), AdapterConfig(r=16, alpha=32, dropout=0.0),
                         gradient_checkpointing=False, say=lambda _: None)
    with torch.no_grad():
        for key, p in ours.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.01, generator=torch.Generator().manual_seed(len(key)))
    config = ours.peft_config["default"]
    same = {"attn_implementation": ours.config._attn_implementation}  # the attention finetune registered: only the experts' paths differ
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, **same), LoraConfig(**{  # the adapter config ours resolved to
        **config.to_dict(), "target_modules": sorted(config.target_modules), "target_parameters": sorted(config.target_parameters)}))
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, ours.config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    steps_of = [lambda m=m: model_step(m, ids) for m in (theirs.train(), ours.train())]
    rounds = [[timed(step, TOKENS, steps) for step in steps_of] for _ in range(ROUNDS)]  # taken in turn
    peer, mine = (max(r[i][0] for r in rounds) for i in (0, 1))
    peer_loss, my_loss = (rounds[0][i][1] for i in (0, 1))  # the first losses
    stack = experts.named_fused_experts(ours)[0][0]  # the first layer's experts (peft may wrap them): their MoE block
    block = stack[: stack.index(".experts")]
    hidden = torch.randn(1, TOKENS, ours.config.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    blocks_of = [lambda m=m: block_step(m.get_submodule(block), hidden) for m in (theirs, ours)]
    alone = [[timed(step, TOKENS, BLOCK_STEPS * steps)[0] for step in blocks_of] for _ in range(ROUNDS)]
    peer_block, my_block = (max(r[i] for r in alone) for i in (0, 1))
    flops = [[products(step) / 1e9 for step in pair] for pair in (steps_of, blocks_of)]  # (step, block) x (theirs, ours)
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    return (f"| {name} | {trainable / 1e6:.1f}M | {peer:,.0f} | {mine:,.0f} | {mine / peer:.2f}x | {peer_block:,.0f} | {my_block:,.0f} | "
            f"{my_block / peer_block:.2f}x | " + " | ".join(f"{t:.1f} / {o:.1f} ({t / o:.2f}x)" for t, o in flops) +
            f" | {peer_loss:.6f} | {my_loss:.6f} |")


def memory(run: str, steps: int) -> str:
    work = CACHE / "runs"
    work.mkdir(parents=True, exist_ok=True)
    cfg = {"model": {"name_or_path": str(model("qwen3-moe")), "dtype": "float32"}, "adapter": {"method": "lora", "r": 16, "alpha": 32},
           "data": {"train": str(DATA / "train.jsonl"), "format": "alpaca", "max_seq_len": TOKENS, "packing": True, "eval": None},
           "train": {"output_dir": str(work / run), "max_steps": steps, "micro_batch_size": 1, "lr": 1e-4, "mixed_precision": "no"},
           "logging": {"report_to": [], "progress_bar": False, "plot": False}, "checkpoint": {"save_every": 0}}
    if run == "qlora":
        cfg["model"]["quantization"] = {"bits": 4, "backend": "torchao", "compute_dtype": "bfloat16"}
    measured = 0.0
    for _ in range(RUNS):  # the sampler (every 0.25 s) can miss the peak, never overshoot it: the highest run's
        shutil.rmtree(cfg["train"]["output_dir"], ignore_errors=True)  # this bench's own run of last time
        result = train(work, run, 1, cfg, env={"MALLOC_MMAP_THRESHOLD_": "131072"})
        if result["code"] != 0:
            return f"| qwen3-moe {run} | exit {result['code']}: {result['console'].strip().splitlines()[-1][:120]} | | |"
        measured = max(measured, result["anon"][0] - result["summary"]["anonymous_before_model_mib"])
    from finetune.config.schema import validate_config
    from finetune.outputs.plan import make_plan

    plan = make_plan(validate_config(cfg, "bench"), devices=1, strategy="none")
    peak, moment = max((plan.total, "the step"), (plan.loading, "loading"))
    return f"| qwen3-moe {run} | {peak / 2**20:,.0f} ({moment}) | {measured:,.0f} | {peak / 2**20 / measured:.2f} |"


PLANS = [("qwen3-30b-a3b", 1), ("gpt-oss-20b", 1), ("glm-4.5-air", 1), ("gpt-oss-120b", 1), ("qwen3-235b-a22b", 8), ("qwen3-235b-a22b", 64),
         ("deepseek-v3", 8), ("deepseek-v3", 64), ("llama-4-scout-text", 1)]


def shipped(name: str, method: str, gpus: int, experts_split: str | None = None):
    """configs/METHOD.yaml as shipped on the released shape, one 4,096-token row a micro-batch, checkpointing; over more
    than one GPU what FSDP2 shards (torchao's 4-bit base, AdamW's states, not bitsandbytes' paged ones), or with
    experts_split ("ddp" or "fsdp") that strategy with the experts spread over the GPUs (distributed.expert_parallel: GPUs)."""
    import yaml

    from finetune.config.schema import validate_config

    cfg = yaml.safe_load((REPO / "configs" / f"{method}.yaml").read_text())
    cfg["model"]["name_or_path"] = str(REPO / "docs" / "examples" / name)
    cfg["data"].update(train=str(DATA / "train.jsonl"), max_seq_len=4096)
    cfg["data"].pop("eval", None)
    cfg["train"].update(micro_batch_size=1, gradient_checkpointing=True)  # lora.yaml's is off: 94 layers' activations would not fit
    cfg.setdefault("distributed", {})["strategy"] = "fsdp" if gpus > 1 else "none"
    if experts_split:
        cfg["distributed"].update(strategy=experts_split, expert_parallel=gpus)
    if gpus > 1 and experts_split != "ddp":
        cfg["train"]["optimizer"] = "adamw"
        if method == "qlora":
            cfg["model"]["quantization"]["backend"] = "torchao"
    return validate_config(cfg, "bench")


def plans() -> list[str]:
    from finetune.outputs.plan import GiB, make_plan

    lines = []
    for name, gpus in PLANS:
        qlora, lora = (make_plan(shipped(name, method, gpus), devices=gpus, gpu=True) for method in ("qlora", "lora"))
        figures = [qlora.total, qlora.loading, lora.total]
        lines.append(f"| {name} | {gpus} | " + " | ".join((f"{t / GiB:.2f}" + ("" if t <= 80 * GiB else " (does not fit)")) if t else "-"
                                                          for t in figures) + " |")
    return lines


QUANTIZE = """
import re, sys, torch
from finetune.model import nf4
from torchao.quantization import to_nf4

def held():
    status = open("/proc/self/status").read()
    return [int(re.search(key + r":\\s+(\\d+)", status).group(1)) * 1024 for key in ("VmHWM", "VmRSS")]

dtype, ours = getattr(torch, sys.argv[1]), sys.argv[2] == "ours"
quantize = nf4.to_nf4 if ours else (lambda w: to_nf4(w, nf4.BLOCK, nf4.SCALER_BLOCK))
quantize(torch.randn(nf4.BLOCK * nf4.SCALER_BLOCK, 64).to(dtype))  # the first call's one-off allocations
weight = torch.randn(65536, 2048).to(dtype)
start = held()[1]
open("/proc/self/clear_refs", "w").write("5")  # the peak from here
codes = quantize(weight)
print(held()[0] - start)
"""


def quantizing() -> list[str]:
    """What quantizing one 128M-weight tensor to NF4 holds beside it at its peak: torchao's to_nf4 against nf4.to_nf4 (the
    same tensor, made a chunk at a time), each in a fresh process."""
    import subprocess
    import sys

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    rows = []
    for dtype in ("bfloat16", "float32"):
        beside = [int(subprocess.run([sys.executable, "-c", QUANTIZE, dtype, who], env=env, capture_output=True, text=True, check=True).stdout.split()[-1])
                  for who in ("torchao", "ours")]
        rows.append(f"| {dtype} | {beside[0] / 2**20:,.0f} | {beside[1] / 2**20:,.0f} | {beside[0] / beside[1]:.2f} |")
    return rows


# (shape, GPUs, GB/s a GPU): one node's NVLink, and one 400 Gb/s NIC a GPU across nodes
PARALLEL = [("qwen3-30b-a3b", 8, 400), ("qwen3-30b-a3b", 16, 50), ("qwen3-235b-a22b", 8, 400), ("qwen3-235b-a22b", 64, 50)]
TFLOPS, MFU = 989, 0.4  # an H100's dense bf16, at the planner's default utilisation


def parallel() -> list[str]:
    """FSDP2's step against expert parallelism's traffic (steptime.expert_traffic), and the simulated step's collectives
    (rank 0 on fake tensors, balanced routing) beside the planned ones for Qwen3-30B-A3B over 8."""
    from finetune.outputs.plan import GiB, make_plan
    from finetune.outputs.simulate import simulate
    from finetune.outputs.steptime import step_time

    def planned(cfg) -> list[str]:
        plan = make_plan(cfg, devices=gpus, gpu=True)
        t = step_time(cfg, plan.setup, TFLOPS, MFU, bandwidth * 1e9)
        return [f"{plan.total / GiB:.2f}", f"{t.comm_bytes / 1e9:.1f}", f"{t.comm_s:.2f}"]

    lines = []
    for name, gpus, bandwidth in PARALLEL:
        for method in ("qlora", "lora"):
            cfg = shipped(name, method, gpus)
            t = step_time(cfg, make_plan(cfg, devices=gpus, gpu=True).setup, TFLOPS, MFU, bandwidth * 1e9)
            fsdp_split = planned(shipped(name, method, gpus, "fsdp")) if method == "lora" else ["-"] * 3  # 16-bit experts only
            row = [name, method, gpus, bandwidth, f"{t.compute_s:.2f}", *planned(cfg), f"{t.experts_gathered / 1e9:.1f}", f"{t.all_to_all / 1e9:.1f}",
                   *fsdp_split, *planned(shipped(name, method, gpus, "ddp"))]
            lines.append("| " + " | ".join(map(str, row)) + " |")
            print(lines[-1], flush=True)
    cfg = shipped("qwen3-30b-a3b", "qlora", 8)
    cfg.train.grad_accum = 1  # as `plan --simulate` takes it: one micro-batch a step (more repeat its gathers)
    sim, planned = simulate(cfg, 8), step_time(cfg, make_plan(cfg, devices=8, gpu=True).setup, 1.0, 1.0, 0.0)
    lines += ["", f"`finetune plan --simulate`, qwen3-30b-a3b qlora over 8: collectives {sim.moved / 1e9:.1f} GB a step against "
                  f"{planned.comm_bytes / 1e9:.1f} GB planned for one micro-batch; peak {sim.total / 2**30:.2f} GiB of tensors ({sim.seconds:.0f} s)"]
    return lines + ["", one_process()]


def one_process() -> str:
    """`plan --simulate --strategy none` of configs/qlora.yaml on Qwen3-30B-A3B's widths, two of its layers (48 take the
    simulation over 15 minutes), with torchao's 4-bit base (bitsandbytes' kernels take no fake tensors) and AdamW: the plan's
    tensors and activations (with the dense weight temporaries) beside the step's."""
    from finetune.outputs.plan import GiB, make_plan
    from finetune.outputs.simulate import NOT_TENSORS, by_role, simulate

    two = CACHE / "qwen3-30b-a3b-2-layers"
    two.mkdir(parents=True, exist_ok=True)
    (two / "config.json").write_text(json.dumps({**json.loads((REPO / "docs/examples/qwen3-30b-a3b/config.json").read_text()), "num_hidden_layers": 2}))
    cfg = shipped("qwen3-30b-a3b", "qlora", 1)
    cfg.model.name_or_path = str(two)
    cfg.model.quantization.backend, cfg.train.optimizer, cfg.adapter.dropout = "torchao", "adamw", 0.0
    plan, sim = make_plan(cfg, devices=1, gpu=True), simulate(cfg, 1)
    tensors = plan.total - sum(plan.rows.get(row, 0.0) for row in NOT_TENSORS)
    ours, theirs = by_role(sim, plan)["activations"]
    return (f"`finetune plan --simulate --strategy none`, qwen3-30b-a3b's widths, 2 layers, qlora (torchao's 4-bit base, AdamW, dropout 0), one GPU: plan "
            f"{tensors / GiB:.2f} GiB of tensors at {plan.moment}, simulated {sim.total / GiB:.2f} GiB; activations and temporaries "
            f"{ours / GiB:.2f} planned, {theirs / GiB:.2f} simulated ({sim.seconds:.0f} s)")


def main() -> None:
    args, wanted = steps_and_parts(__doc__, 3, "speed, memory, plan, quantizing, parallel")
    lines = [f"{cpu()}, commit {head_commit()}, {time.strftime('%Y-%m-%d')}"]
    if wanted("speed"):
        lines += ["", f"fp32, LoRA r 16 on attention and experts, 1 x {TOKENS} tokens, forward + backward, {args.steps} steps timed after 1 "
                  f"(the MoE block alone: {BLOCK_STEPS * args.steps}), best of {ROUNDS} rounds taken in turn", "",
                  "| shape | LoRA params | HF + peft (tokens/s) | ours (tokens/s) | speed-up | HF + peft, MoE block alone (tokens/s) | "
                  "ours, MoE block alone (tokens/s) | MoE block speed-up | matrix products a step, HF + peft / ours (GFLOP) | "
                  "the MoE block's (GFLOP) | HF + peft first loss | ours first loss |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name in SHAPES:
            lines.append(speed(name, args.steps))
            print(lines[-1], flush=True)
    if wanted("memory"):
        lines += ["", f"`finetune train`, LoRA r 16 in fp32 (QLoRA: torchao NF4 linear layers and experts), 1 x {TOKENS} tokens, {args.steps} steps, "
                  f"the higher peak of {RUNS} runs", "",
                  "| run | planned (MiB) | measured (MiB) | planned / measured |", "| --- | --- | --- | --- |"]
        for run in ("lora", "qlora"):
            lines.append(memory(run, args.steps))
            print(lines[-1], flush=True)
    if wanted("plan"):
        lines += ["", "`finetune plan`, configs/qlora.yaml and configs/lora.yaml, 1 x 4096 tokens a micro-batch, checkpointing on, 80 GiB GPUs "
                  "(FSDP2 over more than one), GiB per GPU at the step's peak", "",
                  "| model | GPUs | QLoRA (GiB) | QLoRA while loading (GiB) | LoRA (GiB) |", "| --- | --- | --- | --- | --- |", *plans()]
    if wanted("quantizing"):
        lines += ["", "Quantizing one 65,536 x 2,048 tensor (128M weights) to NF4: MiB held beside it at the peak (VmHWM over the start, "
                  "MALLOC_MMAP_THRESHOLD_=131072, a fresh process each); nf4.to_nf4 makes torchao's tensor, bit for bit, 4M weights at a time", "",
                  "| dtype | torchao to_nf4 (MiB) | nf4.to_nf4 (MiB) | torchao / ours |", "| --- | --- | --- | --- |", *quantizing()]
    if wanted("parallel"):
        lines += ["", f"`finetune plan` step time, the same configs, {TFLOPS} TFLOP/s x MFU {MFU}, a step of grad_accum micro-batches: under FSDP2, "
                  "its collectives, of them the experts' gathers, and expert parallelism's all-to-all of the routed tokens in their place; "
                  "with the experts spread over the GPUs (distributed.expert_parallel: the GPUs) under FSDP2 (16-bit experts: LoRA only) and "
                  "under DDP (bitsandbytes' 4-bit base), GiB per GPU and the collectives (FSDP2's gathers of the rest, the all-to-alls; DDP's "
                  "all-reduce of the LoRA)", "",
                  "| model | method | GPUs | GB/s | compute (s) | FSDP2 (GiB) | FSDP2 (GB) | FSDP2 (s) | experts' gathers (GB) | all-to-all instead (GB) | "
                  "FSDP2, experts spread (GiB) | FSDP2, experts spread (GB) | FSDP2, experts spread (s) | DDP, experts spread (GiB) | "
                  "DDP, experts spread (GB) | DDP, experts spread (s) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *parallel()]
    report("moe", lines)


if __name__ == "__main__":
    main()
