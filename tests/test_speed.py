"""EgeriaConfig.speed moves both conditions of Egeria's rule: the learning-rate bound and,
unless ``horizon`` is given, the drift still to come a module may freeze at."""

import math

import pytest

from egeria import EgeriaConfig
from egeria.config import RULE_DEFAULTS, SPEEDS, lr_bound, speed_horizon
from egeria.knowledge.policy import rule_settings

SAFE_HORIZON = RULE_DEFAULTS["egeria"]["horizon"]


def test_the_default_speed_keeps_the_rules_horizon():
    assert EgeriaConfig().horizon == SAFE_HORIZON
    assert EgeriaConfig(speed="safe").horizon == SAFE_HORIZON


def test_the_horizon_grows_as_a_cosines_mass_ahead_at_the_bound():
    # near a cosine's end the mass still ahead goes as the rate's share to the power 1.5
    assert math.isclose(EgeriaConfig(speed="fast").horizon, SAFE_HORIZON * 10**1.5)
    assert math.isclose(EgeriaConfig(speed="balanced").horizon, SAFE_HORIZON * 3**1.5)
    shares = [0.005, SPEEDS["safe"], SPEEDS["balanced"], SPEEDS["fast"], 0.5, 1.0]
    horizons = [EgeriaConfig(speed=s).horizon for s in shares]
    assert horizons == sorted(horizons) and len(set(horizons)) == len(horizons)
    assert all(0 < h <= 1 for h in horizons)


def test_a_horizon_given_is_kept_at_every_speed():
    for speed in ("safe", "fast", 0.5):
        assert EgeriaConfig(speed=speed, horizon=0.05).horizon == 0.05


def test_replace_rederives_the_horizon_it_took_and_keeps_one_given():
    assert EgeriaConfig().replace(speed="fast").horizon == EgeriaConfig(speed="fast").horizon
    assert EgeriaConfig(speed="fast").replace(speed="safe").horizon == SAFE_HORIZON
    assert EgeriaConfig(horizon=0.01).replace(speed="fast").horizon == 0.01


def test_the_papers_rule_has_no_horizon_at_any_speed():
    assert EgeriaConfig(rule="paper", speed="fast").horizon is None


def test_the_rule_reads_both_conditions_from_the_config():
    settings = rule_settings(EgeriaConfig(speed="fast"))
    assert settings.low_lr == lr_bound("fast") == 0.1
    assert settings.horizon == speed_horizon(SAFE_HORIZON, "fast")


def test_a_bad_speed_is_refused_before_the_horizon_is_derived():
    with pytest.raises(ValueError, match=r"EgeriaConfig.speed='turbo'"):
        EgeriaConfig(speed="turbo")
