"""The loss-divergence guard: watches every step and repairs what it can, cheapest rung first.

  rung 1, skip:      a non-finite or spiking step is not applied (no optimizer or scheduler step).
  rung 2, roll back: after `skips_before_rollback` such steps within `window` steps, or a sustained
                     upward drift, the loop restores the last good checkpoint, multiplies the LR by
                     `lr_backoff`, skips the data between that checkpoint and the trouble, optionally
                     tightens clipping, and goes on (what OPT-175B's and PaLM's teams did by hand).
  rung 3, stop:      after `max_rollbacks` rollbacks, or with no good checkpoint to go back to.

This module only decides; train.py acts. Its state is plain JSON, saved in every checkpoint.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from finetune.config import GuardConfig

# A spike must also be this far above the recent mean, so that a very steady loss (tiny std) does
# not turn ordinary batch-to-batch noise into "spikes".
MIN_LOSS_RISE = 0.25
MIN_GRAD_RISE = 1.0


@dataclass
class Verdict:
    action: str  # "apply", "skip", "rollback" or "stop"
    reason: str = ""


APPLY = Verdict("apply")


@dataclass
class GuardState:
    history: list[list[float]] = field(default_factory=list)  # [loss, grad_norm] of recent healthy steps
    anomalies: list[int] = field(default_factory=list)  # recent steps that were skipped
    rollbacks: int = 0
    lr_scale: float = 1.0
    max_grad_norm: float | None = None  # tightened clipping after a rollback, if configured
    skip_windows: list[list[int]] = field(default_factory=list)  # [from_step, batches]: data skipped from that step on


class Guard:
    def __init__(self, cfg: GuardConfig, state: dict | None = None):
        self.cfg = cfg
        self.state = GuardState(**state) if state else GuardState()

    def check(self, step: int, loss: float, grad_norm: float) -> Verdict:
        """Judge one step before it is applied."""
        cfg, s = self.cfg, self.state
        if not cfg.enabled:
            return APPLY
        reason = self._anomaly(loss, grad_norm)
        if reason:
            s.anomalies = [a for a in s.anomalies if a > step - cfg.window] + [step]
            if len(s.anomalies) >= cfg.skips_before_rollback:
                return self._escalate(f"{len(s.anomalies)} anomalous steps within {cfg.window} (last: {reason})")
            return Verdict("skip", reason)
        s.history = (s.history + [[loss, grad_norm]])[-cfg.window :]
        drift = self._drift()
        if drift:
            return self._escalate(drift)
        return APPLY

    def _anomaly(self, loss: float, grad_norm: float) -> str:
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite loss {loss} / grad norm {grad_norm}"
        if len(self.state.history) < self.cfg.min_history:
            return ""
        for value, column, sigmas, rise, name in ((loss, 0, self.cfg.loss_spike_sigmas, MIN_LOSS_RISE, "loss"),
                                                  (grad_norm, 1, self.cfg.grad_spike_sigmas, MIN_GRAD_RISE, "grad norm")):
            recent = [h[column] for h in self.state.history]
            mean, std = statistics.fmean(recent), statistics.pstdev(recent)
            if value > mean + sigmas * std and value > (1 + rise) * mean:
                return f"{name} spike {value:.4g} (recent mean {mean:.4g}, std {std:.2g})"
        return ""

    def _drift(self) -> str:
        cfg, history = self.cfg, self.state.history
        if not cfg.drift or len(history) < cfg.window:
            return ""
        half = len(history) // 2
        before, after = statistics.fmean(h[0] for h in history[:half]), statistics.fmean(h[0] for h in history[half:])
        if after > (1 + cfg.drift) * before:
            return f"loss drifted up from {before:.4g} to {after:.4g} over {cfg.window} steps"
        return ""

    def _escalate(self, reason: str) -> Verdict:
        if self.state.rollbacks >= self.cfg.max_rollbacks:
            return Verdict("stop", f"{reason}, after {self.state.rollbacks} rollback(s)")
        return Verdict("rollback", reason)

    def rolled_back(self, to_step: int, trouble_step: int) -> None:
        """Record a rollback to the checkpoint of `to_step` because of trouble at `trouble_step`."""
        s = self.state
        s.rollbacks += 1
        s.lr_scale *= self.cfg.lr_backoff
        if self.cfg.clip_after_rollback is not None:
            s.max_grad_norm = self.cfg.clip_after_rollback
        # The batches from the checkpoint up to the trouble are not seen again.
        s.skip_windows.append([to_step, trouble_step - to_step + 1])
        s.history, s.anomalies = [], []

    def is_healthy(self, step: int) -> bool:
        """A checkpoint at `step` is a good rollback target when no anomaly was seen in the window before it."""
        return not any(a > step - self.cfg.window for a in self.state.anomalies)

    def state_dict(self) -> dict:
        return asdict(self.state)


def data_step(step: int, windows: list[list[int]]) -> int:
    """Which step's batches optimizer step `step` trains on, once skipped windows are left out."""
    return step + sum(count for start, count in windows if step >= start)
