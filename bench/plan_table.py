"""`finetune plan` for the jobs people run beyond this box: 70B QLoRA on two 24 GB GPUs, 70B LoRA on
8 x 80 GB, 70B full fine-tuning on 64 x 80 GB, 8B full fine-tuning on one 80 GB GPU. From the published
config.json files in docs/examples/ alone (no weights, no GPU); seconds.

Per device: weights, gradients and optimizer states (on the GPU, or in CPU RAM where offloaded),
activations at 4k and 32k tokens a row (gradient checkpointing on, micro-batch 1), the total at 4k, and
the step time predicted from FLOPs per token at the stated MFU and collective bandwidth (steptime.step_time;
16 rows of 4k tokens per device per step).

usage: python bench/plan_table.py   (results: bench/results/plan.md)
"""

from __future__ import annotations

import sys

from common import REPO, report

sys.path.insert(0, str(REPO))
from finetune.config.files import load_config
from finetune.outputs.plan import GiB, checked_plan, make_plan
from finetune.outputs.steptime import step_time

# name, preset, model config, overrides, devices, strategy, GPU memory (GiB), peak TFLOP/s, MFU, bandwidth (GB/s), the hardware
JOBS = [
    ("70B QLoRA, FSDP + CPU offload", "llama3-70b", "llama-3.1-70b", ["distributed.fsdp_cpu_offload=true", "train.optimizer=adamw"], 2, "fsdp",
     24, 165, 0.4, 20,
     "2 x RTX 4090 (165 TFLOP/s bf16 dense, PCIe 4.0 ~20 GB/s)"),
    ("70B LoRA bf16, FSDP", "llama3-70b", "llama-3.1-70b", ["model.quantization=null", "train.optimizer=adamw"], 8, "fsdp", 80, 989, 0.4, 400,
     "8 x H100 SXM, one node (989 TFLOP/s, NVLink ~400 GB/s)"),
    ("Qwen2.5-72B LoRA bf16, FSDP", "llama3-70b", "qwen2.5-72b", ["model.quantization=null", "train.optimizer=adamw"], 8, "fsdp", 80, 989, 0.4,
     400, "8 x H100 SXM, one node"),
    ("70B full, ZeRO-3", "llama3-70b", "llama-3.1-70b", ["model.quantization=null", "adapter.method=full", "train.optimizer=adamw"], 64, "zero3",
     80, 989, 0.4, 50, "64 x H100 SXM, 8 nodes (400 Gb/s per GPU: ~50 GB/s)"),
    ("8B full, one GPU", "llama3-8b", "llama-3.1-8b", ["model.quantization=null", "adapter.method=full", "train.optimizer=adamw_8bit"], 1, "none",
     80, 989, 0.4, 0, "1 x H100 SXM"),
]


def plan_job(preset, model, overrides, devices, strategy, seq):
    cfg = load_config(REPO / "configs" / "presets" / f"{preset}.yaml",
                      [f"model.name_or_path={REPO / 'docs' / 'examples' / model}", f"data.max_seq_len={seq}", "train.micro_batch_size=1",
                       "train.grad_accum=16", "train.gradient_checkpointing=true", *overrides], check_model=False, check_paths=False)
    return cfg, checked_plan(cfg, devices=devices, strategy=strategy, gpu=True)


def table() -> list[str]:
    """The table's lines (tests/test_docs.py holds docs/planning.md to them)."""
    lines = ["| job | hardware (assumed) | weights | gradients | optimizer | activations 4k / 32k | total at 4k per GPU | fits | "
             "CPU RAM per process | step (16 x 4k tokens per GPU) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, preset, model, overrides, devices, strategy, memory, tflops, mfu, bandwidth, hardware in JOBS:
        cfg, plan = plan_job(preset, model, overrides, devices, strategy, 4096)
        _, long = plan_job(preset, model, overrides, devices, strategy, 32768)
        where = {**plan.rows, **plan.host}
        gib = lambda key: f"{where.get(key, 0) / GiB:.1f}" + (" (CPU)" if key in plan.host else "")  # noqa: E731
        t = step_time(cfg, plan.setup, tflops, mfu, bandwidth * 1e9)
        comm = f", collectives {t.comm_s:.1f} s" if devices > 1 else ""
        lines.append(f"| {name} | {hardware} | {gib('weights')} | {gib('gradients')} | {gib('optimizer states')} | "
                     f"{plan.activations / GiB:.1f} / {long.activations / GiB:.1f} | {plan.total / GiB:.1f} | "
                     f"{'yes' if plan.total <= memory * GiB else 'no'} ({memory} GiB){'; train refuses it' if plan.refused else ''} | "
                     f"{sum(plan.host.values()) / GiB:.1f} | "
                     f"{t.overlapped_s:.1f} s at MFU {mfu:g} (compute {t.compute_s:.1f} s{comm}) |")
    return lines


ROWS = ["weights", "gradients", "optimizer states", "activations", "dense weight temporaries"]


def worked_examples() -> list[str]:
    """docs/planning.md's worked examples, by row, on one GPU."""
    lines = ["| config | " + " | ".join(ROWS) + " | total |", "| --- |" + " --- |" * (len(ROWS) + 1)]
    for name in ("plan-7b-full.yaml", "plan-7b-qlora.yaml"):
        plan = make_plan(load_config(REPO / "docs" / "examples" / name, check_model=False, check_paths=False), gpu=True)
        lines.append(f"| {name} | " + " | ".join(f"{plan.rows.get(row, 0) / GiB:.2f} GiB" for row in ROWS) + f" | {plan.total / GiB:.2f} GiB |")
    return lines


def presets() -> list[str]:
    """docs/models.md's presets planned on 80 GiB GPUs as each one's own `finetune plan` line says: on the shape it names,
    over the GPUs and strategy it names (one GPU where it names none)."""
    lines = ["| preset | model | parameters (active) | total |", "| --- | --- | --- | --- |"]
    for path in sorted((REPO / "configs" / "presets").glob("*.yaml")):
        words = path.read_text().split("finetune plan ", 1)[1].splitlines()[0].split()
        option = {key: words[words.index(key) + 1] for key in ("--model", "--gpus", "--strategy") if key in words}
        cfg = load_config(path, check_model=False, check_paths=False)
        hub, cfg.model.name_or_path = cfg.model.name_or_path, str(REPO / option["--model"])
        gpus = int(option.get("--gpus", 1))
        plan = make_plan(cfg, devices=gpus, strategy=option.get("--strategy"), gpu=True)
        active = f" ({plan.active_params:,})" if plan.active_params < plan.total_params else ""
        spread = f" each of {gpus} GPUs (`--gpus {gpus} --strategy {option['--strategy']}`)" if gpus > 1 else ", 1 GPU"
        lines.append(f"| {path.stem} | {hub} | {plan.total_params:,}{active} | {plan.total / GiB:.2f} GiB{spread} |")
    return lines


def main() -> None:
    lines = table() + ["", "Sizes in GiB per GPU. Commands: `finetune plan --config configs/presets/PRESET.yaml --model docs/examples/MODEL "
              "--gpus N --strategy S --gpu-mem M --tflops T --mfu 0.4 --bandwidth B` with the overrides in bench/plan_table.py.", "",
              "The worked examples (`finetune plan --config docs/examples/CONFIG --gpu-mem 80GiB`), one GPU:", "", *worked_examples(), "",
              "The presets (each one's own `finetune plan` line: `--config configs/presets/PRESET.yaml --model MODEL --gpu-mem 80GiB`, "
              "with `--gpus N --strategy S` where it names them):", "", *presets()]
    report("plan", lines)


if __name__ == "__main__":
    main()
