"""A freeze that is a trade goes alone (docs/decisions/035-one-trade-at-a-time.md): above
``free_lr`` of the peak a settled module freezes without the modules behind it, and they
need W stale readings taken after it; at or below it, and for quiet or idle modules, the
settled front freezes together as before."""

from __future__ import annotations

import pytest

from egeria import EgeriaConfig
from egeria.config import SPEEDS
from egeria.knowledge.policy import rule_settings
from egeria.knowledge.rule import IDLE_SHARE, FrontRule, RuleSettings

WINDOW = 2


def _rule(free_lr: float | None = SPEEDS["safe"], **kw) -> FrontRule:
    """Egeria's rule with no learning-rate bound (speed=1), so that only ``free_lr`` and the
    knowledge decide."""
    return FrontRule(RuleSettings(window=WINDOW, tolerance_ratio=0.2, horizon=0.1, regimes=True,
                                  low_lr=1.0, free_lr=free_lr, **kw))


def _evaluate(rule: FrontRule, values: dict[int, float], lr: float, ahead: float = 0.05) -> None:
    """One evaluation: each module of ``values`` read at ``lr`` of a peak of 1 over an
    interval of mass 0.01, with ``ahead`` still to come, then compared."""
    for index, value in values.items():
        rule.read(index, value, lr, mass=0.01, ahead=ahead, peak=1.0)
    rule.compare(list(values))


def _settle(rule: FrontRule, modules: list[int], lr: float) -> None:
    """Flat readings of ``modules`` whose drift still to come falls to 1/18 of its largest:
    each is settled by the slope test and the outlook."""
    _evaluate(rule, {i: 1.0 for i in modules}, lr, ahead=0.9)
    for _ in range(5):
        _evaluate(rule, {i: 1.0 for i in modules}, lr)
    assert all(rule.settled(i) for i in modules)


def test_above_the_free_share_the_settled_front_freezes_one_module_and_the_next_settles_after_it():
    rule = _rule()
    _settle(rule, [0, 1, 2], lr=0.3)
    assert rule.costly(0) and rule.settled_front([0, 1, 2]) == 1
    rule.froze([0])
    assert set(rule.watches) == {1, 2}
    assert [rule.watches[i].stale for i in (1, 2)] == [0, 0]  # readings before the freeze no longer count
    assert not rule.settled(1) and rule.settled_front([1, 2]) == 0
    _evaluate(rule, {1: 1.0, 2: 1.0}, lr=0.3)
    assert rule.settled_front([1, 2]) == 0  # one of the W readings after the freeze
    _evaluate(rule, {1: 1.0, 2: 1.0}, lr=0.3)
    assert rule.settled(1) and rule.settled(2) and rule.settled_front([1, 2]) == 1


def test_at_the_free_share_or_without_one_the_settled_front_freezes_together():
    at_free = _rule()
    _settle(at_free, [0, 1, 2], lr=SPEEDS["safe"])
    assert not at_free.costly(0) and at_free.settled_front([0, 1, 2]) == 3
    at_free.froze([0, 1])
    assert at_free.watches[2].stale >= WINDOW  # a free freeze restarts nothing
    paper = _rule(free_lr=None)
    _settle(paper, [0, 1, 2], lr=0.3)
    assert not paper.costly(0) and paper.settled_front([0, 1, 2]) == 3


def test_a_costly_freeze_keeps_the_idle_count_of_the_module_behind_it():
    """An idle module's freeze is free: it goes with the front before it, and a costly
    freeze before it leaves its idle count (not its stale count) as it was."""
    rule = _rule(idle_share=IDLE_SHARE)
    _settle(rule, [0, 1], lr=0.3)
    for _ in range(WINDOW + 1):  # the first of them still averages in a reading of 1
        _evaluate(rule, {0: 1.0, 1: 1e-3, 2: 1.0}, lr=0.3)
    assert rule.idle(1) and not rule.costly(1) and rule.costly(0)
    assert rule.settled_front([0, 1, 2]) == 1  # module 0 is a trade: it goes alone
    rule.froze([0])
    assert rule.watches[1].stale == 0 and rule.idle(1) and rule.settled_front([1, 2]) == 1


def test_a_free_module_before_a_costly_one_freezes_with_it():
    rule = _rule(idle_share=IDLE_SHARE)
    for _ in range(WINDOW):
        _evaluate(rule, {0: 1e-3, 1: 1.0}, lr=0.3)
    _settle(rule, [1], lr=0.3)
    for _ in range(WINDOW):
        _evaluate(rule, {0: 1e-3, 1: 1.0, 2: 1.0}, lr=0.3)
    assert rule.idle(0) and rule.costly(1) and rule.settled_front([0, 1, 2]) == 2


def test_an_unknown_learning_rate_counts_as_a_trade():
    rule = _rule()
    for _ in range(6):
        for index in (0, 1):
            rule.read(index, 1.0)  # no schedule known: no learning rate, no outlook
    assert rule.lr_share is None and rule.costly(0)


@pytest.mark.parametrize("rule, expected", [("egeria", SPEEDS["safe"]), ("paper", None)])
def test_the_free_share_is_the_bound_measured_free_under_egerias_rule_only(rule, expected):
    assert rule_settings(EgeriaConfig(rule=rule)).free_lr == expected
    assert rule_settings(EgeriaConfig(rule=rule, speed="fast")).free_lr == expected
