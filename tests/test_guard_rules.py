"""The guard's decisions on their own (milliseconds each): loss and gradient-norm series in, verdicts out.
The real runs that put it to work are in test_guard.py."""

from __future__ import annotations

import math
import random

import pytest

from finetune.config import GuardConfig
from finetune.guard import DRIFT_STEPS, Guard, data_step


def descent(steps: int, seed: int = 0, noise: float = 0.08) -> list[float]:
    """A healthy run's per-token loss: a steep fall from 10 to 2 over the first 30 steps, then a slow
    one, each step off by up to `noise` of its level (hard and easy batches)."""
    rng = random.Random(seed)
    return [(2 + 8 * math.exp(-i / 8) - 0.002 * i) * (1 + noise * rng.uniform(-1, 1)) for i in range(steps)]


def feed(guard: Guard, losses, first_step: int = 0, grad_norm: float = 1.0) -> list[tuple[int, str]]:
    """Every step that was not simply applied, as (step, action)."""
    events = []
    for i, loss in enumerate(losses, start=first_step):
        verdict = guard.check(i, loss, grad_norm)
        if verdict.action != "apply":
            events.append((i, verdict.action))
    return events


def test_a_healthy_run_with_odd_hard_batches_triggers_nothing():
    losses = descent(400)
    for i in (60, 150, 290):  # batches twice as hard as the rest (seen on the demo)
        losses[i] *= 2
    guard = Guard(GuardConfig())
    assert feed(guard, losses) == []
    assert guard.report()["final_is_best"] is True and guard.finish(399).action == "apply"


def test_gradient_norms_twenty_times_the_median_are_not_spikes_but_a_hundred_times_are():
    guard = Guard(GuardConfig())
    for i in range(30):
        assert guard.check(i, 2.0, 1.0).action == "apply"
    assert guard.check(30, 2.0, 20.0).action == "apply"
    verdict = guard.check(31, 2.0, 150.0)
    assert verdict.action == "skip" and "grad norm spike" in verdict.reason


def test_the_early_descent_does_not_widen_the_band():
    """Mean + 6 std over a history holding the fall from 10 let a 1.47x loss pass; a median and MAD
    of the recent steps do not: it is caught as a drift within DRIFT_STEPS // 2 + 1 steps."""
    losses = descent(100)
    level = losses[-1]
    guard = Guard(GuardConfig())
    assert feed(guard, losses) == []
    events = feed(guard, [1.47 * level] * 20, first_step=100)
    assert events and events[0][1] == "rollback"
    assert events[0][0] - 100 < DRIFT_STEPS // 2 + 1


def test_a_single_wild_spike_is_skipped_and_three_roll_back():
    guard = Guard(GuardConfig())
    assert feed(guard, descent(60)) == []
    assert feed(guard, [1000.0], first_step=60) == [(60, "skip")]
    assert feed(guard, descent(20, seed=1)[-5:] + [float("nan"), 1e4], first_step=61) == [(66, "skip"), (67, "rollback")]


def test_after_a_rollback_the_guard_judges_against_the_good_state_at_once():
    """The issue's bad day: the loss climbs back after the rollback; each climb is caught within the
    stated bound, rolls back again, and the last rung stops."""
    cfg = GuardConfig(max_rollbacks=2)
    guard = Guard(cfg)
    assert feed(guard, descent(100)) == []
    saved = guard.state_dict()  # the checkpoint of step 100
    for rollback in range(3):
        events = feed(guard, [1.7 * guard.level()] * 30, first_step=100)  # not a spike: a level well above
        assert events, f"no verdict after rollback {rollback}"
        step, action = events[0]
        assert step - 100 < DRIFT_STEPS // 2 + 1  # judged at once: no min_history steps of blindness
        if rollback < 2:
            assert action == "rollback"
            guard.rolled_back(100, step, saved=saved)
        else:
            assert action == "stop"
    assert guard.state.rollbacks == 2 and guard.state.lr_scale == 0.25
    assert [start for start, _ in guard.state.skip_windows] == [100, 100]


def test_a_drift_rolls_back_to_before_the_rise():
    guard = Guard(GuardConfig())
    losses = descent(100)
    assert feed(guard, losses) == []
    rising = [losses[-1] * (1 + 0.05 * i) for i in range(1, 30)]  # +5% a step from step 100 on
    verdict = next(v for v in (guard.check(i, loss, 1.0) for i, loss in enumerate(rising, start=100)) if v.action != "apply")
    assert verdict.action == "rollback" and "drifted up" in verdict.reason
    assert 50 <= verdict.before_step < 100  # the checkpoint to go back to is from before the rise


def test_a_run_that_ends_worse_than_its_best_is_not_finished():
    guard = Guard(GuardConfig(window=20))
    assert feed(guard, descent(100)) == []
    best = guard.level()
    # A slow rise, too slow for the 20-step window, ends 40% above the best level.
    assert feed(guard, [best * (1 + 0.4 * i / 200) for i in range(1, 201)], first_step=100) == []
    report = guard.report()
    assert report["final_is_best"] is False and report["best_loss_level"] == pytest.approx(best, rel=0.05)
    verdict = guard.finish(299)
    assert verdict.action == "rollback" and "ended at loss level" in verdict.reason and verdict.before_step < 110


