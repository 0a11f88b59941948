"""The demo base model: a small but real Llama language model built from the shipped corpus.

1. train a byte-level BPE tokenizer on the corpus (with bos/eos/pad tokens and a chat template: model/tiny);
2. build a `LlamaForCausalLM` from a config (random weights: model/tiny) and save it as an HF folder;
3. pretrain it on the corpus with finetune's own full fine-tuning (`finetune.train.run`);
4. move the result into place atomically: an existing model folder is never half-overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from finetune.checkpoint.locks import LOCK_FILE
from finetune.config.errors import UserError
from finetune.model.tiny import build_model, build_tokenizer, build_vision_model

CORPUS = "demo/data/corpus.jsonl"
# 600 steps: after 300 the base's sense of which words are adjectives and verbs still moved with the CPU's arithmetic
# (docs/platform-notes.md), and so did `make demo`'s held-out exact match; bench/results/demos.md has it now.
PRETRAIN_STEPS = 600


def make_demo_model(out: str, steps: int | None = None, overwrite: bool = False, corpus: str = CORPUS, shape: dict | None = None) -> Path:
    from finetune.config.schema import validate_config
    from finetune.train import run

    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"make-demo-model: --out {out_dir} is a file; expected a folder")
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if held and not overwrite:
        if (out_dir / "config.json").exists():
            print(f"demo model already at {out_dir} (--overwrite rebuilds it)")
            return out_dir
        raise UserError(f"make-demo-model: --out {out_dir} holds files ({', '.join(held[:3])}); choose an empty folder, or pass "
                        "--overwrite to write the demo model's files there (the others are kept)")
    corpus_path = Path(corpus)
    if not corpus_path.is_file():
        raise UserError(f"{corpus}: demo corpus not found (run from the repository root)")
    texts = [json.loads(line)["text"] for line in corpus_path.read_text().splitlines() if line.strip()]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=out_dir.parent))
    try:
        init = work / "init"
        tokenizer = build_tokenizer(texts)
        build_model(tokenizer, shape).save_pretrained(init)
        tokenizer.save_pretrained(init)
        print(f"demo: tokenizer of {len(tokenizer)} tokens; pretraining a Llama model on {corpus} ...")
        cfg = validate_config(
            {
                "model": {"name_or_path": str(init), "dtype": "float32"},
                "adapter": {"method": "full"},
                "data": {"train": str(corpus_path), "format": "completion", "max_seq_len": 256, "eval_fraction": 0.02},
                "train": {
                    "output_dir": str(work / "pretrained"),
                    "max_steps": steps or PRETRAIN_STEPS,
                    "micro_batch_size": 8,
                    "lr": 2e-3,
                    "warmup_steps": 20,
                    "weight_decay": 0.01,
                },
                "logging": {"report_to": [], "log_every": 10},
            },
            "make-demo-model",
        )
        run(cfg)
        out_dir.mkdir(exist_ok=True)
        for made in (work / "pretrained").iterdir():  # file by file: what else the folder holds stays
            if made.is_file() and made.name != LOCK_FILE:
                os.replace(made, out_dir / made.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"demo model saved to {out_dir}")
    return out_dir


SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 220)}


def draw_pictures(folder: Path, count: int, seed: int, side: int = 56) -> list[dict]:
    """`count` pictures of one shape in one colour at a random place and size, saved as PNGs in `folder`;
    each picture's file name, shape and colour."""
    import random

    from PIL import Image, ImageDraw

    rng, out = random.Random(seed), []
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        size = rng.randint(side // 3, side * 2 // 3)
        x, y = rng.randint(0, side - size), rng.randint(0, side - size)
        picture = Image.new("RGB", (side, side), (245, 245, 240))
        draw = ImageDraw.Draw(picture)
        box = (x, y, x + size, y + size)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=COLOURS[colour])
        name = f"{i:05d}.png"
        picture.save(folder / name)
        out.append({"file": name, "shape": shape, "colour": colour})
    return out


