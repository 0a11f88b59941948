"""finetune's pictures-only processor (Qwen-VL without torchvision) against the family's own, where torchvision is.

Without torchvision, transformers cannot build Qwen-VL's processor (its video half needs it); finetune builds it
for pictures only, with the image processor's PIL version (finetune/model/vision.py). This checks that where
torchvision is installed, the folders finetune writes load as the family's processor, and that the tokens and
pixels are the same. Two halves, in two environments:

  python bench/pictures_only.py build WORK      # here: a tiny Qwen2.5-VL (the released folder's layout), 12 LoRA
                                                # steps, the merge; ids, pixels and the merged model's logits for three
                                                # pictures as finetune makes them (WORK/ours.safetensors)
  OTHER/bin/python bench/pictures_only.py compare WORK
                                                # in an environment with torchvision (transformers, peft, pillow only):
                                                # AutoProcessor on the base, adapter and merged folders; the table

usage: results in bench/results/pictures-only.md (written by compare)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common import REPO, report

QUESTION = "What shape is in the picture?"
SIZES = {"56 x 56": (56, 56), "100 x 70": (100, 70), "500 x 375": (500, 375)}  # a demo picture as it is, and resized


def pictures(work: Path) -> list:
    from PIL import Image

    source = Image.open(work / "img" / "00001.png").convert("RGB")
    return [source.resize(size) for size in SIZES.values()]


def inputs(processor, picture) -> dict:
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], tokenize=False,
                                         add_generation_prompt=True)
    return dict(processor(text=[text], images=[picture], return_tensors="pt"))


def build(work: Path) -> None:
    import torch
    import yaml
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from finetune.config.schema import ModelConfig
    from finetune.demo import CORPUS, draw_pictures
    from finetune.model import vision
    from finetune.model.tiny import build_tokenizer, build_vision_model

    texts = [json.loads(line)["text"] for line in (REPO / CORPUS).read_text().splitlines()[:400]]
    build_tokenizer(texts).save_pretrained(work / "tok")
    build_vision_model(work / "model", AutoTokenizer.from_pretrained(work / "tok"), "qwen2_5_vl")
    rows = [{"images": [f"img/{p['file']}"], "messages": [{"role": "user", "content": f"<image>\n{QUESTION}"}, {"role": "assistant", "content": p["shape"]}]}
            for p in draw_pictures(work / "img", 48, seed=0)]
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"name_or_path": str(work / "model"), "dtype": "float32"}, "adapter": {"method": "lora", "r": 8, "alpha": 16},
           "data": {"train": str(work / "rows.jsonl"), "format": "chat", "max_seq_len": 96, "eval_fraction": 0.0},
           "train": {"output_dir": str(work / "out"), "max_steps": 12, "micro_batch_size": 4, "lr": 1e-2, "mixed_precision": "no"},
           "eval": {"on_start": False}, "logging": {"report_to": [], "progress_bar": False, "plot": False}}
    (work / "run.yaml").write_text(yaml.safe_dump(cfg))
    finetune = [sys.executable, "-m", "finetune"]
    subprocess.run([*finetune, "train", "--config", str(work / "run.yaml")], check=True)
    subprocess.run([*finetune, "merge", "--adapter", str(work / "out"), "--out", str(work / "merged")], check=True)
    processor = vision.processor_for(ModelConfig(name_or_path=str(work / "model")))
    merged = AutoModelForImageTextToText.from_pretrained(work / "merged", dtype=torch.float32).eval()
    out = {}
    for i, picture in enumerate(pictures(work)):
        made = inputs(processor, picture)
        out.update({f"{key}.{i}": value.contiguous() for key, value in made.items()})
        with torch.no_grad():
            out[f"logits.{i}"] = merged(**made).logits.contiguous()
    save_file(out, work / "ours.safetensors")
    print(f"built {work}; now run `compare` in an environment with torchvision")


def compare(work: Path) -> None:
    import torch
    import torchvision
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    ours = load_file(work / "ours.safetensors")
    lines = ["| folder | AutoProcessor loads | image processor | video processor |", "|---|---|---|---|"]
    for name in ("model", "out", "merged"):
        processor = AutoProcessor.from_pretrained(work / name)
        lines.append(f"| {name} | {type(processor).__name__} | {type(processor.image_processor).__name__} | "
                     f"{type(getattr(processor, 'video_processor', None)).__name__} |")
    processor = AutoProcessor.from_pretrained(work / "model")
    merged = AutoModelForImageTextToText.from_pretrained(work / "merged", dtype=torch.float32).eval()
    lines += ["", "| picture | the processor's size | ids equal | picture grid equal | pixels, largest difference "
              "| merged model's logits, largest difference |", "|---|---|---|---|---|---|"]
    for i, (name, picture) in enumerate(zip(SIZES, pictures(work))):
        theirs = inputs(processor, picture)
        with torch.no_grad():
            logits = merged(**theirs).logits
        same_ids = torch.equal(theirs["input_ids"], ours[f"input_ids.{i}"])
        pixels = (theirs["pixel_values"] - ours[f"pixel_values.{i}"]).abs().max().item()
        drift = (logits - ours[f"logits.{i}"]).abs().max().item() if same_ids else float("nan")
        _, rows, columns = theirs["image_grid_thw"][0].tolist()
        same_grid = torch.equal(theirs["image_grid_thw"], ours[f"image_grid_thw.{i}"])
        lines.append(f"| {name} | {columns * 14} x {rows * 14} | {same_ids} | {same_grid} | {pixels:.2g} | {drift:.2g} |")
    lines += ["", f"there: torch {torch.__version__}, torchvision {torchvision.__version__}, transformers {transformers.__version__}. Pixels are "
              "normalized values (about -1.8 to 2.1); a resized picture differs where PIL's and torchvision's resampling differ."]
    report("pictures-only", lines)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("build", "compare"):
        sys.exit(__doc__)
    folder = Path(sys.argv[2]).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    build(folder) if sys.argv[1] == "build" else compare(folder)
