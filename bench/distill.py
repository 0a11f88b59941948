"""Distillation's loss, measured: memory and time of finetune's chunked divergence against the full logits.

The work of one micro-batch's loss, forward and backward, from the two decoders' last hidden states at the
trained positions (random, fp32): a student 1,024 wide, a teacher 2,048 wide, a 128,256-token vocabulary
(Llama 3's), N tokens. Each path runs in a process of its own, three times; its peak RSS above what the inputs
and weights hold is the loss's own memory.

  finetune   distill.linear_divergence: the logits of both models made a chunk of tokens at a time, the
             divergence and its gradient taken per chunk (what train.objective distill runs where both heads
             are plain linear layers)
  full       both models' logits whole (hidden @ head.T), then TRL's GKDTrainer.generalized_jsd_loss and
             autograd: what a trainer that materialises the logits holds

Then whole training steps, off-policy, against TRL's GKDTrainer on the same models, rows and settings in one
run: a student of 2 layers 256 wide and a teacher of 4 layers 512 wide (Llama, random weights, the demo
tokenizer, 32,000 logits), LoRA r 16 on the student's linear layers, the demo's prompts with their answers as
chat rows (the built-in alpaca template in both), 8 rows a step unpacked, at most 128 tokens, JSD beta 0.5 at
temperature 1, fp32, gradient checkpointing off, one process. Timed from the end of the first step to the end
of the last (the first includes warm-up).

usage: python bench/distill.py [--tokens 1024] [--beta 0.5] [--steps 12]
Prints the markdown tables and writes them to bench/results/distill.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import DATA, REPO, build_model, cpu_name, report

CACHE = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "bench-distill"
ROWS, LENGTH, LR = 8, 128, 1e-4

VOCAB, STUDENT, TEACHER = 128256, 1024, 2048


def one(path: str, tokens: int, beta: float) -> dict:
    """In this process: the loss forward and backward once; seconds and peak RSS above the inputs (MiB)."""
    import resource

    import torch

    sys.path.insert(0, str(REPO))
    from finetune.config.schema import DistillConfig
    from finetune.objectives.distill import linear_divergence

    torch.manual_seed(0)
    hidden = (torch.randn(tokens, STUDENT) * 0.5).requires_grad_()
    head = (torch.randn(VOCAB, STUDENT) * 0.02).requires_grad_()
    teacher_hidden, teacher_head = torch.randn(tokens, TEACHER) * 0.5, torch.randn(VOCAB, TEACHER) * 0.02
    targets = torch.randint(0, VOCAB, (tokens,))
    divergence = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
    cfg = DistillConfig(teacher="t", divergence=divergence, **({"beta": beta} if divergence == "jsd" else {}))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    began = time.perf_counter()
    if path == "finetune":
        total, _ = linear_divergence(hidden, head, teacher_hidden, teacher_head, targets, cfg)
        loss = total / tokens
    else:
        from trl.experimental.gkd import GKDTrainer

        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_head.t()
        loss = GKDTrainer.generalized_jsd_loss((hidden @ head.t())[None], teacher_logits[None], targets[None], beta=beta)
    loss.backward()
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before, "loss": float(loss)}


def models() -> tuple[Path, Path, Path]:
    """(student, teacher, chat rows), built once under CACHE."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(REPO))
    from finetune.data.chat import BUILTIN

    student, teacher, rows = CACHE / "student", CACHE / "teacher", CACHE / "rows.jsonl"
    for folder, layers, hidden in ((student, 2, 256), (teacher, 4, 512)):
        if not (folder / "config.json").exists():
            build_model(folder, layers=layers, hidden=hidden, vocab=32000)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            tokenizer.chat_template = BUILTIN["alpaca"]
            tokenizer.save_pretrained(folder)
    prompts = [json.loads(line) for line in (DATA / "prompts-train.jsonl").read_text().splitlines()]
    rows.write_text("".join(json.dumps({"messages": [*r["prompt"], {"role": "assistant", "content": r["answer"]}]}) + "\n" for r in prompts))
    return student, teacher, rows


