"""EgeriaConfig's refusals say what is wrong with the value: each names the field, the value
and the actual problem (over a cap, not a number, not a name), never a rule the value keeps."""

from __future__ import annotations

import math
import re

import pytest

import egeria
from egeria.policies import NoFreezing

CASES = [
    # shares: a value over 1 is refused for being over 1, not for being "> 0"
    ({"cost_budget": 1.5}, "EgeriaConfig.cost_budget=1.5 must be at most 1 (a share of training time"),
    ({"max_frozen_flops": 2}, "EgeriaConfig.max_frozen_flops=2 must be at most 1 (a share of the model's weight computation"),
    ({"horizon": 1.5}, "EgeriaConfig.horizon=1.5 must be at most 1 (a share of a module's largest drift still to come"),
    ({"horizon": 0}, "EgeriaConfig.horizon=0 must be > 0"),
    ({"cpu_threshold": 2}, "EgeriaConfig.cpu_threshold=2 must be at most 1 (a share of the machine's CPU time"),
    # positive numbers: zero, negative, not finite, not a number
    ({"cost_budget": 0}, "EgeriaConfig.cost_budget=0 must be > 0"),
    ({"cost_budget": math.nan}, "EgeriaConfig.cost_budget=nan must be finite (a number > 0)"),
    ({"cost_budget": "0.01"}, "EgeriaConfig.cost_budget='0.01' must be a number > 0, not str"),
    ({"cpu_threshold": True}, "EgeriaConfig.cpu_threshold=True must be a number > 0, not bool"),
    ({"cpu_threshold": math.inf}, "EgeriaConfig.cpu_threshold=inf must be finite (a number > 0)"),
    # ratios where 0 means off
    ({"floor_ratio": -1.0}, "EgeriaConfig.floor_ratio=-1.0 must be >= 0"),
    ({"floor_ratio": math.inf}, "EgeriaConfig.floor_ratio=inf must be finite (a number >= 0; 0: off)"),
    ({"floor_ratio": "8"}, "EgeriaConfig.floor_ratio='8' must be a number >= 0; 0: off, not str"),
    # names
    ({"policy": ["x"]}, "EgeriaConfig.policy=['x'] must be a policy name, one of ['egeria', "),
    ({"policy": "freezeotu"}, "EgeriaConfig.policy='freezeotu' is not one of ['egeria', "),
    ({"policy_options": [("t0", 0.5)]}, "EgeriaConfig.policy_options=[('t0', 0.5)] must be a mapping of option names to values (a dict), not list"),
    ({"executor": "gpu", "reference_device": "model"}, "EgeriaConfig.executor='gpu' is not one of 'auto', "),
    ({"rule": ["egeria"]}, "EgeriaConfig.rule=['egeria'] is not one of 'paper', 'egeria'"),
    ({"speed": "fastest"}, "EgeriaConfig.speed='fastest' is not one of 'safe', 'balanced', 'fast'"),
    ({"speed": 0}, "EgeriaConfig.speed=0 must be in (0, 1] (a share of the run's peak learning rate)"),
    ({"speed": 1.5}, "EgeriaConfig.speed=1.5 must be in (0, 1]"),
    ({"speed": None}, "EgeriaConfig.speed=None must be one of 'safe', 'balanced', 'fast' or a number in (0, 1], not NoneType"),
    ({"speed": math.nan}, "EgeriaConfig.speed=nan must be one of 'safe', 'balanced', 'fast' or a number in (0, 1] (finite)"),
    # lists
    ({"controller_cpus": [-1]}, "EgeriaConfig.controller_cpus=[-1] holds -1, which is not a core number (an integer >= 0)"),
    ({"controller_cpus": [0, True]}, "EgeriaConfig.controller_cpus=[0, True] holds True, which is not a core number"),
    ({"controller_cpus": []}, "EgeriaConfig.controller_cpus=[] is empty; name at least one core"),
    ({"controller_cpus": "0,1"}, "EgeriaConfig.controller_cpus='0,1' must be None or a list of core numbers, not str"),
    ({"modules": ["stem", 1]}, "EgeriaConfig.modules=['stem', 1] holds 1, which is not a module name"),
    # integers
    ({"window": 2.5}, "EgeriaConfig.window=2.5 must be a positive integer"),
    ({"max_modules": 1}, "EgeriaConfig.max_modules=1: at least 2 modules are needed"),
]


@pytest.mark.parametrize("changes,message", CASES, ids=[",".join(c) + f"={list(c.values())[0]!r}" for c, _ in CASES])
def test_a_refusal_names_the_field_the_value_and_what_is_wrong(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        egeria.EgeriaConfig(**changes)


def test_a_freeze_policy_object_in_the_config_is_pointed_to_egeria():
    with pytest.raises(ValueError, match=re.escape("a FreezePolicy object goes to Egeria(policy=...)")):
        egeria.EgeriaConfig(policy=NoFreezing())


@pytest.mark.parametrize(
    "changes",
    [
        {"cost_budget": 1},
        {"max_frozen_flops": 1.0},
        {"horizon": 1.0},
        {"cpu_threshold": 1},
        {"floor_ratio": 0},
        {"speed": 1.0},
        {"speed": "fast"},
        {"controller_cpus": (0,)},
        {"policy": "freezeout", "policy_options": {"t0": 0.5}},
    ],
)
def test_values_at_the_edges_are_accepted(changes):
    egeria.EgeriaConfig(**changes)


@pytest.mark.parametrize("name", ["tolerance_ratio", "unfreeze_lr_drop", "max_frozen", "fixed_probe", "controller_timeout"])
def test_a_removed_field_says_what_took_its_place(name):
    with pytest.raises(ValueError, match=rf"EgeriaConfig has no field '{name}' \(removed: "):
        egeria.EgeriaConfig().replace(**{name: 1})
