"""What watches a run from the side: the hang watchdog and the preemption signals.

Watchdog: a daemon thread times each optimizer step and each checkpoint save. One running longer than
`factor` times the median recent step (and at least `min_seconds`) is hung (a stuck collective, a dead
peer): every thread's stack goes to stderr and the process exits with code 4, so an elastic agent or
Slurm restarts the job instead of it idling until the wall-clock limit. A save waits at barriers as a
step does at its collectives, so a peer lost while one is in flight hangs it the same way. Evals are
not timed (their length is the eval split's, not a step's): distributed.collective_timeout bounds them.

Preemption: SIGTERM (what Slurm, Kubernetes and torchrun send first) and SIGUSR1 (Slurm's
`--signal`) only set a flag; the loop sees it at the end of the step, saves a checkpoint and exits
with code 75.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

from finetune.config.errors import EXIT_HUNG, EXIT_PREEMPTED, Stopped, record_exit
from finetune.config.schema import WatchdogConfig
from finetune.run.metrics import EVENTS_FILE, write_event

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, on_hang=lambda message: None, poll_s: float = 0.5):
        self.cfg = cfg
        self.on_hang = on_hang  # writes the event (main process) before the exit
        self.durations: deque[float] = deque(maxlen=20)
        self.step: int | None = None
        self.started: float | None = None
        self.what = "step"  # or "save": what is being timed
        self.poll_s = poll_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="finetune-watchdog", daemon=True) if cfg.enabled else None
        if self._thread is not None:
            self._thread.start()

    def start(self, step: int, what: str = "step") -> None:
        self.step, self.what, self.started = step, what, time.monotonic()

    def end(self) -> None:
        if self.started is not None and self.what == "step":  # the limit follows the steps only
            self.durations.append(time.monotonic() - self.started)
        self.started = None

    def close(self) -> None:
        """The run is over, however it ended: stop watching. A run called in process (tests, notebooks) that
        raised mid-step would otherwise leave a step open, and the thread would end the host process later.
        Waits for the thread to end: until it does, its frame holds `on_hang` and through it the run's state
        (the model on its GPU included)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def limit(self) -> float:
        typical = statistics.median(self.durations) if self.durations else 0.0
        return max(self.cfg.min_seconds, self.cfg.factor * typical)

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            started = self.started
            if started is None:
                continue
            elapsed, limit = time.monotonic() - started, self.limit()
            if elapsed > limit:
                what = f"step {self.step + 1}" if self.what == "step" else f"the checkpoint save after step {self.step}"
                message = (f"watchdog: {what} has run {elapsed:.0f} s, over the {limit:.0f} s limit "
                           f"(max of watchdog.min_seconds and {self.cfg.factor:g} x the median recent step); "
                           f"stacks of every thread follow, then exit code {EXIT_HUNG}")
                print(message, file=sys.stderr, flush=True)
                self.on_hang(message)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                record_exit(EXIT_HUNG)
                os._exit(EXIT_HUNG)


class Preemption:
    """Remembers the first SIGTERM/SIGUSR1; the loop decides when to act on it."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}  # the handlers it replaced, put back by restore()
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._remember)

    def listening(self) -> bool:
        """Whether its handlers are still the ones installed (a program may have set its own since)."""
        return all(signal.getsignal(sig) == self._remember for sig in self._previous) if self._previous else True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _remember(self, signum, frame) -> None:
        self.signal = self.signal or signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""


_PREEMPTION: Preemption | None = None


def watch_preemption() -> Preemption:
    """The process's one Preemption, listening from the first call on (`finetune train` calls it
    before the heavy imports, so a signal during start-up is not the default exit 143)."""
    global _PREEMPTION
    if _PREEMPTION is None or not _PREEMPTION.listening():
        _PREEMPTION = Preemption()
    return _PREEMPTION


def release_preemption() -> None:
    """The signal handlers as they were before watch_preemption (train.run calls it as it ends): a program that
    calls finetune.train.run keeps its own SIGTERM/SIGUSR1 handling after the run."""
    global _PREEMPTION
    if _PREEMPTION is not None and threading.current_thread() is threading.main_thread():
        _PREEMPTION.restore()
        _PREEMPTION = None


def stop_with_launcher() -> None:
    """A worker of torchrun / accelerate launch gets SIGTERM when its launcher dies (Linux's parent-death
    signal): it then saves at the end of its step, like any preempted run, and exits. Without it, the
    workers of a SIGKILLed agent train on to the end, orphans that a restarted job would race for the
    same output directory (docs/platform-notes.md)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def stop_if_preempted(signalled: bool, name: str, out: Path, main: bool, when: str) -> None:
    """Before the loop there is nothing to save: a preemption signal ends the run at once, with the
    exit code of a preemption in the loop (so that a requeue starts it again), and says so in events.jsonl."""
    if not signalled:
        return
    message = f"preempted ({name or 'a signal on another rank'}) {when}: nothing to save yet; start the same command to begin"
    if main:
        write_event(out / EVENTS_FILE, "preempted", None, message)
    raise Stopped(message, EXIT_PREEMPTED)
