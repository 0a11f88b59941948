"""GRPO steps per second: finetune's loop against TRL's GRPOTrainer on the same model, prompts and settings.

The model: a 4-layer Llama of hidden size 256 with the demo tokenizer (random weights, built once under
$FINETUNE_CACHE/bench-grpo), LoRA r 16 on every linear layer, fp32. Each step: 8 of the demo's prompts
(demo/data/prompts-train.jsonl, chat), 8 completions each of at most 16 tokens sampled at temperature 1,
the exact-match reward, loss dapo, beta 0 (no reference forward), gradient checkpointing off (TRL's
default is on: set off for it, as finetune's), one process. A random model rarely
ends a completion early, so both sample about the full 16 tokens. Timed from the end of the first step to
the end of the last (the first includes warm-up). Each generation path: finetune's dynamic and static KV
cache (grpo.kv_cache), finetune's asynchronous rollouts (grpo.async_rollouts: the next step's completions
sampled in a thread while a step trains), TRL's default, its static cache and its transformers continuous
batching (paged cache). TRL's asynchronous GRPO (trl.experimental.async_grpo) samples on a vLLM server, which
this CPU machine has not: not run.

usage: python bench/grpo.py [--steps 12]   (make bench-grpo, ~8 min on 2 cores)
Prints a markdown table and writes it to bench/results/grpo.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from common import DATA, REPO, build_model, cpu_name, report

CACHE = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "bench-grpo"
PROMPTS, GENERATIONS, LENGTH, LR = 8, 8, 16, 1e-4


def our_config(model: Path, steps: int, out: Path, kv_cache: str = "dynamic", async_rollouts: bool = False) -> dict:
    return {"model": {"name_or_path": str(model)}, "adapter": {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0},
            "data": {"train": str(DATA / "prompts-train.jsonl"), "format": "prompt", "max_seq_len": 128},
            "train": {"output_dir": str(out), "objective": "grpo", "max_steps": steps, "micro_batch_size": PROMPTS, "lr": LR, "scheduler": "constant",
                      "gradient_checkpointing": False},
            "grpo": {"num_generations": GENERATIONS, "max_completion_length": LENGTH, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                     "loss_type": "dapo", "beta": 0.0, "kv_cache": kv_cache, "async_rollouts": async_rollouts},
            "eval": {"on_start": False}, "guard": {"enabled": False},
            "logging": {"report_to": [], "progress_bar": False, "plot": False}}


def trl_args(steps: int, out: Path, **generation):
    """TRL's GRPOConfig with our_config's settings (TRL 1.16 checkpoints gradients by default; finetune does not: off in both);
    `generation`: how it generates (use_transformers_continuous_batching, cache_implementation)."""
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * GENERATIONS, num_generations=GENERATIONS,
                      max_completion_length=LENGTH, temperature=1.0, top_k=0, top_p=1.0, loss_type="dapo", beta=0.0, learning_rate=LR,
                      lr_scheduler_type="constant", max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                      save_strategy="no", gradient_checkpointing=False, **generation)


def ours(model: Path, steps: int, out: Path, **generation) -> list[float]:
    """finetune's step end times (s); `generation`: grpo.kv_cache, grpo.async_rollouts."""
    from finetune.config.schema import validate_config
    from finetune.train import run

    run(validate_config(our_config(model, steps, out, **generation), "bench"))
    return [r["time"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def trls(model: Path, steps: int, out: Path, **generation) -> list[float]:
    """TRL GRPOTrainer's step end times (s), on the same prompts and settings."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    rows = [json.loads(line) for line in (DATA / "prompts-train.jsonl").read_text().splitlines()]
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

    def exact_match(completions, answer, **_):
        return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=[exact_match], args=trl_args(steps, out, **generation),
                          train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(model),
                          peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"), callbacks=[Clock()])
    trainer.train()
    return ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    model = CACHE / "model"
    if not (model / "config.json").exists():
        build_model(model, layers=4, hidden=256)
    lines = [f"GRPO, {PROMPTS} prompts x {GENERATIONS} completions of <= {LENGTH} tokens a step, LoRA r16, fp32, no gradient checkpointing, 1 process "
             f"({cpu_name()}, {os.cpu_count()} cores); steps 2-{args.steps} timed",
             "", "| runner | s/step | completions/s |", "|---|---|---|"]
    runners = (("finetune", ours, {}), ("finetune, grpo.kv_cache: static", ours, {"kv_cache": "static"}),
               ("finetune, grpo.async_rollouts (one step off-policy)", ours, {"async_rollouts": True}), ("TRL GRPOTrainer", trls, {}),
               ("TRL GRPOTrainer, static cache", trls, {"cache_implementation": "static"}),
               ("TRL GRPOTrainer, continuous batching (paged)", trls, {"use_transformers_continuous_batching": True}))
    for i, (name, runner, generation) in enumerate(runners):
        out = CACHE / f"run{i}"
        shutil.rmtree(out, ignore_errors=True)  # this benchmark's own output of an earlier run
        ends = runner(model, args.steps, out, **generation)
        per_step = (ends[-1] - ends[0]) / (len(ends) - 1)
        lines.append(f"| {name} | {per_step:.2f} | {PROMPTS * GENERATIONS / per_step:.0f} |")
    report("grpo", lines)


if __name__ == "__main__":
    main()
