from __future__ import annotations

import json

import numpy as np
import pytest

from egeria.knowledge.plasticity import ModuleWatch, least_squares_slope


def feed(watch: ModuleWatch, values):
    return [watch.update(v) for v in values]


def first_freeze(readings) -> int | None:
    return next((i for i, r in enumerate(readings) if r.freeze), None)


def test_slope_matches_numpy_polyfit():
    values = [3.0, 2.5, 2.7, 1.9, 1.2, 1.25]
    assert least_squares_slope(values) == pytest.approx(np.polyfit(range(6), values, 1)[0])
    assert least_squares_slope([4.0]) == 0.0


def test_flat_plasticity_freezes_after_exactly_w_low_slope_readings():
    window = 5
    watch = ModuleWatch(window=window, tolerance_ratio=0.2)
    # A falling start sets the tolerance, then the values go flat.
    readings = feed(watch, [1.0, 0.8, 0.6] + [0.5] * 40)
    frozen_at = first_freeze(readings)
    assert frozen_at is not None
    # The reading that freezes is the W-th consecutive stale one, and no earlier one froze.
    assert readings[frozen_at].stale == window
    assert all(r.stale == window - k for k, r in enumerate(reversed(readings[frozen_at - window + 1 : frozen_at + 1])))
    assert readings[frozen_at - window].stale == 0


def test_constant_plasticity_from_the_start_freezes():
    watch = ModuleWatch(window=4, tolerance_ratio=0.2)
    readings = feed(watch, [0.1] * 20)
    # Slopes exist from reading 2, the tolerance from reading 4 (3 slopes), then 4 stale readings.
    assert first_freeze(readings) == 3 + 4 - 1


def test_steadily_falling_plasticity_never_freezes():
    watch = ModuleWatch(window=5, tolerance_ratio=0.2)
    readings = feed(watch, [1.0 - 0.01 * i for i in range(80)])
    assert first_freeze(readings) is None
    assert all(r.stale == 0 for r in readings)


def test_tolerance_is_per_module_from_its_first_three_slopes():
    fast, slow = ModuleWatch(window=4, tolerance_ratio=0.2), ModuleWatch(window=4, tolerance_ratio=0.2)
    feed(fast, [1.0, 0.5, 0.3, 0.25])
    feed(slow, [1.0, 0.99, 0.985, 0.98])
    assert fast.tolerance == pytest.approx(0.2 * max(abs(s) for s in fast.first_slopes))
    assert slow.tolerance == pytest.approx(0.2 * max(abs(s) for s in slow.first_slopes))
    assert len(fast.first_slopes) == len(slow.first_slopes) == 3
    # First slopes, by hand: least squares over the smoothed values so far.
    smoothed = [1.0, 0.75, (1.0 + 0.5 + 0.3) / 3, (1.0 + 0.5 + 0.3 + 0.25) / 4]
    expected = [least_squares_slope(smoothed[: k + 1]) for k in (1, 2, 3)]
    assert fast.first_slopes == pytest.approx(expected)
    assert fast.tolerance > 10 * slow.tolerance
    # The same slowly falling readings are stale for the fast module and not for the slow one.
    drift = [0.2 - 0.002 * i for i in range(12)]
    fast_later = feed(ModuleWatch.from_state(fast.state_dict()), [0.25] * 4 + drift)
    slow_later = feed(ModuleWatch.from_state(slow.state_dict()), [0.98] * 4 + [0.98 - 0.002 * i for i in range(12)])
    assert fast_later[-1].stale > 0
    assert slow_later[-1].stale == 0


def test_a_bump_resets_the_stale_counter():
    watch = ModuleWatch(window=8, tolerance_ratio=0.2)
    before = feed(watch, [1.0, 0.8, 0.6] + [0.5] * 14)
    assert before[-1].stale > 0 and first_freeze(before) is None
    bump = watch.update(3.0)
    assert bump.stale == 0 and not bump.freeze


def test_non_finite_reading_is_rejected():
    watch = ModuleWatch(window=4, tolerance_ratio=0.2)
    with pytest.raises(ValueError, match="nan"):
        watch.update(float("nan"))


def test_state_round_trip_continues_identically():
    values = [1.0, 0.8, 0.7, 0.65, 0.6, 0.6, 0.61, 0.6, 0.6, 0.6, 0.6, 0.6]
    a = ModuleWatch(window=3, tolerance_ratio=0.2)
    feed(a, values[:5])
    b = ModuleWatch.from_state(a.state_dict())
    assert feed(a, values[5:]) == feed(b, values[5:])


