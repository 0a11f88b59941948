"""`make bench-scale`: the planned and the simulated per-rank memory and collectives of one FSDP2 training
step, for Llama-3.1-8B, Llama-2-70B, Qwen2.5-72B and Llama-3.1-405B shapes at 8, 64 and 512 GPUs, LoRA,
QLoRA (torchao's NF4 base) and full fine-tuning. From the published config.json files in docs/examples/
alone, on this CPU machine: `finetune plan --simulate` runs each step on fake tensors (outputs/simulate.py).

Settings: bf16 weights, LoRA r 16 on every linear layer (dropout 0.05, the shipped configs'), AdamW,
gradient checkpointing, one 4,096-token row a micro-batch, distributed.strategy fsdp. Each simulation
runs in a fresh process, as the command does; results are kept in bench/results/scale.json as they come,
each with the commit it ran at (a rerun skips those there; delete the file to run all again), and the
table is bench/results/scale.md.

usage: python bench/scale.py [--only MODEL]   (about 100 minutes of simulation on a 2-core CPU for all 39; 405B QLoRA 9-12 min each;
the tensor-parallel rows (SPLIT) about 20 minutes more, the DPO rows (PREFERENCE) about 10)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import REPO, cpu_name, head_commit, report

sys.path.insert(0, str(REPO))
from finetune.config.schema import validate_config  # noqa: E402
from finetune.outputs.plan import GiB, make_plan
from finetune.outputs.simulate import NOT_TENSORS  # noqa: E402
from finetune.outputs.steptime import step_time

MODELS = {"llama-3.1-8b": "Llama-3.1-8B", "llama-2-70b": "Llama-2-70B", "qwen2.5-72b": "Qwen2.5-72B", "llama-3.1-405b": "Llama-3.1-405B"}
METHODS = ("lora", "full", "qlora")  # QLoRA last: quantizing fake layers takes the longest
WORLDS = (8, 64, 512)
RESULTS = REPO / "bench" / "results" / "scale.json"


# Published 70B QLoRA runs on two 24 GB cards with FSDP's CPU offload, beside the same step simulated:
# (what they said, model, tokens a row, LoRA rank)
PUBLISHED = [("Answer.AI, FSDP + QLoRA: fits two 24 GB cards (gradient checkpointing, CPU offload)", "llama-2-70b", 2048, 16),
             ("the same at 4k tokens", "llama-2-70b", 4096, 16),
             ("axolotl's 70B QLoRA FSDP example (512 tokens, r 8, fsdp_offload_params): dual GPU @ 21GB VRAM", "llama-2-70b", 512, 8)]
# FSDP2's CPU offload keeps these in the host's RAM: the device holds the rest of the simulated peak
OFFLOADED = ("weights (this rank's shards)", "gradients (shards)", "optimizer states")


# Tensor parallel x FSDP2 on a 2-D mesh (distributed.tensor_parallel): (model, method, GPUs, processes splitting each layer)
SPLIT = [("llama-3.1-8b", "lora", 8, 2), ("llama-2-70b", "lora", 64, 8), ("llama-2-70b", "full", 64, 8), ("llama-3.1-405b", "lora", 512, 8),
         ("llama-3.1-405b", "full", 512, 8)]


# DPO (one pair a row): its reference's forward, the adapter switched off or (full fine-tuning) a frozen copy: (model, method, GPUs)
PREFERENCE = [("llama-3.1-8b", "lora", 8), ("llama-3.1-8b", "full", 8), ("llama-2-70b", "lora", 64), ("llama-2-70b", "full", 64)]


def config(model: str, method: str, seq: int = 4096, r: int = 16, split: int = 1, objective: str = "sft"):
    raw = {"model": {"name_or_path": str(REPO / "docs" / "examples" / model), "dtype": "bfloat16"},
           "data": {"train": "unused.jsonl", "max_seq_len": seq, "format": "preference" if objective != "sft" else "alpaca"},
           "adapter": {"method": "full" if method == "full" else "lora", "r": r, "alpha": 2 * r, "dropout": 0.05, "target_modules": "all-linear"},
           "train": {"micro_batch_size": 1, "grad_accum": 1, "gradient_checkpointing": True, "optimizer": "adamw", "mixed_precision": "bf16",
                     "objective": objective},
           "distributed": {"strategy": "fsdp", "tensor_parallel": split}}
    if method == "qlora":
        raw["model"]["quantization"] = {"bits": 4}  # backend auto: torchao under fsdp
    return validate_config(raw, "bench-scale", check_paths=False)


def simulate_one(model: str, method: str, world: int, seq: int = 4096, r: int = 16, split: int = 1, objective: str = "sft") -> dict:
    """In this process: one simulated step, as JSON-ready numbers."""
    from finetune.config.errors import UserError
    from finetune.outputs.simulate import simulate

    try:
        sim = simulate(config(model, method, seq, r, split, objective), world)
    except UserError as err:  # what training would refuse in one line, at the same point of its setup
        return {"refused": str(err)}
    return {"peak": sim.peak, "total": sim.total, "moved": sim.moved, "seconds": sim.seconds,
            "collectives": {name: calls for name, (calls, _) in sim.collectives.items()}}


def row(model: str, method: str, world: int, sim: dict, split: int = 1, objective: str = "sft") -> str:
    where = f"{world}" if split == 1 else f"{world} ({world // split} x {split})"
    if "refused" in sim:
        return f"| {MODELS[model]} | {method} | {where} | refused by finetune train, and by the simulation: {sim['refused']} ||||||"
    cfg = config(model, method, split=split, objective=objective)
    plan = make_plan(cfg, devices=world, gpu=True)
    tensors = plan.total - sum(plan.rows.get(name, 0.0) for name in NOT_TENSORS)
    comm = step_time(cfg, plan.setup, 1.0, 1.0, 0.0).comm_bytes
    top = sorted(sim["peak"].items(), key=lambda item: -item[1])[:3]
    return (f"| {MODELS[model]} | {method} | {where} | {tensors / GiB:.2f} ({plan.moment}) | {sim['total'] / GiB:.2f} | "
            f"{(tensors - sim['total']) / sim['total']:+.0%} | " + ", ".join(f"{role} {size / GiB:.2f}" for role, size in top)
            + f" | {comm / 1e9:.3g} / {sim['moved'] / 1e9:.3g} | {sim['seconds']:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(MODELS), help="one model shape")
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)  # a worker: MODEL METHOD WORLD [SEQ R], one simulation
    args = parser.parse_args()
    if args.one:
        print(json.dumps(simulate_one(args.one[0], args.one[1], *map(int, args.one[2:6]), *args.one[6:])))
        return
    done = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    wanted = [(model, method, world) for method in METHODS for model in ([args.only] if args.only else MODELS) for world in WORLDS]
    wanted += [(model, "qlora", 2, seq, r) for _, model, seq, r in PUBLISHED if not args.only or model == args.only]
    wanted += [(model, method, world, 4096, 16, split) for model, method, world, split in SPLIT if not args.only or model == args.only]
    wanted += [(model, method, world, 4096, 16, 1, "dpo") for model, method, world in PREFERENCE if not args.only or model == args.only]
    for job in wanted:
        key = " ".join(map(str, job))
        if key not in done["runs"]:
            done["runs"][key] = run(job)
            RESULTS.write_text(json.dumps(done, indent=1) + "\n")
            print(f"{key}: {done['runs'][key].get('refused') or str(round(done['runs'][key]['seconds'])) + ' s'}", flush=True)
    report("scale", table())


def table() -> list[str]:
    """The tables from bench/results/scale.json's simulations and today's plan (tests/test_docs.py holds
    docs/planning.md to them)."""
    runs = json.loads(RESULTS.read_text())["runs"]
    lines = ["| model | method | GPUs | plan: tensors per GPU, GiB (its peak) | simulated peak, GiB | plan vs simulated | simulated, largest roles (GiB) "
             "| collectives per GPU a step, GB: plan / simulated | simulation took |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [row(model, method, world, runs[f"{model} {method} {world}"]) for model in MODELS for method in METHODS for world in WORLDS
              if f"{model} {method} {world}" in runs]
    lines += ["", "| published | our step, simulated: on each GPU with FSDP's CPU offload (peak less the sharded weights, gradients and optimizer states) "
              "| plan, on each GPU | offloaded to CPU RAM per process (simulated) |", "| --- | --- | --- | --- |"]
    for said, model, seq, r in PUBLISHED:
        sim = runs.get(f"{model} qlora 2 {seq} {r}")
        if sim:
            cfg = config(model, "qlora", seq, r)
            cfg.distributed.fsdp_cpu_offload = True
            plan = make_plan(cfg, devices=2, gpu=True)
            host = sum(sim["peak"].get(role, 0.0) for role in OFFLOADED)
            lines.append(f"| {said} | {(sim['total'] - host) / GiB:.2f} GiB ({seq} tokens, r {r}) | {plan.total / GiB:.2f} GiB with its 1 GiB CUDA reserve "
                         f"| {host / GiB:.2f} GiB |")
    split = [row(model, method, world, runs[f"{model} {method} {world} 4096 16 {tp}"], tp) for model, method, world, tp in SPLIT
             if f"{model} {method} {world} 4096 16 {tp}" in runs]
    if split:
        lines += ["", "Tensor parallel x FSDP2 (distributed.tensor_parallel: each layer split over the second number of GPUs, FSDP2 over the "
                  "first), the same settings:", "", *lines[:2], *split]
    dpo = [row(model, method, world, runs[f"{model} {method} {world} 4096 16 1 dpo"], objective="dpo") for model, method, world in PREFERENCE
           if f"{model} {method} {world} 4096 16 1 dpo" in runs]
    if dpo:
        lines += ["", "DPO (train.objective dpo, one pair a row; the reference: LoRA's base with the adapter switched off, full fine-tuning's "
                  "frozen copy sharded as the policy), the same settings:", "", *lines[:2], *dpo]
    when = sorted({f"{sim['commit']} on {sim['date']}, {sim['cpu']}" for sim in runs.values()})
    return lines + ["", f"Simulated at {'; '.join(when)}: `make bench-scale` (bench/scale.py).", "", *zero_table()]


# ZeRO is not simulated (DeepSpeed's engine does not run on fake tensors): its model states are checked against DeepSpeed's own
# estimator instead, full fine-tuning in bf16 with AdamW (what the estimator assumes), no offload, 8 GPUs a node
ZERO = [(model, stage, world) for model in ("llama-3.1-8b", "llama-2-70b") for stage in ("zero2", "zero3") for world in (8, 64)]


def zero_table() -> list[str]:
    """The plan's model states (weights, gradients, optimizer states, fp32 master weights, and the step's fp32 gradients) at
    DeepSpeed's optimizer step beside DeepSpeed's estimate_zero{2,3}_model_states_mem_needs, per GPU."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from finetune.outputs.plan import deepspeed_step
    from finetune.outputs.shape import read_shape

    lines = ["ZeRO, checked against DeepSpeed's own estimator (not simulated), full fine-tuning, bf16, AdamW, 4,096-token rows: GiB per GPU",
             "", "| model | strategy | GPUs | DeepSpeed's estimate of the model states | plan: the same states at DeepSpeed's step | plan vs "
             "DeepSpeed | plan: the step's peak (its moment) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, stage, world in ZERO:
        cfg = config(model, "full")
        cfg.distributed.strategy = stage
        plan, shape = make_plan(cfg, devices=world, gpu=True), read_shape(cfg.model.name_or_path)
        states = sum(plan.rows.get(row, 0.0) for row in ("weights", "gradients", "optimizer states", "fp32 master weights (DeepSpeed)"))
        states += deepspeed_step(shape, cfg, plan.setup)
        total, layer = shape.linear_params + shape.other_params, shape.linear_params // shape.layers
        nodes = {"num_gpus_per_node": min(world, 8), "num_nodes": max(1, world // 8), "cpu_offload": False}
        theirs = (estimate_zero2_model_states_mem_needs(total, **nodes) if stage == "zero2"
                  else estimate_zero3_model_states_mem_needs(total, layer, cpu_offload_params=False, **nodes))[1]
        lines.append(f"| {MODELS[model]} | {stage} | {world} | {theirs / GiB:.2f} | {states / GiB:.2f} | {(states - theirs) / theirs:+.0%} "
                     f"| {plan.total / GiB:.2f} ({plan.moment}) |")
    return lines


def run(job: tuple) -> dict:
    """One simulation in a fresh process, as `finetune plan --simulate` runs."""
    commit = head_commit()
    worker = subprocess.run([sys.executable, __file__, "--one", *map(str, job)], cwd=REPO, capture_output=True, text=True)
    if worker.returncode:
        sys.exit(f"{' '.join(map(str, job))}: {worker.stderr.strip().splitlines()[-1]}")
    return {**json.loads(worker.stdout.strip().splitlines()[-1]), "commit": commit, "date": time.strftime("%Y-%m-%d"),
            "cpu": f"{cpu_name()} ({os.cpu_count()} cores)"}


if __name__ == "__main__":
    main()
