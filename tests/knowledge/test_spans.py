"""The rule's timing is in optimizer steps (docs/decisions/038-steps-not-readings.md): how
densely readings are taken (the cost budget, an explicit n, the machine's pace) and which
executor answers them change a decision's step by at most one reading interval, never
which modules freeze."""

from __future__ import annotations

import math

import pytest
import torch

import egeria
from egeria.knowledge.budget import CostBudget
from egeria.knowledge.rule import FrontRule, RuleSettings
from egeria.knowledge.spans import Spans
from tiny import Chain, batches, quick_config, train


def test_the_spans_are_steps_and_an_interval_changes_only_how_densely_they_are_read():
    spans = Spans(lag=20, window=3)
    assert (spans.span, spans.longest_interval) == (60, 40)
    assert spans.clamp(5) == 20 and spans.clamp(29) == 29 and spans.clamp(400) == 40
    assert Spans.for_interval(20, 3, None) == spans
    assert Spans.for_interval(20, 3, 40) == spans  # two readings a span: the spans stand
    assert Spans.for_interval(20, 3, 10) == Spans(10, 3)  # one reference: a reading covers n
    assert Spans.for_interval(20, 3, 100) == Spans(50, 3)  # a span must hold two readings


class FixedCost(CostBudget):
    """A reading that costs ``cost`` seconds against 100 ms a step, measured from the start."""

    measured = True

    def __init__(self, budget: float, cost: float) -> None:
        super().__init__(budget)
        self.cost = cost

    def figures(self):
        return self.cost, 0.100


def _run_at_cost(monkeypatch, cost: float, steps: int = 240):
    monkeypatch.setattr(egeria.knowledge.policy, "MIN_EVAL_INTERVAL", 4)  # D = 4: spans of 12 steps
    config = quick_config(rule="egeria", eval_interval=None, cost_budget=0.01, window=3, horizon=1.0, floor_ratio=0.0)
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = egeria.KnowledgeGuided(config)
    policy.budget = FixedCost(0.01, cost)
    with egeria.Egeria(model, opt, config=config, policy=policy) as eg:
        decisions = train(model, opt, eg, batches(1) * steps)
        return [d for d in decisions if d.action == "freeze"], eg.eval_interval


def test_a_reading_four_times_cheaper_or_dearer_freezes_the_same_modules_within_one_interval(monkeypatch):
    """The cost budget (1%) asks n = 2, 8 and 32 for a reading of 2, 8 and 32 ms against a
    100 ms step: the readings come every 4, 8 and 8 steps (D = 4, at most (W - 1) x D = 8),
    once the first readings, one every D steps, have set the tolerances; the same modules
    freeze at the same steps, within the coarsest interval (8 steps): the spans the
    rule counts are steps, and a reading four times cheaper or dearer only reads them more
    or less densely (docs/decisions/038-steps-not-readings.md)."""
    runs = {cost: _run_at_cost(monkeypatch, cost) for cost in (0.002, 0.008, 0.032)}
    assert [n for _, n in runs.values()] == [4, 8, 8]
    frozen_at = [{name: d.step for d in freezes for name in d.modules} for freezes, _ in runs.values()]
    assert len(frozen_at[0]) >= 2, "the test needs freezes"
    for other in frozen_at[1:]:
        assert other.keys() == frozen_at[0].keys()
        assert all(abs(other[name] - step) <= 8 for name, step in frozen_at[0].items()), (frozen_at[0], other)


# -- one drift, sampled at different intervals ----------------------------------------------

TOTAL, LAG = 1200, 20
DROPS = (600, 900)


def _lr(step: int) -> float:
    return 0.1 * 0.1 ** sum(step >= d for d in DROPS)


def _mass(start: int, end: int) -> float:
    """The learning-rate mass of steps start+1 .. end."""
    return math.fsum(_lr(s) for s in range(start + 1, end + 1))


def _regime(step: int) -> int:
    return max([d for d in DROPS if d <= step], default=-1)


def _first_freezes(interval: int, paces) -> dict[int, int]:
    """The step each module first settles at, read every ``interval`` steps: a reading at t
    is the drift of (t - D, t], its pace (per unit of learning-rate mass) at t times the mass
    of those steps."""
    rule = FrontRule(RuleSettings(window=3, tolerance_ratio=0.2, horizon=0.0005, regimes=True, low_lr=0.01,
                                  idle_share=0.01, lag=LAG))
    settled: dict[int, int] = {}
    for step in range(LAG, TOTAL + 1, interval):
        mass = _mass(step - LAG, step)
        for index, pace in enumerate(paces):
            rule.read(index, pace(step) * mass, _lr(step), mass=mass, ahead=_mass(step, TOTAL), peak=0.1,
                      regime=_regime(step), step=step, straddles=_regime(step) != _regime(step - LAG))
        rule.compare(range(len(paces)))
        for index in range(len(paces)):
            if index not in settled and rule.settled_front(list(range(len(paces)))) > index:
                settled[index] = step
    return settled


SETTLING = [lambda t: 1 + 4 * math.exp(-t / 150), lambda t: 2 + 6 * math.exp(-t / 300)]
IDLE_FRONT = [lambda t: 1e-4 * (1 + math.sin(t / 37) ** 2), lambda t: 1 + 4 * math.exp(-t / 150)]


@pytest.mark.parametrize("paces, expected", [(SETTLING, {0: range(900, TOTAL + 1), 1: range(900, TOTAL + 1)}),
                                             (IDLE_FRONT, {0: range(0, 200)})], ids=["after-the-drops", "idle-front"])
def test_one_drift_read_every_10_20_or_40_steps_freezes_within_40_steps(paces, expected):
    """The same drift, read every 10, 20 and 40 steps with each reading covering D = 20: each
    module settles within 40 steps, the coarsest interval, at every density: after the second
    tenfold drop where the learning-rate bound decides, early where the front is idle."""
    first = {n: _first_freezes(n, paces) for n in (10, 20, 40)}
    for index, window in expected.items():
        steps = [first[n].get(index) for n in (10, 20, 40)]
        assert all(s is not None and s in window for s in steps), (index, steps)
        assert max(steps) - min(steps) <= 40, (index, steps)


@pytest.mark.slow
def test_an_inline_and_a_thread_controller_freeze_at_the_same_steps():
    """A decision applies D steps after its reading whichever executor answers it: a
    controller in a thread freezes what an inline one freezes, at the same steps (within one
    interval, for another float kernel's rounding)."""
    config = quick_config(eval_interval=4, cpu_threshold=None)
    freezes = {}
    for executor in ("inline", "thread"):
        torch.manual_seed(0)
        model = Chain()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with egeria.Egeria(model, opt, config=config.replace(executor=executor)) as eg:
            decisions = train(model, opt, eg, batches(1) * 160)
            assert eg.controller_stats["executor"] == executor
        freezes[executor] = [d for d in decisions if d.action == "freeze"]
    inline, thread = freezes["inline"], freezes["thread"]
    assert inline, "the test needs freezes"
    assert [d.modules for d in inline] == [d.modules for d in thread]
    assert all(abs(a.step - b.step) <= 4 for a, b in zip(inline, thread))
    assert all(d.step - d.evaluated_at == 4 for d in inline + thread)
