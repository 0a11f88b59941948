"""Rollout generation paths, measured: how fast each samples GRPO's completions on this device.

The model: a Llama of the given shape with random weights (in memory, never saved), the prompts random
token ids of 32-96 tokens, each prompt sampled `--generations` times to `--new-tokens` tokens at
temperature 1. A random model rarely samples its EOS, so nearly every completion runs to full length.

Paths:
  generate        finetune today: one left-padded `generate` call, the dynamic KV cache, the Gumbel sampler
                  (each completion's noise from its own seed: batch-independent, resumable), each prompt read once for
                  its `--generations` copies (sampling.shared_prefill)
  generate-each   the same, every copy of a prompt read (as before shared_prefill; as TRL's generate path reads them)
  generate-hf     the same call with transformers' own sampling (the Gumbel sampler's cost)
  static          the Gumbel sampler through a static KV cache (`cache_implementation="static"`; on CUDA
                  transformers compiles the decoding step: its first call, timed apart, pays the compile)
  continuous      transformers' continuous batching over a paged KV cache (`generate_batch`), its own sampling

usage: python bench/rollouts.py [--device cuda] [--shape 1.1b|demo] [--prompts 8] [--generations 8] [--new-tokens 256]
Prints a markdown table (tokens sampled per second, peak memory, the share of completions equal to the generate
path's) and writes it to bench/results/rollouts-DEVICE.md.
"""

from __future__ import annotations

import argparse
import time

from common import cpu_name, report

SHAPES = {"demo": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4),
          "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4)}


def build(shape: str, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPES[shape])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


class Tokens:  # what finetune.objectives.sampling.generate reads of a tokenizer
    pad_token_id, eos_token_id = 0, 2


def paths(model, prompts: list[list[int]], generations: int, new_tokens: int, device: str) -> dict:
    import numpy as np
    import torch
    from transformers import GenerationConfig
    from transformers.generation.logits_process import TemperatureLogitsWarper

    from finetune.objectives.sampling import GumbelSampler, generate

    repeated = [np.array(p) for p in prompts for _ in range(generations)]
    seeds = torch.arange(len(repeated), device=device, dtype=torch.int64) + 12345

    def ours(share: bool = True):
        return generate(model, Tokens, repeated, new_tokens, device, GumbelSampler(seeds, [TemperatureLogitsWarper(1.0)]), share=share)

    def hf_sampling():
        width = max(len(p) for p in repeated)
        ids = torch.zeros((len(repeated), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(repeated):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.as_tensor(p), 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=2)
        return [row[width:] for row in out.tolist()]

    def static():
        model.generation_config.cache_implementation = "static"
        try:
            return ours()
        finally:
            model.generation_config.cache_implementation = None

    def continuous():
        settings = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=2)
        out = model.generate_batch(inputs=[p.tolist() for p in repeated], generation_config=settings)
        return [o.generated_tokens for o in out.values()]

    return {"generate": ours, "generate-each": lambda: ours(share=False), "generate-hf": hf_sampling, "static": static, "continuous": continuous}


def measure(job, device: str) -> tuple[float, float, list]:
    """(first call's seconds, second call's seconds, the second's completions); peak memory is read by the caller."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, completions = [], []
    for _ in range(2):
        sync()
        start = time.perf_counter()
        completions = job()
        sync()
        times.append(time.perf_counter() - start)
    return times[0], times[1], completions


def main() -> None:
    import random

    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--only", help="comma-separated paths (default: all)")
    args = parser.parse_args()
    model = build(args.shape, args.device)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 32000) for _ in range(rng.randrange(32, 96))] for _ in range(args.prompts)]
    where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_name()
    lines = [f"Rollouts: a {args.shape} Llama (random weights), {args.prompts} prompts x {args.generations} completions of up to "
             f"{args.new_tokens} tokens, temperature 1, on {where}; torch {torch.__version__}", "",
             "| path | first call (s) | second call (s) | tokens sampled | tokens/s | peak memory (GiB) | completions as generate's |",
             "|---|---|---|---|---|---|---|"]
    reference = None
    for name, job in paths(model, prompts, args.generations, args.new_tokens, args.device).items():
        if args.only and name not in args.only.split(","):
            continue
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            first, second, completions = measure(job, args.device)
        except Exception as err:  # noqa: BLE001 - a path this stack cannot run is a row saying why, not the end of the table
            lines.append(f"| {name} | failed: {type(err).__name__}: {str(err).splitlines()[0][:160]} | | | | | |")
            print(lines[-1], flush=True)
            continue
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
        reference = reference or completions
        same = sum(list(a) == list(b) for a, b in zip(completions, reference)) / len(reference)
        tokens = sum(len(c) for c in completions)
        lines.append(f"| {name} | {first:.2f} | {second:.2f} | {tokens:,} | {tokens / second:,.0f} | {peak:.2f} | {same:.0%} |")
        print(lines[-1], flush=True)
    report(f"rollouts-{args.device}", lines)


if __name__ == "__main__":
    main()