# The vision demo: a tiny LLaVA whose base learned to describe pictures ("a red circle": 5,800 pictures,
# 1,500 full steps, the tower and projector trained too; ~1 min on 2 cores), then the question users
# fine-tune it on (configs/vision.yaml): "What shape is in the picture?", answered in one word, asked of
# pictures the base never saw. On 1,800 pictures the base saw each one 13 times and what it learned of shapes
# moved with the CPU's arithmetic (docs/platform-notes.md); bench/results/demos.md has it on 5,800.
VISION_PRETRAIN_STEPS = 1500
VISION_CAPTIONS = 5800
VISION_LANGUAGE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def make_vision_demo(out: str, steps: int | None = None, overwrite: bool = False) -> Path:
    """The vision demo's pictures and rows (OUT/data) and its pretrained base (OUT/model), built once."""
    from finetune.config.schema import validate_config
    from finetune.train import run

    root = Path(out)
    if (root / "model" / "config.json").is_file() and not overwrite:
        print(f"vision demo already at {root} (--overwrite rebuilds it)")
        return root
    if root.exists() and any(p.name not in ("model", "data") for p in root.iterdir()):
        raise UserError(f"make-vision-demo: --out {root} holds files finetune did not write; choose an empty folder")
    texts = [json.loads(line)["text"] for line in Path(CORPUS).read_text().splitlines()[:1500]]
    data = root / "data"
    shutil.rmtree(data, ignore_errors=True)
    pictures = draw_pictures(data / "img", VISION_CAPTIONS + 600, seed=1)
    describe = [_row(p, "Describe the picture.", f"a {p['colour']} {p['shape']}") for p in pictures[:VISION_CAPTIONS]]
    ask = [_row(p, "What shape is in the picture?", p["shape"]) for p in pictures[VISION_CAPTIONS:]]
    for name, rows in (("captions.jsonl", describe), ("train.jsonl", ask[:400]), ("eval.jsonl", ask[400:])):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = Path(tempfile.mkdtemp(prefix=".vision-demo-", dir=root))
    try:
        build_vision_model(work / "init", build_tokenizer(texts), "clip", language=VISION_LANGUAGE)
        print(f"vision demo: pretraining a tiny LLaVA to describe {len(describe)} pictures ...")
        cfg = validate_config({
            "model": {"name_or_path": str(work / "init"), "dtype": "float32"},
            "adapter": {"method": "full", "vision": "full", "projector": "full"},
            "data": {"train": str(data / "captions.jsonl"), "format": "chat", "max_seq_len": 64, "packing": False, "eval_fraction": 0.0},
            "train": {"output_dir": str(work / "pretrained"), "max_steps": steps or VISION_PRETRAIN_STEPS, "micro_batch_size": 16, "lr": 2e-3,
                      "warmup_steps": 20},
            # Checkpoints let the divergence guard roll a loss spike back at a lower LR rather than stop the build (every
            # 50 steps: on one thread a spike came before a first save at 250, docs/platform-notes.md).
            "eval": {"on_start": False}, "checkpoint": {"save_every": 50}, "logging": {"report_to": [], "log_every": 50},
            # A caption's loss levels out near 0.05 nats a token, where its noise makes a few hundredths look like drift.
            "guard": {"min_rise": 0.1},
        }, "make-vision-demo")
        run(cfg)
        shutil.rmtree(root / "model", ignore_errors=True)
        shutil.rmtree(work / "pretrained" / "checkpoints", ignore_errors=True)  # the final weights are the model; checkpoints were the guard's
        (work / "pretrained").rename(root / "model")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"vision demo: base model in {root / 'model'}, rows in {data}")
    return root


def _row(picture: dict, question: str, answer: str) -> dict:
    return {"images": [f"img/{picture['file']}"], "messages": [{"role": "user", "content": f"<image>\n{question}"},
                                                              {"role": "assistant", "content": answer}]}
