"""Hybrid linear-attention models packed against padded (make bench-hybrid): what exact packing (model/mixers.py)
buys on this machine.

Models, random weights, the demo tokenizer, scaled down with their layer pattern kept:
  - qwen3.5: Qwen3.5's text model (transformers' Qwen3_5TextConfig): three Gated DeltaNet layers to one of full
    attention, 4 layers, hidden 512, linear attention 4 key / 8 value heads of 64, attention 8 heads of 64 (2 key/value)
  - lfm2: LFM2's short convolutions beside attention (the same widths), 4 layers: 3 convolutions, 1 attention

Data: 2,000 alpaca rows whose answers join 1-12 of the demo corpus's texts (a log-normal count: lengths spread as
in instruction data, most short, a long tail; the table's footnote gives them in tokens). Each model trains them with
LoRA r 16 on every linear layer, fp32, one process, `finetune train` in this process, twice with the same settings but
the rows: packed (one row of up to 2,048 tokens a step) and padded (one sample a row, 8 rows a step, padded to the
longest: about as many samples). Per run:
  real tok/s     non-padding tokens trained per second (the median of steps 3 to the end, as the run logs it)
  tokens/step    the real tokens a step trained, on average
  diff           packed and padded rows of the same 5 samples: finetune's loss and gradients, largest relative difference
                 (a gradient zero in exact arithmetic against 1e-4 of the largest, as bench/families.py); and but the
                 Gated DeltaNet's decay parameters, whose gradients sum every token's with cancellation

Usage: python bench/hybrid.py [--steps 12]   (results: bench/results/hybrid.md)
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from common import DATA, cpu, head_commit, loss_and_grads, report, steps_and_parts

WIDTHS = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096)
MODELS = {  # name: (model_type, what the config adds)
    "qwen3.5": ("qwen3_5_text", dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                     layer_types=["linear_attention"] * 3 + ["full_attention"])),
    "lfm2": ("lfm2", dict(layer_types=["conv"] * 3 + ["full_attention"])),
}


def build(work: Path, name: str) -> Path:
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.model.tiny import build_tokenizer

    tokenizer = build_tokenizer([json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()[:1500]])
    kind, extra = MODELS[name]
    config = AutoConfig.for_model(kind, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, **WIDTHS, **extra)
    torch.manual_seed(0)
    out = work / name
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_rows(path: Path, count: int = 2000) -> Path:
    """Alpaca rows whose answers join a log-normal number (1-12) of the demo corpus's texts."""
    import json
    import random

    texts = [json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            joined = " ".join(rng.choice(texts) for _ in range(min(12, max(1, round(rng.lognormvariate(0.7, 0.8))))))
            f.write(json.dumps({"instruction": "Continue the story.", "input": "", "output": joined}) + "\n")
    return path


def train(model_dir: Path, rows: Path, out: Path, packed: bool, steps: int) -> dict:
    from accelerate.state import AcceleratorState

    from finetune.config.schema import validate_config
    from finetune.train import run

    cfg = {"model": {"name_or_path": str(model_dir), "dtype": "float32"}, "adapter": {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0},
           "data": {"train": str(rows), "format": "alpaca", "max_seq_len": 2048, "packing": packed, "eval": None},
           "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 1 if packed else 8, "lr": 1e-3},
           "eval": {"on_start": False}, "logging": {"report_to": [], "progress_bar": False, "plot": False},
           "checkpoint": {"save_every": 0}}
    run(validate_config(cfg, "bench-hybrid"))
    AcceleratorState._reset_state(True)
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"tok/s": statistics.median(r["tokens_per_s"] for r in rows[2:]), "tokens": rows[-1]["tokens"] / len(rows)}


def sample_lengths(rows: Path, model_dir: Path) -> list[int]:
    import json

    from transformers import AutoTokenizer

    from finetune.data.encoding import tokenize_row

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [len(tokenize_row(json.loads(line), tokenizer, "alpaca", False)["input_ids"]) for line in rows.read_text().splitlines()]


GATES = ("A_log", "dt_bias")  # Gated DeltaNet's decay: each gradient a sum over every token's, with cancellation


def exactness(model_dir: Path) -> tuple[float, float, float]:
    """finetune's loss and gradients over 5 samples packed into 2 rows against the same samples one a row: the loss's
    relative difference, the gradients' largest, and the largest but the linear attention's decay parameters'."""
    from families import batch, samples

    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.objectives import loss

    model = load_model(ModelConfig(name_or_path=str(model_dir)), say=lambda _: None).train()
    data = [(ids, labels) for ids, labels in samples()]
    (packed, pg), (padded, ug) = (loss_and_grads(model, lambda p=p: loss.token_loss_sum(model, batch(data, p))) for p in (True, False))
    floor = 1e-4 * max(g.abs().max().item() for g in ug.values())  # as bench/families.py: a gradient zero in exact arithmetic holds rounding
    apart = {n: (pg[n] - g).abs().max().item() / max(g.abs().max().item(), floor) for n, g in ug.items()}
    return abs(packed - padded) / padded, max(apart.values()), max(v for n, v in apart.items() if not n.endswith(GATES))


def main() -> None:
    args, _ = steps_and_parts(__doc__, 12, "")
    lines = ["| model | rows | real tok/s | real tokens/step | speed-up | loss diff | grad diff | but A_log, dt_bias |", "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as work:
        rows = write_rows(Path(work) / "rows.jsonl")
        for name in MODELS:
            folder = build(Path(work), name)
            runs = {packed: train(folder, rows, Path(work) / f"{name}-{packed}", packed, args.steps) for packed in (True, False)}
            loss_diff, grad_diff, others = exactness(folder)
            for packed in (True, False):
                speedup = runs[packed]["tok/s"] / runs[False]["tok/s"]
                lines.append(f"| {name} | {'packed' if packed else 'padded'} | {runs[packed]['tok/s']:.0f} | {runs[packed]['tokens']:.0f} | "
                             f"{speedup:.2f}x | {loss_diff:.1e} | {grad_diff:.1e} | {others:.1e} |")
                print(lines[-1], flush=True)
        lengths = sample_lengths(rows, folder)
    lines += ["", f"Sample lengths in tokens: median {statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.0f}, "
              f"95th percentile {sorted(lengths)[len(lengths) * 95 // 100]}, longest {max(lengths)}.",
              f"{cpu()}, torch {torch.__version__}, commit {head_commit()}; `python bench/hybrid.py --steps {args.steps}`."]
    report("hybrid", lines)


if __name__ == "__main__":
    main()
