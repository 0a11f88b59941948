"""Vision-language families: is finetune's loss the model's own, and do rows with pictures pack exactly?

Each family is built tiny from its transformers config (random weights; finetune/model/tiny.py: the demo tokenizer
given the family's picture tokens, 56 x 56 pictures), its rows of pictures tokenized by the data step. Per family:

  own forward    finetune's loss (the fused head on the language model's hidden states, at the trained positions)
                 and its LoRA gradients against the model's own loss with labels on the same unpacked batch
  packing        packed rows against the same samples one a row (loss and LoRA gradients), where the family
                 packs; else the one line finetune refuses packing with

Largest relative differences (a gradient that is zero in exact arithmetic is measured against 1e-4 of the largest).
About a minute on 2 CPU cores.

usage: python bench/vision_families.py   (make bench-families; results: bench/results/vision-families.md)
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from common import REPO, loss_and_grads, report

# name: tower (tiny.build_vision_model), or (tower, language model settings)
FAMILIES = {"LLaVA, CLIP tower": "clip", "LLaVA, SigLIP tower": "siglip", "Gemma 3": "gemma3", "Idefics3 / SmolVLM": "idefics3",
            "SmolVLM2": "smolvlm", "Mllama": "mllama", "Qwen2-VL": "qwen2_vl", "Qwen2.5-VL": "qwen2_5_vl", "Qwen3-VL": "qwen3_vl",
            "Qwen3-VL-MoE": "qwen3_vl_moe", "Qwen3.5": "qwen3_5", "Qwen3.5-MoE": "qwen3_5_moe", "Gemma 4": "gemma4",
            "LLaVA-OneVision": "llava_onevision", "InternVL": "internvl", "Mistral 3 (Pixtral)": "mistral3",
            "Gemma 4, use_bidirectional_attention: vision": ("gemma4", {"use_bidirectional_attention": "vision"})}
QUESTION = "What shape is in the picture?"
UNPACKED = {"gemma3": "a picture's tokens attend to each other both ways", "mllama": "a row's pictures are cross-attended, not tokens in it",
            "gemma4": "a picture's tokens attend to each other both ways in the sliding layers"}


def build(work: Path, tower: str, language: dict | None = None) -> tuple[Path, Path]:
    """A tiny model of the family and 24 rows about pictures: (model folder, rows file)."""
    from transformers import AutoTokenizer

    from finetune.demo import CORPUS, draw_pictures
    from finetune.model.tiny import build_tokenizer, build_vision_model

    texts = [json.loads(line)["text"] for line in (REPO / CORPUS).read_text().splitlines()[:400]]
    build_tokenizer(texts).save_pretrained(work / "tok")
    model = build_vision_model(work / tower, AutoTokenizer.from_pretrained(work / "tok"), tower, language=language)
    pictures = draw_pictures(work / "img", 24, seed=0)
    rows = work / "rows.jsonl"
    rows.write_text("".join(json.dumps({"images": [f"img/{p['file']}"], "messages": [
        {"role": "user", "content": f"<image>\n{QUESTION}"}, {"role": "assistant", "content": p["shape"]}]}) + "\n" for p in pictures))
    return model, rows


# rows' lengths (one sample a row, packed): Gemma 4's smallest picture is 64 tokens
LENGTHS = {"gemma4": (160, 320)}


def split(model_dir: Path, rows: Path, cache: Path, packing: bool):
    from finetune.config.schema import DataConfig, ModelConfig
    from finetune.data.datasets import load_data
    from finetune.model import vision
    from finetune.model.loading import load_tokenizer

    processor = vision.processor_for(ModelConfig(name_or_path=str(model_dir)))
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(model_dir)), processor)
    length = LENGTHS.get(json.loads((model_dir / "config.json").read_text())["model_type"], (96, 160))[packing]
    cfg = DataConfig(train=str(rows), format="chat", max_seq_len=length, packing=packing, eval_fraction=0.0, cache_dir=str(cache))
    return load_data(cfg, tokenizer, seed=0, processor=processor).train, tokenizer


def lora_model(model_dir: Path):
    """The model with finetune's LoRA, its B not 0 (B = 0 would hide the adapter's gradients in A), its linear-attention layers
    run one packed sample at a time (Qwen3.5), as finetune's loader leaves a model."""
    from transformers import AutoModelForImageTextToText

    from finetune.config.schema import AdapterConfig
    from finetune.model import mixers
    from finetune.model.loading import apply_adapter

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    mixers.register(model)
    model = apply_adapter(model, AdapterConfig(r=8, dropout=0.0), False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model



def differences(a: tuple[float, dict], b: tuple[float, dict]) -> tuple[float, float]:
    floor = 1e-4 * max(g.abs().max().item() for g in b[1].values())
    return abs(a[0] - b[0]) / abs(b[0]), max((a[1][n] - g).abs().max().item() / max(g.abs().max().item(), floor) for n, g in b[1].items())


def measure(work: Path, tower: str, language: dict | None = None) -> dict:
    from finetune.data.rows import IGNORE
    from finetune.model.vision import packable
    from finetune.objectives.loss import losses, picture_inputs, to_device

    model_dir, rows = build(work, tower, language)
    family = json.loads((model_dir / "config.json").read_text())["model_type"]
    unpacked, tokenizer = split(model_dir, rows, work / "cache", packing=False)
    model = lora_model(model_dir)
    batch = unpacked.batch([0, 1, 2, 3], tokenizer.pad_token_id)
    count = int((batch["labels"][:, 1:] != IGNORE).sum())
    ours = loss_and_grads(model, lambda: losses(model, to_device(batch, "cpu")).tokens / count)
    theirs = loss_and_grads(model, lambda: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                                                 **picture_inputs(batch)).loss)
    row = {"own": differences(ours, theirs)}
    if not packable(json.loads((model_dir / "config.json").read_text())):
        row["packing"] = "refused: " + UNPACKED[family]
        return row
    packed, _ = split(model_dir, rows, work / "cache-packed", packing=True)
    chosen = [0, 1, 2]
    samples = [int(x) for r in chosen for x in packed.samples[packed.order[packed.offsets[r] : packed.offsets[r + 1]]]]
    row_of = {int(x): i for i, x in enumerate(unpacked.samples)}
    together = packed.batch(chosen, tokenizer.pad_token_id)
    apart = unpacked.batch([row_of[x] for x in samples], tokenizer.pad_token_id)
    row["packing"] = f"exact ({len(samples)} samples in {len(chosen)} rows)"
    row["packed"] = differences(*(loss_and_grads(model, lambda b=b: losses(model, to_device(b, "cpu")).tokens) for b in (together, apart)))
    return row


def main() -> None:
    lines = ["| family | loss vs its own forward | LoRA grads vs its own | packing | packed loss vs one a row | packed grads |", "|---|---|---|---|---|---|"]
    for name, tower in FAMILIES.items():
        with tempfile.TemporaryDirectory() as work:
            try:
                row = measure(Path(work), *((tower, None) if isinstance(tower, str) else tower))
            except Exception as err:  # noqa: BLE001 - a row of the table, not the end of the sweep
                lines.append(f"| {name} | error: {type(err).__name__}: {str(err).splitlines()[0][:120]} | | | | |")
                print(lines[-1], flush=True)
                continue
        packed = row.get("packed")
        lines.append(f"| {name} | {row['own'][0]:.1e} | {row['own'][1]:.1e} | {row['packing']} | "
                     + (f"{packed[0]:.1e} | {packed[1]:.1e} |" if packed else "- | - |"))
        print(lines[-1], flush=True)
    lines += ["", f"torch {torch.__version__}, transformers {__import__('transformers').__version__}; tiny random models (2-layer towers 32 wide, "
              "2-layer language models 64 wide), 56 x 56 pictures, LoRA r 8 on the language model, fp32."]
    report("vision-families", lines)


if __name__ == "__main__":
    main()
