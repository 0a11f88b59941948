"""The loss-divergence guard: watches every step and repairs what it can, cheapest rung first.

  rung 1, skip:      a non-finite step, or a wild spike (the loss `loss_spike_ratio` times its recent
                     median and `loss_spike_sigmas` robust deviations above it; the gradient norm
                     `grad_spike_ratio` times its median), is not applied (no optimizer or scheduler step).
  rung 2, roll back: after `skips_before_rollback` such steps within `window` steps, or a drift (the
                     level, the median loss of the last DRIFT_STEPS steps, more than `drift` above its
                     lowest in the last `window` steps and `drift_sigmas` times the noise of the
                     difference of two levels), the loop restores the last good checkpoint from
                     before the trouble, multiplies the LR by `lr_backoff`, skips the data between that
                     checkpoint and the trouble, optionally tightens clipping, and goes on (what
                     OPT-175B's and PaLM's teams did by hand).
  rung 3, stop:      after `max_rollbacks` rollbacks, or with no good checkpoint to go back to; or when,
                     within the first `window` steps, the gradient norm collapsed far more than the loss
                     fell (`grad_collapse`): a learning rate too high from the start leaves no good
                     checkpoint, since every one was trained at it.

The start is a reference too. Before the first step the run measures its start level (the median loss
of the first DRIFT_STEPS steps' batches at the initial weights) and, with eval data, its eval loss.
Within the warmup and the `window` steps after it, a level risen above the start level (by `drift`,
and by `drift_sigmas` times the noise of two such medians, from the larger of the start batches'
spread and the window's) is a learning rate too hot: roll back, with the LR lowered as for any
divergence, to the start (an adapter's step-0 checkpoint), or, for a run resumed (with a hotter LR)
from a checkpoint whose levels were all at or below the start's, to that checkpoint. A run that ends worse than it started (its final eval loss
more than `drift` above the eval before training; without eval data, its level risen above the start
level as above) is no success: train saves it, says so and exits with code 3 (`worse_than_start`).

Every statistic is a median of the per-token loss: a healthy run's odd hard batch (2x the loss, 20x
the gradient norm were seen on the demo) moves nothing, and the early steep descent does not widen the
band for the rest of the run (the level's noise comes from the differences of successive losses, which
a trend hardly moves; the lowest of many levels as the reference is why the threshold is
`drift_sigmas` = 6 noise units: bench/guard.py measures the false alarms on flat runs). A rollback
takes the guard back to the history it had at that checkpoint, so the steps after it are judged
against the good state at once: a divergence that comes back is caught again and leads to the next
rung. At the end of the run the level is compared with
the best of the whole run (`finish`): a run never ends with exit 0 on weights that drifted worse.

Bounds (from `min_history` steps on; before that only non-finite values are judged): a loss level
more than (1 + drift) times its lowest of the last `window` steps is caught once DRIFT_STEPS // 2 + 1
of the last DRIFT_STEPS losses are that high, i.e. within 6 steps of the rise; a spike is skipped at
once, and the `skips_before_rollback`-th spike within `window` steps rolls back.

GRPO with a KL term (grpo.beta > 0) may also bound it: a step whose mean KL to the reference is above
`max_kl` is a divergence (rung 2, then 3), rolled back to the last step whose KL was at most half of it.

This module only decides; train.py acts. Its state is plain JSON, saved in every checkpoint.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from finetune.config.errors import EXIT_DIVERGED, Stopped
from finetune.config.schema import GuardConfig

DRIFT_STEPS = 10  # the level is the median loss of this many steps
MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation per median absolute deviation
MIN_SPREAD = 0.02  # robust deviations are at least this share of the level: a flat loss has no zero band
BEST_TOLERANCE = 0.05  # final weights within this share of the best level (or its noise) count as the best seen


@dataclass
class Verdict:
    action: str  # "apply", "skip", "rollback" or "stop"
    reason: str = ""
    before_step: int | None = None  # rollback / stop: the checkpoint to go back to is from this step or earlier


APPLY = Verdict("apply")


@dataclass
class GuardState:
    history: list[list[float]] = field(default_factory=list)  # [step, loss, grad_norm] of recent healthy steps
    anomalies: list[int] = field(default_factory=list)  # recent steps that were skipped
    rollbacks: int = 0
    lr_scale: float = 1.0
    max_grad_norm: float | None = None  # tightened clipping after a rollback, if configured
    skip_windows: list[list[int]] = field(default_factory=list)  # [from_step, batches]: data skipped from that step on
    best: list[float] | None = None  # [step, level]: the lowest level of the run so far
    start: list[float] | None = None  # [loss, grad_norm] of the run's first step, before any update
    start_level: list[float] | None = None  # [level, spread] of the first DRIFT_STEPS steps' losses at the initial weights
    start_eval: float | None = None  # the eval loss before the first step
    calm_kl_step: int = 0  # the last step whose KL to the reference was at most half of max_kl (where a KL blow-up rolls back to)


class Guard:
    """Judges each step before it is applied. For example, a NaN is skipped:

    >>> from finetune.config.schema import GuardConfig
    >>> guard = Guard(GuardConfig())
    >>> guard.check(0, float("nan"), 1.0).action
    'skip'
    >>> guard.check(1, 2.5, 1.0).action
    'apply'
    """

    def __init__(self, cfg: GuardConfig, state: dict | None = None, min_rise: float = 0.0, warmup: int = 0, watched: str = "loss",
                 resumed_at: int = 0):
        self.cfg = cfg
        self.resumed_at = resumed_at  # the step this start of the run resumed from (0: a fresh start)
        self.watched = watched  # what the judged value is, in messages (GRPO: the negative mean reward)
        self.state = _load(state)
        self.min_rise = min_rise  # the smallest rise of the loss that can be a spike or a drift (guard.min_rise, resolved)
        self.early_steps = warmup + cfg.window  # a level above the start level within these steps is a hot start

    def set_start(self, losses: list[float], eval_loss: float | None = None) -> None:
        """Where the run starts: the losses of the first steps' batches at the initial weights (the
        same batches the first level is taken over) and the eval loss before the first step."""
        self.state.start_level = list(_median_and_spread(losses)) if len(losses) >= DRIFT_STEPS else None
        self.state.start_eval = eval_loss

    def check(self, step: int, loss: float, grad_norm: float, kl: float | None = None) -> Verdict:
        """Judge optimizer step `step` (0-based) from its loss and gradient norm (and GRPO's KL to the reference)."""
        cfg, s = self.cfg, self.state
        if not cfg.enabled:
            return APPLY
        reason = self._anomaly(loss, grad_norm)
        if reason:
            s.anomalies = [a for a in s.anomalies if a > step - cfg.window] + [step]
            if len(s.anomalies) >= cfg.skips_before_rollback:
                return self._escalate(f"{len(s.anomalies)} anomalous steps within {cfg.window} (last: {reason})", step)
            return Verdict("skip", reason)
        if cfg.max_kl and kl is not None:
            # The policy ran away from the reference: back to where it was still well inside the bound (the KL is measured
            # before the step's update, so step k's KL is that of checkpoint k).
            if kl > cfg.max_kl:
                return self._escalate(f"the KL to the reference reached {kl:.4g}, above guard.max_kl={cfg.max_kl:g}", s.calm_kl_step)
            if kl <= cfg.max_kl / 2:
                s.calm_kl_step = step
        if step == 0:
            s.start = [loss, grad_norm]
        s.history = (s.history + [[step, loss, grad_norm]])[-(cfg.window + DRIFT_STEPS) :]
        levels = self._levels()
        if levels and (s.best is None or levels[-1][1] < s.best[1]):
            s.best = list(levels[-1])
        collapse = self._collapse(step)
        if collapse:
            return Verdict("stop", collapse, 0)
        hot = self._hot_start(step)
        return self._escalate(hot, self._last_cool(levels)) if hot else self._drift(levels, step)

    def finish(self, step: int) -> Verdict:
        """The verdict on the final weights: a run whose level ended more than `drift` above the best
        of the whole run is treated as a drift caught at its last step."""
        level, best = self.level(), self.state.best
        if not self.cfg.enabled or not self.cfg.drift or level is None or best is None or not self._risen(level, best[1]):
            return APPLY
        return self._escalate(f"the run ended at {self.watched} level {level:.4g}, above its best {best[1]:.4g} (step {int(best[0]) + 1}) "
                              f"by more than guard.drift={self.cfg.drift:g}", int(best[0]))

    def worse_than_start(self, final_eval: float | None = None) -> str:
        """Why the run ended worse than it started ("" if it did not): its eval loss, where measured
        before and after, more than `drift` above the start's (the same rows, no batch noise);
        otherwise its level risen above the start level."""
        s, drift = self.state, self.cfg.drift
        if not self.cfg.enabled or not drift:
            return ""
        if s.start_eval is not None and final_eval is not None:
            if final_eval > (1 + drift) * s.start_eval:
                return f"the eval loss ended at {final_eval:.4g}, above its {s.start_eval:.4g} before the first step by more than guard.drift={drift:g}"
            return ""
        level = self.level()
        if level is None or not self._above_start(level):
            return ""
        return f"the loss level ended at {level:.4g}, above the {s.start_level[0]:.4g} it started from (the first steps' batches before training)"

    def _hot_start(self, step: int) -> str:
        """A level risen above the start level during the warmup or the `window` steps after it."""
        level = self.level()
        if step >= self.early_steps or level is None or not self._above_start(level):
            return ""
        return (f"the loss level rose to {level:.4g} (median of the last {DRIFT_STEPS} steps) from {self.state.start_level[0]:.4g} where "
                f"the run started (the first {DRIFT_STEPS} steps' batches at the initial weights), within its first {self.early_steps} "
                "steps: a learning rate too high from the start")

    def _last_cool(self, levels: list[tuple[int, float]]) -> int:
        """Where a hot start rolls back to: the checkpoint this start of the run resumed from, where every level
        before it was at or below the start's (a run resumed with a hotter LR); else the start."""
        before = [level for step, level in levels if step < self.resumed_at]
        return self.resumed_at if before and not any(self._above_start(level) for level in before) else 0

    def _above_start(self, level: float) -> bool:
        """`level` risen above the start level, clear of the noise of the difference of two levels
        (the larger of the start batches' spread and the window's: ten losses alone often understate it)."""
        if not self.cfg.drift or self.state.start_level is None:
            return False
        start, spread = self.state.start_level
        return self._risen(level, start, noise=self._level_noise(spread))

    def _level_noise(self, spread: float = 0.0) -> float:
        """The noise of the difference of two levels: a median of DRIFT_STEPS losses wanders by about
        1.25 x their spread / sqrt(DRIFT_STEPS), and the difference of two by sqrt(2) times that.
        The spread is the window's (or `spread`, if larger)."""
        spread = max(spread, _step_to_step_spread([h[1] for h in self.state.history[-self.cfg.window :]]))
        return math.sqrt(2) * 1.25 * spread / math.sqrt(DRIFT_STEPS)

    def _anomaly(self, loss: float, grad_norm: float) -> str:
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite loss {loss} / grad norm {grad_norm}"
        cfg, history = self.cfg, self.state.history[-self.cfg.window :]
        if len(history) < cfg.min_history:
            return ""
        median, spread = _median_and_spread([h[1] for h in history])
        if loss > median + (cfg.loss_spike_ratio - 1) * abs(median) and loss > median + max(cfg.loss_spike_sigmas * spread, self.min_rise):
            return f"{self.watched} spike {loss:.4g} (recent median {median:.4g}, robust deviation {spread:.2g})"
        grad_median = statistics.median(h[2] for h in history)
        if grad_norm > cfg.grad_spike_ratio * grad_median:
            return f"grad norm spike {grad_norm:.4g} (recent median {grad_median:.4g})"
        return ""

    def _collapse(self, step: int) -> str:
        """Early on, a healthy run's gradient norm shrinks about as its loss falls (measured: the
        gradient's fall at most 3.4x the loss's). Adam moves every weight by about the LR whatever the
        gradient, so an LR far too high drives the model within a few steps into a flat, saturated
        region: a gradient norm down 100x and more while the loss hardly moved."""
        cfg, s = self.cfg, self.state
        if not cfg.grad_collapse or s.start is None or step >= cfg.window or len(s.history) < DRIFT_STEPS:
            return ""
        loss, grad = self.level(), statistics.median(h[2] for h in s.history[-DRIFT_STEPS:])
        loss_fall, grad_fall = s.start[0] / max(loss, 1e-12), s.start[1] / max(grad, 1e-12)
        if grad_fall <= cfg.grad_collapse * max(loss_fall, 1.0):
            return ""
        return (f"the gradient norm fell {grad_fall:.3g}x since step 1 (to a median {grad:.3g}) while the loss fell only "
                f"{loss_fall:.3g}x (to {loss:.4g}): the weights were driven into a flat region, the mark of a learning rate "
                f"too high from the start (guard.grad_collapse={cfg.grad_collapse:g}); lower train.lr (e.g. 10x) and start again")

    def _levels(self) -> list[tuple[int, float]]:
        """(step, level) for each of the last `window` steps of history that has DRIFT_STEPS before it."""
        h = self.state.history
        first = max(DRIFT_STEPS, len(h) - self.cfg.window + 1)
        return [(int(h[end - 1][0]), statistics.median(x[1] for x in h[end - DRIFT_STEPS : end])) for end in range(first, len(h) + 1)]

    def level(self) -> float | None:
        """The loss now: the median of the last DRIFT_STEPS healthy steps (None before there are as many)."""
        h = self.state.history
        return statistics.median(x[1] for x in h[-DRIFT_STEPS:]) if len(h) >= DRIFT_STEPS else None

    def _drift(self, levels: list[tuple[int, float]], step: int) -> Verdict:
        if not self.cfg.drift or len(self.state.history) < self.cfg.min_history or not levels:
            return APPLY
        lowest_step, lowest = min(levels, key=lambda sl: sl[1])
        now = levels[-1][1]
        if not self._risen(now, lowest):
            return APPLY
        # Back to the good state: a checkpoint from no later than the lowest level.
        return self._escalate(f"{self.watched} drifted up to {now:.4g} (median of the last {DRIFT_STEPS} steps) from {lowest:.4g}, "
                              f"its lowest within {self.cfg.window} steps (step {lowest_step + 1})", lowest_step)

    def _risen(self, level: float, reference: float, fraction: float | None = None, noise: float | None = None) -> bool:
        """Is `level` a real rise above `reference`: `fraction` (default `drift`) above it, and clear of
        the level's noise (by default: a median of DRIFT_STEPS losses wanders by about 1.25 x their
        spread / sqrt(DRIFT_STEPS)), so that noisy small batches do not read as a drift."""
        if noise is None:
            noise = self._level_noise()
        fraction = self.cfg.drift if fraction is None else fraction
        # `fraction` of the reference's size above it: the same as (1 + fraction) x reference for a loss, and right for a negative level too
        return level > reference + fraction * abs(reference) and level - reference > max(self.cfg.drift_sigmas * noise, self.min_rise)

    def _escalate(self, reason: str, before_step: int) -> Verdict:
        if self.state.rollbacks >= self.cfg.max_rollbacks:
            return Verdict("stop", f"{reason}, after {self.state.rollbacks} rollback(s)", before_step)
        return Verdict("rollback", reason, before_step)

    def rolled_back(self, to_step: int, trouble_step: int, saved: dict | None = None) -> None:
        """Record a rollback to the checkpoint of `to_step` because of trouble at `trouble_step`.
        `saved`: the guard state stored in that checkpoint: its history and best level (the good state
        before the trouble) are what the next steps are judged against."""
        s = self.state
        s.rollbacks += 1
        s.lr_scale *= self.cfg.lr_backoff
        if self.cfg.clip_after_rollback is not None:
            s.max_grad_norm = self.cfg.clip_after_rollback
        # The batches from the checkpoint up to the trouble are not seen again.
        s.skip_windows.append([to_step, trouble_step - to_step + 1])
        then = _load(saved) if saved is not None else s
        s.history = [h for h in then.history if h[0] < to_step]
        s.best = then.best if then.best is None or then.best[0] < to_step else None
        s.calm_kl_step = min(s.calm_kl_step, to_step)
        s.anomalies = []

    def is_healthy(self, step: int) -> bool:
        """A checkpoint at `step` is a good rollback target when no anomaly was seen in the window before it."""
        return not any(a > step - self.cfg.window for a in self.state.anomalies)

    def report(self) -> dict:
        """For the summary: the final level against the best of the run, and whether it is the best."""
        level, best = self.level(), self.state.best
        final_is_best = None if level is None or best is None else not self._risen(level, best[1], BEST_TOLERANCE)
        s = self.state
        return {"start_loss_level": s.start_level[0] if s.start_level else None, "start_eval_loss": s.start_eval,
                "final_loss_level": level, "best_loss_level": best[1] if best else None,
                "best_level_step": int(best[0]) + 1 if best else None, "final_is_best": final_is_best,
                "rollbacks": self.state.rollbacks, "lr_scale": self.state.lr_scale}

    def state_dict(self) -> dict:
        return asdict(self.state)


def _load(state: dict | None) -> GuardState:
    s = GuardState(**state) if state else GuardState()
    # Checkpoints written before steps were kept in the history hold [loss, grad_norm] rows.
    s.history = [h if len(h) == 3 else [-1, *h] for h in s.history]
    return s


def _median_and_spread(values: list[float]) -> tuple[float, float]:
    """The median and a robust standard deviation (from the median absolute deviation, at least
    MIN_SPREAD of the median)."""
    median = statistics.median(values)
    return median, max(MAD_TO_SIGMA * statistics.median(abs(x - median) for x in values), MIN_SPREAD * abs(median))


def _step_to_step_spread(values: list[float]) -> float:
    """A robust standard deviation of the losses from the differences of successive ones (each of
    two batches' noise: sqrt(2) sigma): a falling or rising trend does not widen it, as it does the
    spread around the median. At least MIN_SPREAD of the median."""
    floor = MIN_SPREAD * abs(statistics.median(values))
    if len(values) < 3:
        return max(_median_and_spread(values)[1], floor)
    steps = [abs(b - a) for a, b in zip(values, values[1:])]
    return max(MAD_TO_SIGMA * statistics.median(steps) / math.sqrt(2), floor)


def data_step(step: int, windows: list[list[int]]) -> int:
    """Which step's batches optimizer step `step` trains on, once skipped windows are left out.

    >>> data_step(25, [[20, 6]])  # after a rollback to step 20 that skipped 6 steps' batches
    31
    """
    return step + sum(count for start, count in windows if step >= start)


FIRST_STEPS_CHECKED = 10


def check_first_steps(step: int, loss: float) -> None:
    """A loss of exactly 0 or not finite in the first steps means nothing useful is being trained
    (peers' sharded QLoRA setups have trained for days at loss 0 with NaN gradient norms): stop before
    the update is applied and before more of the allocation is spent. Every rank sees the same
    reduced loss, so all stop together."""
    if loss == 0.0 or not math.isfinite(loss):
        raise Stopped(
            f"step {step + 1}: the training loss is {loss} in the first {FIRST_STEPS_CHECKED} steps, so the model is not learning; "
            "stopped. Usual causes: a learning rate far too high, fp16 overflow, every label masked, or a quantized base whose "
            "storage dtype does not match what the sharding strategy flattens", EXIT_DIVERGED
        )
