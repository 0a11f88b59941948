"""finetune against TRL's SFTTrainer on a vision-language model: samples/s and peak RSS, same model, rows
and settings, each a fresh process, in one run.

The model is a LLaVA (a CLIP tower over 112 x 112 pictures: 64 picture tokens each; a 4-layer Llama of
width 256), built from a config with random weights; the rows are questions about synthetic pictures
(finetune/demo.py draws them). Both trainers take LoRA (r 16) on the language model's linear layers, the
tower and projector frozen, fp32, micro-batch 8, one epoch of unpacked rows, AdamW at a constant LR.

    python bench/vision.py            # make bench-vision: prints the table, writes bench/results/vision.{json,md}
    python bench/vision.py --cache    # what the tokenized cache would keep for a picture: its bytes, or its pixels
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, spawn

RESULTS = REPO / "bench" / "results"
ROWS, MICRO, LR, RANK = 384, 8, 1e-4, 16
QUESTION = "What shape is in the picture?"


def prepare(work: Path) -> None:
    """The model and the rows, once."""
    from transformers import AutoTokenizer

    from finetune.demo import CORPUS, draw_pictures
    from finetune.model.tiny import build_tokenizer, build_vision_model

    if (work / "rows.jsonl").is_file():
        return
    texts = [json.loads(line)["text"] for line in (REPO / CORPUS).read_text().splitlines()[:1500]]
    build_tokenizer(texts).save_pretrained(work / "tok")
    build_vision_model(work / "model", AutoTokenizer.from_pretrained(work / "tok"), "clip", side=112,
                       language=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    pictures = draw_pictures(work / "img", ROWS, seed=0, side=112)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "path": f"img/{p['file']}"}, {"type": "text", "text": QUESTION}]},
                          {"role": "assistant", "content": f"a {p['colour']} {p['shape']}"}]} for p in pictures]
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def ours(work: Path, out: Path) -> Path:
    cfg = {"model": {"name_or_path": str(work / "model"), "dtype": "float32"},
           "adapter": {"method": "lora", "r": RANK, "alpha": 2 * RANK, "dropout": 0.0},
           "data": {"train": str(work / "rows.jsonl"), "format": "chat", "max_seq_len": 256, "packing": False, "eval_fraction": 0.0,
                    "cache_dir": str(work / "cache")},
           "train": {"output_dir": str(out), "epochs": 1, "micro_batch_size": MICRO, "lr": LR, "scheduler": "constant", "warmup_steps": 0,
                     "weight_decay": 0.0, "mixed_precision": "no", "seed": 0},
           "eval": {"on_start": False}, "checkpoint": {"save_every": 0}, "logging": {"report_to": [], "progress_bar": False, "plot": False}}
    import yaml

    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def peer(work: Path, out: Path, result: Path) -> None:
    """TRL's SFTTrainer on the same rows: prompt-completion rows, the loss on the completion only."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in (work / "rows.jsonl").read_text().splitlines()]
    data = Dataset.from_list([{"images": [Image.open(work / r["messages"][0]["content"][0]["path"]).convert("RGB")],
                               "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                               "completion": [r["messages"][1]]} for r in rows])
    model = AutoModelForImageTextToText.from_pretrained(work / "model", dtype=torch.float32, attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(work / "model")
    steps = []

    class Timing(TrainerCallback):
        def on_step_end(self, _args, state, _control, **_kwargs):
            steps.append({"step": state.global_step, "time": time.time()})

    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=MICRO, num_train_epochs=1, learning_rate=LR, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none",
                     use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, max_length=None, completion_only_loss=True,
                     gradient_checkpointing=False)
    linears = "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"  # the language model's, as finetune adapts them
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=rf".*language_model.*\.({linears})")
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=processor, peft_config=lora, callbacks=[Timing()])
    trainer.train()
    result.write_text(json.dumps({"steps": steps}))



def measure(name: str, work: Path) -> dict:
    out = work / "runs" / name
    shutil.rmtree(out, ignore_errors=True)  # this benchmark's own earlier run
    out.parent.mkdir(parents=True, exist_ok=True)
    if name == "finetune":
        start, rss = spawn([sys.executable, "-m", "finetune", "train", "--config", str(ours(work, out))], out.with_suffix(".log"))
        steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    else:
        result = out.with_suffix(".json")
        start, rss = spawn([sys.executable, str(Path(__file__)), "--peer", "--work", str(work), "--out", str(out), "--result", str(result)],
                           out.with_suffix(".log"))
        steps = json.loads(result.read_text())["steps"]
    first, last = steps[0], steps[-1]
    return {"runner": name, "steps": len(steps), "first_step_s": first["time"] - start,
            "samples_s": (len(steps) - 1) * MICRO / max(last["time"] - first["time"], 1e-9), "peak_rss_mib": rss / 2**20}


def table(results: list[dict], commit: str) -> str:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())
    lines = [f"# finetune vs TRL SFTTrainer on a vision-language model ({datetime.date.today()}, {cpu}, {os.cpu_count()} cores, commit {commit})", "",
             f"LLaVA (CLIP tower, 112 x 112 pictures, 64 picture tokens; Llama 4 x 256), {ROWS} rows, micro-batch {MICRO}, LoRA r {RANK} on the "
             "language model, fp32, one epoch; samples/s from the first step's end to the last's.", "",
             "| runner | steps | samples/s | first step (s, from launch) | peak RSS (MiB) |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['runner']} | {r['steps']} | {r['samples_s']:.1f} | {r['first_step_s']:.1f} | {r['peak_rss_mib']:.0f} |" for r in results]
    return "\n".join(lines) + "\n"


