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