def our_steps(student: Path, teacher: Path, rows: Path, steps: int, out: Path) -> list[float]:
    """finetune's step end times (s)."""
    from finetune.config.schema import validate_config
    from finetune.train import run

    cfg = {"model": {"name_or_path": str(student)}, "adapter": {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0},
           "data": {"train": str(rows), "format": "chat", "max_seq_len": LENGTH, "packing": False},
           "train": {"output_dir": str(out), "objective": "distill", "max_steps": steps, "micro_batch_size": ROWS, "lr": LR,
                     "scheduler": "constant", "gradient_checkpointing": False},
           "distill": {"teacher": str(teacher), "divergence": "jsd", "beta": 0.5, "temperature": 1.0},
           "eval": {"on_start": False}, "guard": {"enabled": False}, "logging": {"report_to": [], "progress_bar": False, "plot": False}}
    run(validate_config(cfg, "bench"))
    return [r["time"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def trl_steps(student: Path, teacher: Path, rows: Path, steps: int, out: Path) -> list[float]:
    """TRL GKDTrainer's step end times (s), lmbda 0 (the data's answers), on the same rows and settings."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.time())

    args = GKDConfig(output_dir=str(out), per_device_train_batch_size=ROWS, max_length=LENGTH, lmbda=0.0, beta=0.5, temperature=1.0,
                     seq_kd=False, learning_rate=LR, lr_scheduler_type="constant", max_steps=steps, logging_steps=1, report_to=[], use_cpu=True,
                     bf16=False, save_strategy="no", gradient_checkpointing=False)
    data = Dataset.from_list([json.loads(line) for line in rows.read_text().splitlines()])
    trainer = GKDTrainer(model=AutoModelForCausalLM.from_pretrained(student), teacher_model=AutoModelForCausalLM.from_pretrained(teacher),
                         args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(student),
                         peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"), callbacks=[Clock()])
    trainer.train()
    return ends


def training_lines(steps: int) -> list[str]:
    student, teacher, rows = models()
    lines = ["", f"Training steps, off-policy: {ROWS} chat rows a step (unpacked, <= {LENGTH} tokens), student 2 x 256 + LoRA r16, teacher 4 x 512, "
             f"32,000 logits, JSD beta 0.5, fp32, no gradient checkpointing, 1 process ({cpu_name()}, {os.cpu_count()} cores); steps 2-{steps} timed",
             "", "| runner | s/step | rows/s |", "| --- | --- | --- |"]
    for name, runner in (("finetune", our_steps), ("TRL GKDTrainer", trl_steps)):
        out = CACHE / name.split()[0].lower()
        shutil.rmtree(out, ignore_errors=True)  # this benchmark's own output of an earlier run
        ends = runner(student, teacher, rows, steps, out)
        per_step = (ends[-1] - ends[0]) / (len(ends) - 1)
        lines.append(f"| {name} | {per_step:.3f} | {ROWS / per_step:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--beta", type=float, default=0.5, help="TRL's beta: 0 forward KL, 1 reverse KL, else the generalised JSD")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="training steps of each runner (0: the loss alone)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tokens, args.beta)))
        return
    rows = {}
    for path in ("finetune", "full"):
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--one", path, "--tokens", str(args.tokens), "--beta", str(args.beta)],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        rows[path] = runs
    full_logits = 2 * args.tokens * VOCAB * 4 / 2**20
    lines = [f"Distillation loss, forward + backward, {args.tokens} tokens, vocabulary {VOCAB:,}, student {STUDENT} wide, teacher "
             f"{TEACHER} wide, beta {args.beta:g}, fp32, {cpu_name()} (python bench/distill.py). The two models' logits whole "
             f"would be {full_logits:,.0f} MiB.", "",
             "| path | seconds (3 runs) | peak memory above the inputs, MiB | loss |", "| --- | --- | --- | --- |"]
    for path, runs in rows.items():
        seconds = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        lines.append(f"| {path} | {seconds} | {max(r['peak_mib'] for r in runs):,.0f} | {runs[0]['loss']:.6f} |")
    report("distill", lines + (training_lines(args.steps) if args.steps else []))


if __name__ == "__main__":
    main()