def cache_sizes(work: Path) -> str:
    """What the tokenized cache would keep for one 336 x 336 picture: its file's bytes (finetune's choice) or its
    pixel values as CLIP's processor makes them, and what making the pixels costs a step (one core)."""
    import io
    import statistics

    import numpy as np
    import torch
    from PIL import Image
    from transformers import CLIPImageProcessor

    from finetune.data.images import decoded
    from finetune.demo import draw_pictures

    torch.set_num_threads(1)
    pictures = draw_pictures(work / "img336", 64, seed=1, side=336)
    files = [(work / "img336" / p["file"]).read_bytes() for p in pictures]
    noise = Image.fromarray(np.random.default_rng(0).normal(128, 40, (336, 336, 3)).clip(0, 255).astype("uint8"))
    jpeg = io.BytesIO()
    noise.save(jpeg, "JPEG", quality=90)
    processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    started = time.perf_counter()
    pixels = processor(images=decoded(files), return_tensors="pt")["pixel_values"]
    per_picture = (time.perf_counter() - started) / len(files)
    return "\n".join(["| a 336 x 336 picture | bytes |", "| --- | --- |",
                      f"| the demo's PNG (a shape on a plain ground; mean of {len(files)}) | {statistics.mean(map(len, files)) / 1024:.1f} KiB |",
                      f"| a noisy picture as JPEG, quality 90 (a photo's worst case) | {len(jpeg.getvalue()) / 1024:.1f} KiB |",
                      f"| CLIP's pixel values, float32 (what a batch holds) | {pixels[0].numel() * 4 / 2**20:.2f} MiB |", "",
                      f"decoding and processing: {per_picture * 1e3:.1f} ms a picture on one core"]) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(REPO / ".cache" / "bench-vision"), help="where the model, pictures and runs go")
    p.add_argument("--cache", action="store_true", help="only what the cache would hold for a picture, bytes or pixels (a few seconds)")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    work = Path(args.work)
    if args.peer:
        peer(work, Path(args.out), Path(args.result))
        return
    work.mkdir(parents=True, exist_ok=True)
    if args.cache:
        print(cache_sizes(work))
        return
    prepare(work)
    results = [measure(name, work) for name in ("finetune", "trl-sft")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    text = table(results, commit)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vision.md").write_text(text)
    (RESULTS / "vision.json").write_text(json.dumps({"commit": commit, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