def _around_a_drop(watch: ModuleWatch, regimes: bool) -> list:
    """Plasticity at a high level, wobbling at LR 0.1 (never stale: the first slopes are
    flat, so the tolerance is 0), then 100x lower and flat after a 10x LR drop (the shape of
    the full-length runs' readings)."""
    high = [0.3] * 4 + [0.3 + 0.02 * (-1) ** i for i in range(20)]
    readings = []
    # The first reading after the drop spans it: between the two levels.
    for lr, values in ((0.1, high), (0.01, [0.05] + [0.003] * 30)):
        for v in values:
            if regimes:
                watch.new_regime(lr)
            readings.append(watch.update(v))
    return readings[len(high):]  # the readings after the drop


def test_a_learning_rate_drop_restarts_the_average_so_the_new_level_is_read_at_once():
    window = 5
    restarted = _around_a_drop(ModuleWatch(window=window, tolerance_ratio=0.2), regimes=True)
    straddled = _around_a_drop(ModuleWatch(window=window, tolerance_ratio=0.2), regimes=False)
    # Restarted: the reading spanning the drop joins no average; the next one is the whole
    # average, the slope exists from the one after, and W stale readings freeze it.
    assert not restarted[0].counted and restarted[0].stale == 0 and not restarted[0].freeze
    assert restarted[1].counted and restarted[1].smoothed == 0.003 and restarted[1].slope is None
    assert first_freeze(restarted) == 1 + window
    # Straddled: the average still holds LR-0.1 readings, whose fall reads as a steep slope.
    assert straddled[0].smoothed > 0.1 and first_freeze(straddled) >= first_freeze(restarted) + window - 1


def test_new_regime_fires_at_a_2x_change_either_way_and_is_kept_in_the_state():
    watch = ModuleWatch(window=3, tolerance_ratio=0.2)
    assert [watch.new_regime(lr) for lr in (0.1, 0.1, 0.06, 0.01, 0.05, 0.05)] == [False, False, False, True, True, False]
    feed(watch, [1.0, 1.0])
    restored = ModuleWatch.from_state(watch.state_dict())
    assert restored.lr == 0.05 and restored.raw == watch.raw and not restored.new_regime(0.04)


def test_the_reading_spanning_a_restart_is_left_out_even_across_a_saved_state():
    watch = ModuleWatch(window=3, tolerance_ratio=0.2)
    watch.new_regime(0.1)
    feed(watch, [1.0, 1.0])
    assert watch.new_regime(0.01)
    restored = ModuleWatch.from_state(watch.state_dict())  # saved between the drop and its reading
    spanning = restored.update(5.0)
    assert not spanning.counted and restored.raw == [] and restored.smoothed == []
    assert restored.update(0.01).smoothed == 0.01  # the new regime's first value, alone


def test_readings_at_their_floor_are_quiet_and_freeze_after_w_whatever_the_slope():
    watch = ModuleWatch(window=3, tolerance_ratio=0.2, floor_ratio=2.0)
    # Noise at the floor: every smoothed value is within 2x the smoothed floor.
    values = (1.0, 3.0, 1.0, 3.0, 1.0, 3.0)
    readings = [watch.update(v, floor=1.5) for v in values]
    # the verdict waits for readings covering a span (W = 3); then it holds at each reading
    assert [r.quiet for r in readings] == [0, 0, 1, 2, 3, 4]
    assert readings[2].freeze and not readings[1].freeze
    assert readings[2].stale == 0  # no tolerance yet: the slope could not have frozen it
    assert readings[-1].floor == 1.5


@pytest.mark.parametrize("floor_ratio, floors", [(2.0, [0.4] * 6), (None, [10.0] * 6), (2.0, [None] * 6)])
def test_readings_above_their_floor_or_without_one_are_not_quiet(floor_ratio, floors):
    watch = ModuleWatch(window=3, tolerance_ratio=0.2, floor_ratio=floor_ratio)
    readings = [watch.update(v, floor=f) for v, f in zip((1.0, 3.0, 1.0, 3.0, 1.0, 3.0), floors)]
    assert all(r.quiet == 0 for r in readings)  # 2 > 2 x 0.4; no ratio; no floor
    assert all(r.floor is None for r in readings) is (floors[0] is None)  # a floor measured is reported


