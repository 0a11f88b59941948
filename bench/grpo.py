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

--variants: each loss and estimator (grpo.loss_type, grpo.ratio sequence = GSPO, grpo.advantage, the mismatch correction)
from the demo's GRPO starting point (make demo-grpo's SFT stage, merged: the demo model answering the prompts), as
configs/grpo.yaml trains it (8 prompts x 8 completions of <= 12 tokens at temperature 0.7, top-k 20, beta 0.04, LoRA r16,
lr 5e-4 constant, no checkpointing) for --variant-steps steps, against TRL's GRPOTrainer at the same settings where TRL 1.16
has the variant: s/step, the mean reward of the sampled completions, and the held-out exact match (greedy, the demo's 36
eval prompts, the same function for both). Writes bench/results/grpo-variants.md (~25 min on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
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


# name -> (finetune's grpo settings, TRL's GRPOConfig settings or None where TRL 1.16's GRPOTrainer has no such variant)
VARIANTS = {
    "grpo": ({"loss_type": "grpo"}, {"loss_type": "grpo"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"loss_type": "dr_grpo"}),
    "dapo (clip-higher 0.28)": ({"loss_type": "dapo", "epsilon_high": 0.28}, {"loss_type": "dapo", "epsilon_high": 0.28}),
    "gspo (ratio: sequence)": ({"loss_type": "grpo", "ratio": "sequence"}, {"loss_type": "grpo", "importance_sampling_level": "sequence"}),
    "cispo (cap 5)": ({"loss_type": "cispo", "epsilon_high": 5.0}, {"loss_type": "cispo", "epsilon_high": 5.0}),
    "sapo": ({"loss_type": "sapo"}, {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}),
    "rloo": ({"advantage": "rloo"}, None),
    "reinforce_pp": ({"advantage": "reinforce_pp"}, None),
    "grpo + mismatch correction (sequence, mask, 3)": ({"importance_sampling": {"level": "sequence", "mode": "mask", "cap": 3.0}}, None),
}
VARIANT_EVAL = DATA / "prompts-eval.jsonl"


def variant_config(model: Path, steps: int, out: Path, grpo: dict) -> dict:
    """configs/grpo.yaml's GRPO stage, its LR constant, no evaluation during the run."""
    return {"model": {"name_or_path": str(model), "dtype": "float32"}, "adapter": {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0},
            "data": {"train": str(DATA / "prompts-train.jsonl"), "format": "prompt", "max_seq_len": 128},
            "train": {"output_dir": str(out), "objective": "grpo", "max_steps": steps, "micro_batch_size": PROMPTS, "lr": 5e-4,
                      "scheduler": "constant", "gradient_checkpointing": False},
            "grpo": {"num_generations": GENERATIONS, "max_completion_length": 12, "temperature": 0.7, "top_k": 20, "beta": 0.04, **grpo},
            "eval": {"on_start": False, "every": 0}, "guard": {"enabled": False},
            "logging": {"report_to": [], "progress_bar": False, "plot": False}}


def held_out(model, tokenizer) -> float:
    """Greedy exact match on the demo's eval prompts: the same function for both trainers' models."""
    from finetune.objectives.evaluate import exact_match

    rows = [json.loads(line) for line in VARIANT_EVAL.read_text().splitlines() if line.strip()]
    model.eval()
    return exact_match(model, tokenizer, rows, "prompt", 12)["exact_match"]


def starting_policy() -> Path:
    """make demo-grpo's SFT stage, merged (built once under the cache)."""
    from finetune.cli import main as finetune

    merged = CACHE / "sft-merged"
    if not (merged / "config.json").exists():
        if not (REPO / "demo" / "model" / "config.json").exists():
            raise SystemExit("bench-grpo --variants: the demo model is missing; run make demo-grpo (or make demo) first")
        sft = CACHE / "sft"
        shutil.rmtree(sft, ignore_errors=True)
        for argv in (["train", "--config", "configs/demo.yaml", "--output-dir", str(sft), "--set", "train.max_steps=225", "--set", "eval.every=0"],
                     ["merge", "--adapter", str(sft), "--out", str(merged)]):
            with contextlib.chdir(REPO):  # the demo config's paths are the repository's
                if finetune(argv):
                    raise SystemExit(f"bench-grpo --variants: finetune {argv[0]} failed")
    return merged


def our_variant(model: Path, steps: int, out: Path, grpo: dict) -> tuple[float, float, float]:
    """(s/step, mean sampled reward over the steps, held-out exact match) of finetune's run."""
    from transformers import AutoTokenizer

    from finetune.config.schema import validate_config
    from finetune.train import run

    result = run(validate_config(variant_config(model, steps, out, grpo), "bench"))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    per_step = (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1)
    return per_step, sum(r["reward"] for r in rows) / len(rows), held_out(result.model, AutoTokenizer.from_pretrained(model))


def trl_variant(model: Path, steps: int, out: Path, settings: dict) -> tuple[float, float, float]:
    """The same for TRL's GRPOTrainer at variant_config's settings."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in (DATA / "prompts-train.jsonl").read_text().splitlines()]
    ends, rewards = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    def exact_match(completions, answer, **_):
        return [float(c[-1]["content"].strip() == a.strip()) for c, a in zip(completions, answer)]

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * GENERATIONS, num_generations=GENERATIONS,
                      max_completion_length=12, temperature=0.7, top_k=20, top_p=1.0, beta=0.04, learning_rate=5e-4,
                      lr_scheduler_type="constant", max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                      save_strategy="no", gradient_checkpointing=False, **settings)
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=[exact_match], args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"), callbacks=[Clock()])
    trainer.train()
    per_step = (ends[-1] - ends[0]) / (len(ends) - 1)
    return per_step, sum(rewards) / len(rewards), held_out(trainer.model, tokenizer)


def variants(steps: int) -> None:
    policy = starting_policy()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = held_out(AutoModelForCausalLM.from_pretrained(policy), AutoTokenizer.from_pretrained(policy))
    lines = [f"GRPO variants from the demo's SFT model (held-out exact match at the start: {start:.1%}), {steps} steps of {PROMPTS} prompts x "
             f"{GENERATIONS} completions (configs/grpo.yaml's settings, lr constant), 1 process ({cpu_name()}, {os.cpu_count()} cores)", "",
             "| variant | finetune s/step | TRL s/step | finetune mean reward | TRL mean reward | finetune held-out exact match | TRL held-out exact match |",
             "|---|---|---|---|---|---|---|"]
    for i, (name, (ours_settings, trl_settings)) in enumerate(VARIANTS.items()):
        out = CACHE / f"variant{i}"
        shutil.rmtree(out, ignore_errors=True)
        mine = our_variant(policy, steps, out, ours_settings)
        theirs = trl_variant(policy, steps, CACHE / f"variant{i}-trl", trl_settings) if trl_settings is not None else None
        cells = [f"{mine[0]:.2f}", f"{theirs[0]:.2f}" if theirs else "not in TRL's GRPOTrainer", f"{mine[1]:.3f}",
                 f"{theirs[1]:.3f}" if theirs else "", f"{mine[2]:.1%}", f"{theirs[2]:.1%}" if theirs else ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    report("grpo-variants", lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--variants", action="store_true", help="the losses and estimators against TRL (bench/results/grpo-variants.md)")
    parser.add_argument("--variant-steps", type=int, default=30)
    args = parser.parse_args()
    if args.variants:
        variants(args.variant_steps)
        return
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
