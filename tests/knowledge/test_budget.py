"""The cost budget: Egeria's time on the training thread against training time, on a
fake clock; a derived n is spaced out to meet it within the rule's spans, an explicit one
is kept and reported."""

from __future__ import annotations

import logging

import pytest
import torch

import egeria
from egeria.knowledge.budget import CostBudget
from tiny import Chain, batches, quick_config, train


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_measures_readings_against_plain_steps():
    clock = FakeClock()
    budget = CostBudget(0.01, clock)
    budget.step_done(evaluated=False)  # starts the clock
    for step in range(12):
        evaluated = step % 4 == 3
        clock.now += 0.100  # training
        if evaluated:
            with budget.spending():
                clock.now += 0.030  # a reading on the training thread
        budget.step_done(evaluated)
    assert budget.measured
    assert budget.figures() == pytest.approx((0.030, 0.100))
    assert budget.share(20) == pytest.approx(0.015)  # 30 ms per 20 x 100 ms
    assert budget.interval() == 30  # 30 ms / (1% x 100 ms)
    # over the run: 3 readings of 30 ms in 12 steps of 100 ms training
    assert budget.summary() == pytest.approx({"egeria_s": 0.090, "run_s": 1.290, "share": 0.090 / 1.290})


class Measured(CostBudget):
    """A budget that has measured 30 ms per reading and 100 ms per step from the start."""

    measured = True

    def figures(self):
        return 0.030, 0.100


def _policy(config):
    policy = egeria.KnowledgeGuided(config)
    policy.budget = Measured(config.cost_budget)
    return policy


@pytest.mark.parametrize("lag, budget, interval", [(20, 0.01, 30), (2, 0.01, 4), (2, None, 2)])
def test_a_derived_interval_is_spaced_out_once_to_meet_the_budget_within_the_spans(lag, budget, interval, monkeypatch,
                                                                                   caplog):
    """30 ms per reading, 100 ms per step: n >= 30 for 1%. With D = 20 and W = 3 a span of 60
    steps holds two readings 30 apart: n = 30. With D = 2 the span is 6 steps: n stops at 4,
    (W - 1) x D, and the log says what the readings then take; the spans never grow."""
    monkeypatch.setattr(egeria.knowledge.policy, "MIN_EVAL_INTERVAL", lag)
    config = quick_config(eval_interval=None, cost_budget=budget)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    eg = egeria.Egeria(model, opt, config=config, total_steps=5 * lag + 30, policy=_policy(config))
    with caplog.at_level(logging.INFO, logger="egeria"):
        train(model, opt, eg, batches(1) * (5 * lag + 30))
    assert eg.eval_interval == interval
    assert eg.policy.spans.lag == lag and eg.policy.spans.span == 3 * lag
    capped = [r.getMessage() for r in caplog.records if "must hold two readings" in r.getMessage()]
    assert len(capped) == (lag == 2 and budget is not None)
    if capped:
        assert "n is now 4, not 30" in capped[0] and "7.5%" in capped[0]
    eg.close()


def test_an_explicit_interval_is_kept_and_the_broken_budget_reported_once(caplog):
    config = quick_config(eval_interval=2, cost_budget=0.01)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    eg = egeria.Egeria(model, opt, config=config, policy=_policy(config))
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 40)
    assert eg.eval_interval == 2
    warnings = [r.getMessage() for r in caplog.records if "cost budget" in r.getMessage()]
    assert len(warnings) == 1 and "30.0 ms" in warnings[0] and "n=30" in warnings[0]
    eg.close()
