"""Test-only fault injection, so tests can make real processes fail the way clusters do.

Set FINETUNE_FAULT to `KIND@STEP[:rank=R]` (or `KIND@FIRST-LAST`), e.g. `raise@2:rank=1`: rank 1
raises once 2 optimizer steps are done, before the third. Kinds:
  raise   an exception                          kill   SIGKILL itself, as the OOM killer would
  term    SIGTERM itself, as a scheduler preempting the job would (the run saves and exits 75)
  hang    sleep inside the step (a stuck peer)  nan / spike   the loss of the batches of data
          step(s) STEP becomes NaN / 1000x, as a bad batch would make it (keyed to the data, so
          batches skipped after a rollback are not seen again)
  kill-staging@N   SIGKILL itself once N chunks of a ramdisk staging copy are written (a half copy)
  kill-saving@STEP SIGKILL itself once the first file of the checkpoint of step STEP is written
                   (in the background writer when saves are asynchronous)
  hang-saving@STEP sleep there instead (a save that never ends)
A fault fires in the first attempt only: after torchrun restarts the workers
(TORCHELASTIC_RESTART_COUNT > 0) the run goes on cleanly. Unset, it costs one comparison per step.
FINETUNE_STEP_SECONDS=S makes every step of every attempt last S seconds longer (bench/chaos_elastic.py kills nodes
at random moments while a run goes on). FINETUNE_STEP_GATE=FILE holds the run instead, by count, not by time: a step
waits while FILE holds a number of steps already done (tests/test_elastic.py moves it on as it kills and starts nodes);
a signal to stop lets the waiting step run, so the run saves and exits as it would.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

KINDS = ("raise", "kill", "term", "hang", "nan", "spike", "kill-staging", "kill-saving", "hang-saving")


@dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    last: int
    rank: int | None


def parse(spec: str | None) -> Fault | None:
    if not spec:
        return None
    head, _, tail = spec.partition(":")
    kind, _, steps = head.partition("@")
    first, _, last = steps.partition("-")
    rank = int(tail.split("=", 1)[1]) if tail.startswith("rank=") else None
    if kind not in KINDS or not first.isdigit() or not (last or first).isdigit():
        raise ValueError(f"FINETUNE_FAULT={spec}: expected KIND@STEP[-LAST][:rank=R] with KIND one of {', '.join(KINDS)}")
    return Fault(kind, int(first), int(last or first), rank)


FAULT = parse(os.environ.get("FINETUNE_FAULT")) if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else None
PACE = float(os.environ.get("FINETUNE_STEP_SECONDS", "0"))
GATE = os.environ.get("FINETUNE_STEP_GATE")


def _open(step: int) -> bool:
    """The gate lets step `step + 1` run: its file is gone, or holds more than `step` (a half-written number waits)."""
    try:
        return step < int(Path(GATE).read_text())
    except FileNotFoundError:
        return True
    except ValueError:
        return False


def _due(step: int, rank: int, kinds: tuple[str, ...]) -> bool:
    return (FAULT is not None and FAULT.kind in kinds and FAULT.first <= step <= FAULT.last
            and (FAULT.rank is None or FAULT.rank == rank))


def loss_factor(data_step: int, rank: int) -> float:
    """What the loss of the batches of `data_step` is multiplied by: 1 unless a nan/spike fault is due."""
    if _due(data_step, rank, ("nan",)):
        return float("nan")
    return 1000.0 if _due(data_step, rank, ("spike",)) else 1.0


def inject(step: int, rank: int, settle, stopping) -> None:
    """Called at the start of each optimizer step, with the number of steps done. `settle()` first
    completes a background save, so a test knows the newest checkpoint (kill-saving kills mid-write);
    `stopping()` says a signal to stop came (the gate then lets the step run)."""
    if PACE:
        time.sleep(PACE)
    while GATE and not stopping() and not _open(step):
        time.sleep(0.05)
    if not _due(step, rank, ("raise", "kill", "term", "hang")):
        return
    if FAULT.kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)  # the handler notes it; the step goes on, then the run saves and stops
        return
    settle()
    if FAULT.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT.kind == "hang":
        time.sleep(3600)
    raise RuntimeError(f"injected fault on rank {rank} at step {step} (FINETUNE_FAULT)")


def inject_staging(chunks_written: int) -> None:
    if FAULT is not None and FAULT.kind == "kill-staging" and chunks_written >= FAULT.first:
        os.kill(os.getpid(), signal.SIGKILL)


def inject_saving(step: int) -> None:
    if FAULT is not None and FAULT.kind in ("kill-saving", "hang-saving") and FAULT.first <= step <= FAULT.last:
        if FAULT.kind == "hang-saving":
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)
