"""The guard's decisions on their own (milliseconds each): loss and gradient-norm series in, verdicts out.
The real runs that put it to work are in test_guard.py."""

from __future__ import annotations

import math
import random

import pytest

from finetune.config.schema import GuardConfig
from finetune.run.guard import DRIFT_STEPS, Guard, _median_and_spread, data_step


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
    # the first two steps at 2.5 are skipped as spikes, the third in a row rolls back (as any run's three spikes do)
    assert feed(Guard(GuardConfig(), min_rise=math.log(2)), diverged)[:3] == [(120, "skip"), (121, "skip"), (122, "rollback")]


# --- the start as a reference --------------------------------------------------------------------


def _record(name: str) -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "data" / "guard_series.json").read_text())[name]


def _started(record: dict, warmup: int = 5) -> Guard:
    guard = Guard(GuardConfig(), warmup=warmup)
    guard.state.start_level, guard.state.start_eval = record["start_level"], record.get("start_eval")
    return guard


def test_a_learning_rate_too_hot_from_the_first_step_rolls_back_to_the_start():
    """Recorded on the BPE model: LoRA at 250x its LR rose from 1.72 to 7.8 in the warmup and settled
    near 4.5 (eval 1.70 -> 4.44). Its gradient norm never collapsed and it never rose above its own
    best, so the guard without a start saw one spike and let it end as a success; against the start
    level its first level (step 10) is a divergence, rolled back to step 0."""
    record = _record("bpe_lora_lr_0.5_from_the_start")
    without_start = Guard(GuardConfig(), warmup=5)
    assert [action for _, action in feed_pairs(without_start, record["steps"])] == ["skip"]
    assert without_start.finish(79).action == "apply" and without_start.report()["final_is_best"] is True
    guard = _started(record)
    step, verdict = next((i, v) for i, (loss, grad) in enumerate(record["steps"]) if (v := guard.check(i, loss, grad)).action != "apply")
    assert (step, verdict.action, verdict.before_step) == (DRIFT_STEPS - 1, "rollback", 0), verdict
    assert "where the run started" in verdict.reason and "too high from the start" in verdict.reason


def test_a_hotter_lr_after_a_resume_rolls_back_to_the_last_cool_step_not_the_start():
    """20 healthy steps (the BPE model's LoRA run), then resumed with 250x the LR (the hot run's losses): the level rises
    above the start within the early window, but the weights were good until step 20: the rollback target (a
    checkpoint at or before before_step) is the step-20 checkpoint, not step 0."""
    healthy, hot = _record("bpe_lora_healthy"), _record("bpe_lora_lr_0.5_from_the_start")
    steps = healthy["steps"][:20] + hot["steps"][DRIFT_STEPS:]
    guard = _started(healthy)
    for i, (loss, grad) in enumerate(steps[:20]):  # the healthy run up to its step-20 checkpoint ...
        assert guard.check(i, loss, grad).action == "apply"
    resumed = _started(healthy)
    resumed.state, resumed.resumed_at = guard.state, 20  # ... resumed from it with its guard state
    step, verdict = next((i, v) for i, (loss, grad) in enumerate(steps[20:], 20) if (v := resumed.check(i, loss, grad)).action not in ("apply", "skip"))
    assert verdict.action == "rollback" and "where the run started" in verdict.reason and step < 20 + 2 * DRIFT_STEPS, (step, verdict)
    assert verdict.before_step == 20, verdict
    fresh = _started(healthy)  # the same losses in a run that was never resumed: hot from step 0 on, back to the start
    assert next(v for i, (loss, grad) in enumerate(steps) if (v := fresh.check(i, loss, grad)).action == "rollback").before_step == 0


def test_a_run_that_ends_worse_than_it_started_is_named_by_its_eval_or_else_its_level():
    record = _record("bpe_lora_lr_0.5_from_the_start")
    guard = _started(record)
    feed_pairs(guard, [[loss, 1.0] for loss, _ in record["steps"][30:]])  # the plateau alone, after the early window
    assert guard.worse_than_start(record["final_eval"]).startswith("the eval loss ended at 4.442, above its 1.699 before the first step")
    assert guard.worse_than_start(1.05 * record["start_eval"]) == ""  # the eval decides where it was measured
    guard.state.start_eval = None
    assert guard.worse_than_start().startswith(f"the loss level ended at {guard.level():.4g}, above the 1.718 it started from")
    assert guard.report()["start_loss_level"] == record["start_level"][0] and guard.report()["start_eval_loss"] is None


@pytest.mark.parametrize("name", ["demo_healthy", "bpe_lora_healthy"])
def test_healthy_recorded_runs_judged_against_their_start_trigger_nothing(name):
    """The demo (13.4 falling to 0.9) and a LoRA run on the BPE model whose loss starts where it stays
    (a model that already knows the text: 1.72 flat, eval 1.699 -> 1.699). The demo was recorded
    before the start was measured: its first DRIFT_STEPS losses stand in (weights that had barely moved)."""
    record = _record(name)
    if "start_level" not in record:
        record["start_level"] = list(_median_and_spread([loss for loss, _ in record["steps"][:DRIFT_STEPS]]))
    guard = _started(record, warmup=10)
    assert feed_pairs(guard, record["steps"]) == []
    assert guard.worse_than_start(record.get("final_eval")) == "" and guard.worse_than_start() == ""


def test_flat_runs_that_end_where_they_started_raise_no_alarm():
    """A model that already knows the task, or a tiny LR: the level stays at the start, each batch off
    by 2-10% (log-normal). 150 runs of 80 steps, the start measured on 10 batches of its own: no
    event, none ends worse than it started (the false-positive rate over 30,000 runs is in
    bench/results/guard.md)."""
    rng = random.Random(0)
    alarms = []
    for noise in (0.02, 0.05, 0.1):
        for run in range(50):
            level = rng.uniform(0.5, 6.0)
            guard = Guard(GuardConfig(), warmup=5)
            guard.set_start([level * math.exp(noise * rng.gauss(0, 1)) for _ in range(DRIFT_STEPS)])
            events = feed(guard, [level * math.exp(noise * rng.gauss(0, 1)) for _ in range(80)])
            if events or guard.worse_than_start():
                alarms.append((noise, run, events[:2], guard.worse_than_start()))
    assert alarms == []


def test_dpo_starting_at_ln2_is_judged_by_its_rise_beyond_min_rise():
    """DPO's start is ln 2 on every batch (the policy is its reference): its spread is the floor.
    A tiny LR that keeps it near ln 2 raises nothing; a rise of more than min_rise above it is a hot start."""
    rng = random.Random(2)
    guard = Guard(GuardConfig(), min_rise=math.log(2), warmup=5)
    guard.set_start([math.log(2)] * DRIFT_STEPS)
    assert feed(guard, [math.log(2) * (1 + 0.3 * rng.uniform(-1, 1)) for _ in range(60)]) == []
    assert guard.worse_than_start() == ""
    hot = Guard(GuardConfig(), min_rise=math.log(2), warmup=5)
    hot.set_start([math.log(2)] * DRIFT_STEPS)
    assert feed(hot, [1.6 + 0.1 * rng.random() for _ in range(DRIFT_STEPS)]) == [(DRIFT_STEPS - 1, "rollback")]
