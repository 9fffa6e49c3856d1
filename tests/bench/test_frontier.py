"""benchmarks/frontier.py: its arms parse to the configs they name (or are refused, named),
and its report turns session files into points against the right plain runs and says which
baselines an Egeria setting dominates. No training here: the sessions are written by hand."""

from __future__ import annotations

import json

import pytest

from scripts import load_script

frontier = load_script("benchmarks/frontier.py")


@pytest.mark.parametrize(
    "arm, fields",
    [
        ("plain", {}),
        ("egeria:safe", {"speed": "safe"}),
        ("egeria:0.03", {"speed": 0.03}),
        ("egeria:fast:unfreeze=10", {"speed": "fast", "unfreeze": 10}),
        ("paper", {"rule": "paper"}),
        ("freezeout:t0=0.5", {"policy": "freezeout", "policy_options": {"t0": 0.5}}),
        ("static:count=5:at_step=450", {"policy": "static", "policy_options": {"count": 5, "at_step": 450}}),
    ],
)
def test_an_arm_names_the_config_it_trains(arm, fields):
    assert frontier.parse_arm(arm) == (arm, fields)


@pytest.mark.parametrize("arm", ["egeria", "egeria:quick", "plain:1", "sgd:lr=1", "static:count"])
def test_a_bad_arm_is_refused_by_name(arm):
    with pytest.raises(ValueError, match=f"arm {arm!r}"):
        frontier.parse_arm(arm)


def _session(tmp_path, scale, seed, arms):
    """A session file: arms as (name, final accuracy, training seconds, first freeze step)."""
    runs = [{"arm": name, "final_accuracy": acc, "train_time_s": t,
             "events": [] if first is None else [{"action": "freeze", "step": first}], "frozen_at_end": []}
            for name, acc, t, first in arms]
    path = tmp_path / f"x{scale}" / f"seed{seed}-a.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"scale": scale, "seed": seed, "total_steps": 800 * scale, "machine": {"cpu": "x"},
                                "arms": runs}))


def test_points_are_against_their_sessions_plain_and_the_worst_plain_seed_and_dominance_is_read_from_means(tmp_path):
    _session(tmp_path, 1, 0, [("plain", 0.900, 100.0, None), ("egeria:fast", 0.899, 80.0, 450),
                              ("static:count=5:at_step=450", 0.897, 82.0, 450), ("linear:start=0.5", 0.901, 70.0, 400)])
    _session(tmp_path, 1, 1, [("plain", 0.895, 120.0, None), ("egeria:fast", 0.896, 100.0, 450)])
    rows = frontier.points(tmp_path)
    fast0 = next(r for r in rows if r["arm"] == "egeria:fast" and r["seed"] == 0)
    assert fast0["speedup"] == pytest.approx(1.25) and fast0["vs_worst_plain"] == pytest.approx(0.4)
    assert fast0["vs_own_plain"] == pytest.approx(-0.1) and fast0["first_freeze"] == 450
    summary = frontier.summarise(rows)
    fast = next(s for s in summary if s["arm"] == "egeria:fast")
    assert fast["seeds"] == [0, 1] and fast["speedup"] == pytest.approx((1.25 + 1.2) / 2)
    assert fast["vs_worst_plain"] == pytest.approx((0.4 + 0.1) / 2)
    goal = {g["baseline"]: g["dominated_by"] for g in frontier.dominated(summary)}
    # static (1.22x, +0.2) is dominated by egeria:fast (1.225x, +0.25); linear (1.43x, +0.6) is not
    assert goal == {"static:count=5:at_step=450": ["egeria:fast"], "linear:start=0.5": []}


def test_a_seed_run_in_several_sessions_counts_once_in_the_mean(tmp_path):
    _session(tmp_path, 1, 0, [("plain", 0.900, 100.0, None), ("egeria:fast", 0.899, 80.0, 450)])
    second = tmp_path / "x1" / "seed0-b.json"  # seed 0 again, another session: its plain and fast again
    second.write_text((tmp_path / "x1" / "seed0-a.json").read_text().replace("80.0", "50.0"))
    _session(tmp_path, 1, 1, [("plain", 0.895, 120.0, None), ("egeria:fast", 0.896, 120.0, 450)])
    summary = {s["arm"]: s for s in frontier.summarise(frontier.points(tmp_path))}
    assert summary["plain"]["seeds"] == [0, 1]
    assert summary["plain"]["vs_worst_plain"] == pytest.approx((0.5 + 0.0) / 2)  # not (0.5 + 0.5 + 0) / 3
    # seed 0 is the mean of its two sessions (1.25x, 2.0x), then averaged with seed 1 (1.0x)
    assert summary["egeria:fast"]["speedup"] == pytest.approx(((1.25 + 2.0) / 2 + 1.0) / 2)
    assert len(summary["egeria:fast"]["each"]) == 3


def test_egeria_settings_that_another_egeria_setting_beats_leave_its_frontier():
    def point(arm, speedup, gain, scale=1):
        return {"scale": scale, "arm": arm, "speedup": speedup, "vs_worst_plain": gain}

    summary = [point("egeria:safe", 1.05, 0.2), point("egeria:balanced", 1.04, 0.1),  # beaten by safe
               point("egeria:fast", 1.2, 0.0), point("egeria:1", 1.2, -0.1),  # beaten by fast (a tie on speed)
               point("static:count=5:at_step=450", 1.4, -0.3),  # a baseline: not Egeria's frontier
               point("egeria:fast", 1.1, -0.5, scale=4)]  # another run length: judged on its own
    front = [(s["scale"], s["arm"]) for s in frontier.egeria_front(summary)]
    assert front == [(1, "egeria:safe"), (1, "egeria:fast"), (4, "egeria:fast")]


def test_an_arm_run_under_another_horizon_than_its_name_gives_today_says_so():
    from egeria import EgeriaConfig

    today = EgeriaConfig(speed="fast").to_dict()
    before = {**today, "horizon": 0.0005}  # a session from before the speed moved the horizon
    assert frontier.arm_label({"arm": "egeria:fast", "config": today}) == "egeria:fast"
    assert frontier.arm_label({"arm": "egeria:fast", "config": before}) == "egeria:fast (horizon 0.0005)"
    assert frontier.arm_label({"arm": "egeria:fast:unfreeze=10", "config": today}) == "egeria:fast:unfreeze=10"
    given = EgeriaConfig(speed="fast", horizon=0.05).to_dict()
    assert frontier.arm_label({"arm": "egeria:fast:horizon=0.05", "config": given}) == "egeria:fast:horizon=0.05"
    assert frontier.arm_label({"arm": "plain", "config": None}) == "plain"
    assert frontier.arm_label({"arm": "static:count=5:at_step=450", "config": {"horizon": None}}) == \
        "static:count=5:at_step=450"
