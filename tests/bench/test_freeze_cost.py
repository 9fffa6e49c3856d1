"""benchmarks/freeze_cost.py reads its arms: a step or a share of the run's steps."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("freeze_cost", ROOT / "benchmarks" / "freeze_cost.py")
freeze_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(freeze_cost)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("none:0", ("none", 0, {})),
        ("static:1:4:150", ("static", 1, {"count": 4, "at_step": 150})),
        ("static:0:2:10%", ("static", 0, {"count": 2, "at_step": 75})),
        ("static:0:5:50%", ("static", 0, {"count": 5, "at_step": 375})),
        ("static:0:3:0.01%", ("static", 0, {"count": 3, "at_step": 1})),
        ("freezeout:0:t0=0.5", ("freezeout", 0, {"t0": 0.5})),
        ("autofreeze:1:percentile=25,interval=16", ("autofreeze", 1, {"percentile": 25, "interval": 16})),
        ("egeria:0:speed=fast", ("egeria", 0, {"speed": "fast"})),
    ],
)
def test_an_arm_is_a_policy_and_seed_or_a_static_freeze(text, expected):
    assert freeze_cost.parse_arm(text, 750) == expected


@pytest.mark.parametrize("text", ["static:0:4", "static:0:4:751", "static:0:4:0", "static:0:4:120%", "none", "x:y",
                                  "none:0:t0=0.5", "freezeout:0:t0", "freezeout:0:=0.5", "static:0:count=2"])
def test_a_bad_arm_is_named_with_the_runs_length(text):
    with pytest.raises(ValueError, match=rf"arm '{text}'.*the run's 750"):
        freeze_cost.parse_arm(text, 750)


def test_an_arm_frozen_to_the_average_keeps_its_runs_apart_but_plain_is_shared():
    assert freeze_cost.tag_of("static", {"count": 5, "at_step": 150}) == "static5at150"
    assert freeze_cost.tag_of("static", {"count": 5, "at_step": 150}, True) == "static5at150-average"
    assert freeze_cost.tag_of("none", {}, True) == "none"
    assert freeze_cost.tag_of("static", {"count": 5, "at_step": 150}, cache=True) == "static5at150-cache"
    assert freeze_cost.tag_of("static", {"count": 5, "at_step": 150}, True, True) == "static5at150-average-cache"
    assert freeze_cost.tag_of("none", {}, cache=True) == "none"


def _run(steps, metric=0.9, wall=100.0, steps_per_epoch=100):
    """A static arm's run that froze at its first step, before its first record (no pace of
    its own: read at its whole run)."""
    return {"policy": "static", "events": [{"step": 1, "action": "freeze"}], "steps_per_epoch": steps_per_epoch,
            "records": [{"step": s, "metric": metric, "frozen": []} for s in steps],
            "final": {"metric": metric, "wall_time_s": wall}}


def test_a_runs_cadence_is_its_evaluations_in_the_first_epoch():
    assert freeze_cost.records_per_epoch(_run([100, 200, 300])) == 1
    assert freeze_cost.records_per_epoch(_run([50, 100, 150, 200, 250, 300])) == 2
    assert freeze_cost.records_per_epoch(_run([33, 66, 99, 100, 133])) == 4


def test_an_arm_evaluated_at_another_cadence_than_its_plain_is_marked():
    plain = _run([50, 100, 150, 200], metric=0.9, wall=100.0)
    same = freeze_cost.row("static", 0, {"count": 2, "at_step": 50}, _run([50, 100, 150, 200], 0.89, 50.0), plain)
    other = freeze_cost.row("static", 0, {"count": 2, "at_step": 50}, _run([100, 200], 0.89, 50.0), plain)
    assert same["cadence_as_plain"] and not other["cadence_as_plain"]
    assert (same["records_per_epoch"], other["records_per_epoch"]) == (2, 1)
    assert other["points_vs_plain"] == pytest.approx(-1.0) and other["speedup_vs_plain"] == pytest.approx(2.0)


def test_an_arm_run_on_a_faster_machine_than_its_plain_is_also_timed_at_plains_pace():
    def run(policy, seconds_per_step, freeze_at=None):
        out = _run([100, 200, 300, 400], 0.9, seconds_per_step * (400 if freeze_at is None else 250))
        out["policy"] = policy
        out["events"] = [] if freeze_at is None else [{"step": freeze_at, "action": "freeze"}]
        for rec in out["records"]:
            rec["wall_time_s"] = seconds_per_step * rec["step"]
        return out

    plain = run("none", 1.0)
    # a machine 1.25x faster than plain's: 2x raw, 1.6x at plain's pace
    fast = freeze_cost.row("static", 0, {"count": 2, "at_step": 200}, run("static", 0.8, freeze_at=200), plain)
    assert fast["speedup_vs_plain"] == pytest.approx(2.0)
    assert fast["speedup_at_plains_pace"] == pytest.approx(1.6)
    # frozen before its first record: nothing ran alike to set the pace by
    early = freeze_cost.row("static", 0, {"count": 2, "at_step": 50}, run("static", 0.8, freeze_at=50), plain)
    assert early["speedup_at_plains_pace"] is None
    assert freeze_cost.row("none", 0, {}, plain, plain)["speedup_at_plains_pace"] is None


def test_fs_arms_are_evaluated_at_the_cadence_of_its_committed_plain_seeds():
    import json

    plains = sorted((ROOT / "benchmarks/results/tta-full/cpu/minilm-ptb-order").glob("none-seed*.json"))
    assert len(plains) == 3
    for path in plains:
        assert freeze_cost.records_per_epoch(json.loads(path.read_text())) == freeze_cost.CUTS["minilm-ptb-order"].records_per_epoch


def test_an_arms_options_run_over_the_tasks_own_and_are_checked_before_anything_runs():
    defaults = {"freezeout": {"t0": 0.8, "scaling": "cubic"}, "autofreeze": {"interval": 16, "percentile": 50.0}}
    assert freeze_cost.arm_overrides("freezeout", {"t0": 0.5}, defaults) == {
        "policy_options": {"t0": 0.5, "scaling": "cubic"}}
    assert freeze_cost.arm_overrides("freezeout", {}, defaults) == {}  # the task's own options, as the suite ran
    assert freeze_cost.arm_overrides("egeria", {"speed": "fast"}, defaults) == {"speed": "fast"}
    assert freeze_cost.arm_overrides("static", {"count": 2, "at_step": 5}, defaults) == {
        "policy_options": {"count": 2, "at_step": 5}}
    with pytest.raises(ValueError, match="percentile"):
        freeze_cost.arm_overrides("autofreeze", {"percentile": 250}, defaults)
    with pytest.raises(ValueError):
        freeze_cost.arm_overrides("freezeout", {"t_zero": 0.5}, defaults)
    with pytest.raises(ValueError, match="speed"):
        freeze_cost.arm_overrides("egeria", {"speed": "warp"}, defaults)


def test_an_arm_with_options_keeps_its_runs_apart_from_the_default_settings():
    assert freeze_cost.tag_of("freezeout", {}) == "freezeout"
    assert freeze_cost.tag_of("freezeout", {"t0": 0.5}) == "freezeout-t0=0.5"
    assert freeze_cost.tag_of("egeria", {"speed": "fast"}, cache=True) == "egeria-speed=fast-cache"


def test_each_baseline_setting_is_set_against_the_egeria_settings_at_least_as_fast_and_as_accurate():
    plain0, plain1 = _run([100], 0.90, 100.0), _run([100], 0.88, 100.0)
    rows = [freeze_cost.row("none", 0, {}, plain0, plain0), freeze_cost.row("none", 1, {}, plain1, plain1),
            freeze_cost.row("egeria", 0, {"speed": "fast"}, _run([100], 0.89, 80.0), plain0),
            freeze_cost.row("freezeout", 0, {"t0": 0.5}, _run([100], 0.885, 90.0), plain0),  # dominated
            freeze_cost.row("freezeout", 0, {}, _run([100], 0.87, 50.0), plain0)]  # faster: not dominated
    goal = {d["baseline"]: d["dominated_by"] for d in freeze_cost.frontier(rows)}
    assert goal == {"freezeout-t0=0.5": ["egeria-speed=fast"], "freezeout": []}
    assert [round(r["vs_worst_plain"], 6) for r in rows] == [2.0, 0.0, 1.0, 0.5, -1.0]  # points over 0.88
    assert freeze_cost.frontier(rows[:1] + rows[2:]) == []  # one plain seed: no worst seed to judge by