def test_the_quiet_verdict_is_the_median_of_three_spans_and_a_new_regime_clears_it():
    watch = ModuleWatch(window=2, tolerance_ratio=0.2, floor_ratio=2.0)
    # one loud reading among quiet ones moves the median of the last three spans (6 readings)
    # no more than any other reading: the verdict holds
    assert [watch.update(v, floor=1.0).quiet for v in (1.0, 1.0, 9.0, 1.0, 1.0, 1.0)] == [0, 1, 2, 3, 4, 5]
    # loud for half of the evidence or more: not quiet until quiet readings hold its middle again
    loud = ModuleWatch(window=2, tolerance_ratio=0.2, floor_ratio=2.0)
    values = (1.0, 1.0, 9.0, 9.0, 9.0, 1.0, 1.0, 1.0, 1.0)
    assert [loud.update(v, floor=1.0).quiet for v in values] == [0, 1, 2, 0, 0, 0, 0, 0, 1]
    assert loud.quiet_from == loud.evidence_steps[0] == 4  # the verdict holds the evidence from step 4
    watch.new_regime(0.1)
    watch.new_regime(0.01)  # a 10x fall: the average, the floors and the quiet count restart
    assert watch.quiet == 0 and watch.floors == [] and watch.evidence == []
    copy = ModuleWatch.from_state(json.loads(json.dumps(watch.state_dict())))
    assert copy == watch


def test_a_bad_floor_is_rejected_with_its_value():
    watch = ModuleWatch(window=3, tolerance_ratio=0.2, floor_ratio=2.0)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="floor"):
            watch.update(1.0, floor=bad)


def _quiet_freeze(every: int, first: int) -> int | None:
    """The step at which a module whose drift falls to its floor at step 160, with one loud
    reading at step 200, freezes quiet when read every ``every`` steps from ``first``."""
    watch = ModuleWatch(window=3, tolerance_ratio=0.2, floor_ratio=8.0, lag=20)
    for step in range(first, 1000, every):
        drift = 60.0 if step == 200 else 30.0 if step < 160 else 3.0
        watch.update(drift, floor=1.0, step=step)
        if watch.holds(watch.quiet_from):
            return step
    return None


def test_a_quiet_verdict_moves_no_more_than_one_interval_with_where_the_readings_fall():
    # the same drift read every 20 steps and every 40 from either phase: one loud reading
    # moves the median no more than a quiet one, wherever the sampling catches it
    steps = [_quiet_freeze(20, 20), _quiet_freeze(40, 20), _quiet_freeze(40, 40)]
    assert None not in steps and max(steps) - min(steps) <= 40, steps


def test_a_watch_saved_before_the_median_takes_its_spans_readings_as_evidence():
    watch = ModuleWatch(window=3, tolerance_ratio=0.2, floor_ratio=2.0, lag=20)
    for step in (20, 40, 60, 80):
        watch.update(1.0, floor=1.0, step=step)
    state = watch.state_dict()
    del state["evidence"], state["evidence_steps"]
    old = ModuleWatch.from_state(state)
    assert old.evidence == old.raw and old.evidence_steps == old.steps == [40, 60, 80]
    assert old.update(1.0, floor=1.0, step=100).freeze  # its verdict carries on


def test_one_stray_floor_does_not_make_a_moving_module_quiet():
    """The demo's stem read every 20 steps on an AMD EPYC VM (the same-decisions matrix of
    2026-12-08), the first span after the first drop: its readings 7.5e-6, 6.5e-7 and 7.1e-7
    against floors of 7.7e-8, 1.4e-8 and 2.5e-7, a floor tenfold its neighbours. The mean of
    those floors (1.1e-7) put 8x the floor above the readings' median and froze the stem at
    step 500, where every run read every 28-40 steps froze it at 700-723; their median
    (7.7e-8) does not (docs/decisions/043-floor-median.md)."""
    watch = ModuleWatch(window=3, tolerance_ratio=0.2, floor_ratio=8.0, lag=20)
    for step, plasticity, floor in ((440, 7.54e-6, 7.7e-8), (460, 6.51e-7, 1.42e-8), (480, 7.08e-7, 2.45e-7)):
        reading = watch.update(plasticity, floor, step)
    assert reading.floor == pytest.approx(7.7e-8)
    assert reading.median == pytest.approx(7.08e-7)
    assert (reading.quiet, reading.freeze) == (0, False)
    # once most of its readings of the evidence sit near the floor, it is quiet as before
    verdicts = [watch.update(1.0e-7, 7.0e-8, step).freeze for step in (500, 520, 540)]
    assert verdicts == [False, False, True]
