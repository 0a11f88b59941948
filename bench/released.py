"""Released models at full size on this machine: `finetune plan` against the measured peak.

Each shape is a released `config.json` (docs/examples/NAME) with random bf16 weights and its family's real
tokenizer (tests/released.py), built once under $FINETUNE_CACHE/bench-released. Each run is a fresh
`finetune train` process, LoRA r 8 in fp32, one row of SEQ packed tokens, 2 steps, with
MALLOC_MMAP_THRESHOLD_=131072 (RSS then tracks the live tensors, as tests/test_plan.py measures), sampled every
0.25 s; measured = peak anonymous RSS (the mapped safetensors' clean pages left out) - anonymous RSS before the
model loaded; planned = finetune plan's total for the same config.

Usage: python bench/released.py [--steps 2] [--only qwen2.5-0.5b,...]   (make bench-released, ~15 min)
Prints a markdown table and writes it to bench/results/released.md.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from common import REPO, cpu_name, report, steps_and_parts
from large import planned, train

sys.path.insert(0, str(REPO / "tests"))
from released import SHAPES, released_config, tokenizer_dir  # noqa: E402

CACHE = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "bench-released"
SEQ = 512
RUNS = {"qwen2.5-0.5b": {}, "qwen3-0.6b": {}, "llama-3.2-1b": {}, "gemma-3-1b": {}, "qwen2.5-0.5b full": {"adapter": {"method": "full"}}}


def model(name: str) -> Path:
    from transformers import AutoConfig, AutoTokenizer

    from finetune.model.tiny import write_random_model

    out = CACHE / name
    if not (out / "config.json").is_file():
        values = {k: v for k, v in released_config(name).items() if not k.startswith("_") and k not in ("architectures", "transformers_version")}
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        write_random_model(out, config, AutoTokenizer.from_pretrained(tokenizer_dir(SHAPES[name])), shard_bytes=1 << 30)
    return out


def parameters(folder: Path) -> int:
    """The model's parameters (a tied head once), from a build on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).parameters())


def main() -> None:
    args, wanted = steps_and_parts(__doc__, 2, "")
    work = CACHE / "runs"
    work.mkdir(parents=True, exist_ok=True)
    lines = [f"{cpu_name()}, {os.cpu_count()} cores; LoRA r 8, dropout 0.05 (or full, AdamW) in fp32, 1 x {SEQ} tokens, {args.steps} steps", "",
             "| run | parameters | planned (MiB) | measured (MiB) | planned / measured |", "| --- | --- | --- | --- | --- |"]
    for run, sections in RUNS.items():
        name = run.split()[0]
        if not wanted(name):
            continue
        cfg = {"model": {"name_or_path": str(model(name)), "dtype": "float32"}, "adapter": {"method": "lora", "r": 8, "alpha": 16},
               "data": {"train": str(REPO / "demo" / "data" / "train.jsonl"), "format": "alpaca", "max_seq_len": SEQ, "packing": True, "eval": None},
               "train": {"output_dir": str(work / run.replace(" ", "-")), "max_steps": args.steps, "micro_batch_size": 1, "lr": 1e-4,
                         "mixed_precision": "no"},
               "logging": {"report_to": [], "progress_bar": False, "plot": False}, "checkpoint": {"save_every": 0}}
        for section, values in sections.items():
            cfg[section].update(values)
        shutil.rmtree(cfg["train"]["output_dir"], ignore_errors=True)  # this bench's own run of last time (training refuses a finished one)
        result = train(work, run, 1, cfg, env={"MALLOC_MMAP_THRESHOLD_": "131072"})
        if result["code"] != 0:
            lines.append(f"| {run} | | | exit {result['code']}: {result['console'].strip().splitlines()[-1][:120]} | |")
            continue
        summary = result["summary"]
        measured = result["anon"][0] - summary["anonymous_before_model_mib"]
        plan = planned(cfg, 1, "none")
        params = parameters(model(name))
        lines.append(f"| {run} | {params / 1e9:.2f}B | {plan:,.0f} | {measured:,.0f} | {plan / measured:.2f} |")
        print(lines[-1], flush=True)
    report("released", lines)


if __name__ == "__main__":
    main()
