"""What finetune's training steps would take if they did nothing but their matmuls.

Runs `finetune train` for a few steps with every matmul recorded (forward and backward: the op, its
operands' shapes, strides and dtype), then times each recorded matmul alone on this machine and adds
them up. Tokens trained over that sum is a bound on this trainer's throughput with torch's kernels
here: what it would reach if norms, softmax, casts, the optimizer and all else took no time.

Usage: python bench/matmuls.py --config RUN.yaml [--steps 4]   (bench/compare.py calls it)
Prints one JSON line: tokens, seconds, and per kind (base, lora, attention, head) seconds and GFLOP.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import common  # noqa: F401  (puts the repo on sys.path)
import torch
from torch.utils._python_dispatch import TorchDispatchMode

OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}
ADDING = {torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}  # their first operand is the term added


class RecordMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in OPS:
            operands = tuple((tuple(a.shape), tuple(a.stride()), str(a.dtype).removeprefix("torch.")) for a in args if isinstance(a, torch.Tensor))
            scalars = tuple(sorted(kwargs.items()))
            self.calls[(func, operands, scalars)] += 1
        return func(*args, **kwargs)


def record(config: str, steps: int) -> tuple[Counter, int]:
    """(matmul calls of `steps` training steps, real tokens they trained)."""
    from finetune.cli import main

    with tempfile.TemporaryDirectory() as out:
        mode = RecordMatmuls()
        with mode, contextlib.redirect_stdout(io.StringIO()):
            try:
                main(["train", "--config", config, "--max-steps", str(steps), "--output-dir", out])
            except SystemExit as exit:
                if exit.code:
                    raise
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        tokens = max(r["tokens"] for r in rows if "tokens" in r)
    return mode.calls, tokens


def kind(operands: tuple, rank: int, vocab: int) -> str:
    if any(len(shape) == 3 for shape, _, _ in operands):
        return "attention"
    dims = {d for shape, _, _ in operands for d in shape}
    return "head" if vocab in dims else "lora" if rank in dims else "base"


def flops(func, operands: tuple) -> int:
    a, b = (operands[1:] if func in ADDING else operands)[:2]
    batch = a[0][0] if len(a[0]) == 3 else 1
    return 2 * batch * a[0][-2] * a[0][-1] * b[0][-1]


def time_alone(op, operands: tuple, scalars: tuple, reps: int = 3) -> float:
    """Median seconds of one call on fresh operands of the recorded layout (warm, as in a loop)."""
    args = [_random_strided(shape, stride, getattr(torch, dtype)) for shape, stride, dtype in operands]
    op(*args, **dict(scalars))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        op(*args, **dict(scalars))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _random_strided(shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Random values in the recorded layout, overlapping ones (a stride of 0: an expanded operand) too."""
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0
    return torch.randn(span, dtype=dtype).as_strided(shape, stride)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="finetune run config (bench/compare.py writes one)")
    p.add_argument("--steps", type=int, default=4, help="training steps recorded (default 4)")
    args = p.parse_args()
    from transformers import AutoConfig

    from finetune.config.files import load_config

    cfg = load_config(args.config)
    rank, vocab = cfg.adapter.r, AutoConfig.from_pretrained(cfg.model.name_or_path).vocab_size
    calls, tokens = record(args.config, args.steps)
    by_kind: dict[str, dict[str, float]] = {}
    for (func, operands, scalars), count in calls.items():
        entry = by_kind.setdefault(kind(operands, rank, vocab), {"seconds": 0.0, "gflop": 0.0, "calls": 0})
        entry["seconds"] += count * time_alone(func, operands, scalars)
        entry["gflop"] += count * flops(func, operands) / 1e9
        entry["calls"] += count
    print(json.dumps({"tokens": tokens, "seconds": sum(e["seconds"] for e in by_kind.values()), "kinds": by_kind}))


if __name__ == "__main__":
    main()
