"""Distillation's loss, measured: memory and time of finetune's chunked divergence against the full logits.

The work of one micro-batch's loss, forward and backward, from the two decoders' last hidden states at the
trained positions (random, fp32): a student 1,024 wide, a teacher 2,048 wide, a 128,256-token vocabulary
(Llama 3's), N tokens. Each path runs in a process of its own, three times; its peak RSS above what the inputs
and weights hold is the loss's own memory.

  finetune   distill._LinearDivergence: the logits of both models made a chunk of tokens at a time, the
             divergence and its gradient taken per chunk (what train.objective distill runs where both heads
             are plain linear layers)
  full       both models' logits whole (hidden @ head.T), then TRL's GKDTrainer.generalized_jsd_loss and
             autograd: what a trainer that materialises the logits holds

usage: python bench/distill.py [--tokens 1024] [--beta 0.5]
Prints a markdown table and writes it to bench/results/distill.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import REPO, cpu_name, report

VOCAB, STUDENT, TEACHER = 128256, 1024, 2048


def one(path: str, tokens: int, beta: float) -> dict:
    """In this process: the loss forward and backward once; seconds and peak RSS above the inputs (MiB)."""
    import resource

    import torch

    sys.path.insert(0, str(REPO))
    from finetune.config.schema import DistillConfig
    from finetune.objectives.distill import _LinearDivergence

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
        total, _ = _LinearDivergence.apply(hidden, head, teacher_hidden, teacher_head, targets, cfg)
        loss = total / tokens
    else:
        from trl.experimental.gkd import GKDTrainer

        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_head.t()
        loss = GKDTrainer.generalized_jsd_loss((hidden @ head.t())[None], teacher_logits[None], targets[None], beta=beta)
    loss.backward()
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--beta", type=float, default=0.5, help="TRL's beta: 0 forward KL, 1 reverse KL, else the generalised JSD")
    parser.add_argument("--repeats", type=int, default=3)
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
    report("distill", lines)


if __name__ == "__main__":
    main()
