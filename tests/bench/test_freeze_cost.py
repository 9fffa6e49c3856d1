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
    ],
)
def test_an_arm_is_a_policy_and_seed_or_a_static_freeze(text, expected):
    assert freeze_cost.parse_arm(text, 750) == expected


@pytest.mark.parametrize("text", ["static:0:4", "static:0:4:751", "static:0:4:0", "static:0:4:120%", "none", "x:y"])
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
    return {"steps_per_epoch": steps_per_epoch, "records": [{"step": s, "metric": metric, "frozen": []} for s in steps],
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


def test_fs_arms_are_evaluated_at_the_cadence_of_its_committed_plain_seeds():
    import json

    plains = sorted((ROOT / "benchmarks/results/tta-full/cpu/minilm-ptb-order").glob("none-seed*.json"))
    assert len(plains) == 3
    for path in plains:
        assert freeze_cost.records_per_epoch(json.loads(path.read_text())) == freeze_cost.CUTS["minilm-ptb-order"].records_per_epoch