def test_nothing_but_non_finite_values_is_judged_before_min_history():
    guard = Guard(GuardConfig(min_history=20))
    assert feed(guard, [5.0] * 10 + [500.0] + [5.0] * 5) == []
    assert feed(guard, [float("inf")], first_step=16) == [(16, "skip")]


def test_a_checkpoint_is_a_rollback_target_only_with_no_anomaly_in_the_window_before_it():
    guard = Guard(GuardConfig(window=10))
    feed(guard, descent(40))
    guard.check(40, float("nan"), 1.0)
    assert not guard.is_healthy(45) and guard.is_healthy(51)


def test_state_from_checkpoints_of_the_earlier_format_loads():
    """Older checkpoints kept [loss, grad_norm] rows without their step."""
    guard = Guard(GuardConfig(), {"history": [[2.0, 1.0]] * 30, "anomalies": [], "rollbacks": 0, "lr_scale": 1.0,
                                  "max_grad_norm": None, "skip_windows": []})
    assert guard.check(30, 2.0, 1.0).action == "apply"
    assert guard.check(31, 100.0, 1.0).action == "skip"


def test_data_step_leaves_skipped_windows_out():
    assert data_step(10, []) == 10
    assert data_step(19, [[20, 6]]) == 19 and data_step(20, [[20, 6]]) == 26
    assert data_step(20, [[20, 6], [20, 6]]) == 32


def _recorded(name: str) -> list[list[float]]:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "guard_series.json").read_text())[name]["steps"]


def test_the_recorded_demo_run_triggers_nothing():
    """Every step of `make demo` (300 steps, logged one by one): no skip, no drift, the final weights the best."""
    guard = Guard(GuardConfig())
    verdicts = [guard.check(i, loss, grad) for i, (loss, grad) in enumerate(_recorded("demo_healthy"))]
    assert [v for v in verdicts if v.action != "apply"] == []
    assert guard.finish(299).action == "apply" and guard.report()["final_is_best"] is True


@pytest.mark.parametrize("name, caught_at", [("demo_lr_1.0_from_the_start", 11), ("demo_lr_0.05_from_the_start", 25),
                                             ("demo_full_lr_0.05_from_the_start", 41)])
def test_a_learning_rate_too_high_from_the_start_stops_the_run_early(name, caught_at):
    """Recorded demo runs at 25x-500x the demo's LR (LoRA and full fine-tuning): the loss never rose,
    it settled at 2-4x the healthy run's eval loss while the gradient norm collapsed. The guard stops
    within the first `window` steps, with nothing to roll back to: every checkpoint was trained at
    that LR."""
    guard = Guard(GuardConfig())
    verdicts = [(i + 1, guard.check(i, loss, grad)) for i, (loss, grad) in enumerate(_recorded(name))]
    stops = [(step, v) for step, v in verdicts if v.action != "apply"]
    assert stops[0][0] == caught_at and stops[0][1].action == "stop" and stops[0][1].before_step == 0, stops[:3]
    assert "too high from the start" in stops[0][1].reason


def test_the_collapse_rule_judges_the_first_window_only_and_can_be_turned_off():
    flat = [[6.0, 1.0]] + [[5.9, 0.01]] * 60  # the gradient down 100x, the loss 2%
    assert feed_pairs(Guard(GuardConfig()), flat)[0] == (9, "stop")
    assert feed_pairs(Guard(GuardConfig(grad_collapse=0)), flat) == []
    converged = [[6.0, 1.0]] + [[6.0 - 0.1 * i, 1.0] for i in range(1, 50)] + [[1.0, 0.001]] * 30  # collapse after step 50
    assert feed_pairs(Guard(GuardConfig()), converged) == []


def feed_pairs(guard: Guard, steps) -> list[tuple[int, str]]:
    return [(i, v.action) for i, (loss, grad) in enumerate(steps) if (v := guard.check(i, loss, grad)).action != "apply"]


def test_a_dpo_loss_near_zero_swings_without_alarm_but_a_rise_above_its_start_rolls_back():
    """DPO's per-batch loss near 0 swings by most of ln 2 (a few pairs the policy still ranks wrong);
    with min_rise = ln 2 (the dpo default) that is noise, while the same series read as a cross-entropy
    (min_rise 0) has spikes and a drift. A real divergence, the loss well above where it started, is still caught."""
    rng = random.Random(1)
    settled = [0.6931 * math.exp(-i / 15) for i in range(60)] + [0.02 + 0.6 * (rng.random() < 0.1) + 0.01 * rng.random() for _ in range(60)]
    assert feed(Guard(GuardConfig(), min_rise=0.0), settled)  # the cross-entropy reading
    assert feed(Guard(GuardConfig(), min_rise=math.log(2)), settled) == []
    diverged = settled + [2.5 + 0.1 * rng.random() for _ in range(DRIFT_STEPS)]
    assert feed(Guard(GuardConfig(), min_rise=math.log(2)), diverged)[-1][1] in ("skip", "rollback", "stop")
