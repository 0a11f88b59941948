"""The gap between GRPO's sampler and its trainer on this machine: each completion token's log-probability as `generate`
drew it (the KV cache, eval mode, one token at a time) against the training forward's over the packed row at the same
weights (grpo.importance_sampling's weights are exp of that gap).

The model: the demo's (make demo builds it: a 4-layer Llama pretrained on the demo corpus), LoRA r 16 as configs/grpo.yaml
sets it (B = 0: the base's distributions). 16 of the demo's prompts (demo/data/prompts-train.jsonl), 8 completions each of at
most 32 tokens at temperature 1, through GRPO's own rollout (`_sampled`), in fp32 and under bf16 autocast (the training
forward's, which sampling runs under too). Per dtype: the tokens, the mean and largest |gap|, the mean KL(sampler || trainer)
(k3, from the sampler's own draws), and the sequence-level weights' range (TRL's default level) with the share above 3.0
(TRL's default cap: masked there).

usage: python bench/mismatch.py   (make bench-mismatch, about a minute on 2 cores; needs demo/model: make demo builds it)
Prints a markdown table and writes it to bench/results/mismatch.md.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from common import DATA, REPO, cpu_name, report

MODEL = REPO / "demo" / "model"
PROMPTS, GENERATIONS, LENGTH = 16, 8, 32


def gaps(dtype: str) -> dict[str, float]:
    """The trainer-less-sampler gap of every completion token GRPO's rollout samples, in `dtype`."""
    from finetune.config.schema import AdapterConfig, GRPOConfig, ModelConfig
    from finetune.data.encoding import prompt_ids
    from finetune.data.packing import Prompt
    from finetune.model.loading import apply_adapter, load_model, load_tokenizer
    from finetune.objectives.grpo import GRPO
    from finetune.objectives.objective import answers
    from finetune.objectives.rewards import load_rewards

    cfg = GRPOConfig(num_generations=GENERATIONS, max_completion_length=LENGTH, temperature=1.0, rewards=["exact_match"])
    model_cfg = ModelConfig(name_or_path=str(MODEL))
    tokenizer = load_tokenizer(model_cfg)
    model = apply_adapter(load_model(model_cfg, say=lambda _: None), AdapterConfig(r=16, alpha=32, dropout=0.0), False)
    rows = [json.loads(line) for line in (DATA / "prompts-train.jsonl").read_text().splitlines()[:PROMPTS]]
    prompts = [Prompt(np.asarray(prompt_ids(row, tokenizer)), row, i) for i, row in enumerate(rows)]
    objective = GRPO(cfg, load_rewards(cfg), seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        batches, _ = objective._sampled(model, tokenizer, [prompts], position=0, device="cpu", old_logps=True)
    batch = batches[0]
    keep = batch["old_logps"] != 0
    gap = (batch["old_logps"][keep] - batch["sampler_logps"]).double()
    lengths = torch.bincount(answers(batch, pairs=False)[1])
    weights = torch.exp(torch.stack([g.sum() for g in gap.split(lengths.tolist())]))
    return {"tokens": len(gap), "mean": gap.abs().mean().item(), "max": gap.abs().max().item(), "kl": (torch.exp(gap) - gap - 1).mean().item(),
            "low": weights.min().item(), "high": weights.max().item(), "over": (weights > 3.0).double().mean().item()}


def main() -> None:
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL} is missing: make demo builds it (or finetune make-demo-model --out demo/model)")
    torch.manual_seed(0)
    lines = [f"{cpu_name()}, torch {torch.__version__}; the demo model with LoRA r 16 (B = 0), {PROMPTS} prompts x {GENERATIONS} completions "
             f"of up to {LENGTH} tokens at temperature 1, GRPO's rollout: generate (KV cache) against the training forward", "",
             "| dtype | tokens | mean abs gap | max abs gap | mean KL (k3) | sequence weights | over 3.0 |", "|---|---|---|---|---|---|---|"]
    for dtype in ("fp32", "bf16"):
        g = gaps(dtype)
        lines.append(f"| {dtype} | {g['tokens']} | {g['mean']:.2e} | {g['max']:.2e} | {g['kl']:.2e} | {g['low']:.4f} to {g['high']:.4f} | "
                     f"{g['over']:.1%} |")
        print(lines[-1], flush=True)
    report("mismatch", lines)


if __name__ == "__main__":
    main()
