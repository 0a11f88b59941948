"""Test-only fault injection, so tests can make real processes fail the way clusters do.

Set FINETUNE_FAULT to `KIND@STEP[:rank=R]`, e.g. `raise@2:rank=1`: rank 1 raises once 2 optimizer
steps are done, before the third. Kinds: `raise` (an exception), `kill` (SIGKILL itself, as the OOM
killer would), `nan` (that step's loss becomes NaN, as a broken kernel or bad batch would make it).
A fault fires in the first attempt only: after torchrun restarts the workers
(TORCHELASTIC_RESTART_COUNT > 0) the run goes on cleanly. Unset, it costs one comparison per step.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None


def parse(spec: str | None) -> Fault | None:
    if not spec:
        return None
    head, _, tail = spec.partition(":")
    kind, _, step = head.partition("@")
    rank = int(tail.split("=", 1)[1]) if tail.startswith("rank=") else None
    if kind not in ("raise", "kill", "nan") or not step.isdigit():
        raise ValueError(f"FINETUNE_FAULT={spec}: expected KIND@STEP[:rank=R] with KIND raise, kill or nan")
    return Fault(kind, int(step), rank)


FAULT = parse(os.environ.get("FINETUNE_FAULT")) if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None


def _due(step: int, rank: int, kinds: tuple[str, ...]) -> bool:
    return FAULT is not None and FAULT.kind in kinds and FAULT.step == step and (FAULT.rank is None or FAULT.rank == rank)


def loss_factor(step: int, rank: int) -> float:
    """What this step's loss is multiplied by: 1, or NaN when a `nan` fault is due."""
    return float("nan") if _due(step, rank, ("nan",)) else 1.0


def inject(step: int, rank: int) -> None:
    """Called before each optimizer step, with the number of steps done."""
    if not _due(step, rank, ("raise", "kill")):
        return
    if FAULT.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (FINETUNE_FAULT)")
