"""What the benchmarks share: the repo paths and a model of a chosen size built from config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "demo" / "data"
sys.path.insert(0, str(REPO))


def build_model(out: Path, layers: int, hidden: int, dtype: str = "float32", vocab: int | None = None) -> float:
    """A Llama-architecture model with random weights and the demo tokenizer, saved as an HF folder. MiB of weights.

    vocab: embedding rows (default: the tokenizer's); a real model's 32k+ makes the lm_head's share real."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.demo import build_tokenizer

    texts = [json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
    tok = build_tokenizer(texts)
    config = LlamaConfig(vocab_size=vocab or len(tok), hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def report(name: str, lines: list[str], results: Path = REPO / "bench" / "results") -> None:
    """Print a result table and keep it in RESULTS/NAME.md (bench/results: quoted by the README)."""
    table = "\n".join(lines)
    print(table)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.md").write_text(table + "\n")
