"""Two checks of Egeria's rule must never cancel each other: a continuous decay is no new
regime of the learning rate (restarting the watches there kept W readings from ever
holding), and the cost budget never lengthens n so far that the stretch where a module may
freeze holds fewer readings than its watch needs; the closing warning names the condition
that actually blocked."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch.optim import lr_scheduler as lrs

import egeria
from egeria.config import SPEEDS
from egeria.knowledge.plasticity import REGIME_CHANGE
from egeria.knowledge.rule import FrontRule, RuleSettings
from egeria.lr_schedule import read_schedule
from tiny import Chain, batches, quick_config, train


def _warmup_cosine(opt: torch.optim.Optimizer, steps: int, warm: int) -> lrs.LRScheduler:
    return lrs.SequentialLR(
        opt, [lrs.LinearLR(opt, start_factor=0.1, total_iters=warm), lrs.CosineAnnealingLR(opt, T_max=steps - warm)],
        milestones=[warm],
    )


def _schedule(make, steps: int):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return read_schedule(make(opt), opt, steps)


def test_a_step_schedule_jumps_at_its_drops_and_a_continuous_decay_only_in_its_last_steps():
    steps = 800
    step = _schedule(lambda opt: lrs.MultiStepLR(opt, milestones=[400, 600], gamma=0.1), steps)
    assert [step.last_jump(s, REGIME_CHANGE) for s in (0, 399, 400, 599, 600, 799)] == [-1, -1, 400, 400, 600, 600]
    assert step.jumps(REGIME_CHANGE) == [400, 600] and step.jumps(20.0) == []  # each factor its own
    cosine = _schedule(lambda opt: _warmup_cosine(opt, 700, 50), 700)
    lrs_ = cosine.lrs
    assert lrs_[650] / lrs_[690] > REGIME_CHANGE  # halved, and more, between two readings n=20 apart
    assert cosine.last_jump(699, REGIME_CHANGE) == -1  # but no step jumps, not even in its last ones
    tiny_start = _schedule(lambda opt: lrs.LinearLR(opt, start_factor=1e-3, total_iters=100), 200)
    assert tiny_start.last_jump(199, REGIME_CHANGE) == 1  # a warm-up from 1/1000 doubles at its first step only


def test_a_continuous_decay_that_halves_the_rate_between_readings_keeps_the_watch_going():
    """Readings at a rate that halves each time, as at the end of a cosine: with the
    schedule's regime known (no jump) the watch goes on and settles; without a schedule a 2x
    change stands for a jump and restarts it, as before."""
    settings = RuleSettings(window=3, tolerance_ratio=0.2, horizon=None, regimes=True)
    known, unknown = FrontRule(settings), FrontRule(settings)
    for i in range(10):
        lr = 0.1 / 2 ** i
        level = 2.0 - 0.5 ** i  # rises, then settles
        known.read(0, level, lr, regime=-1)
        unknown.read(0, level, lr)
    assert known.watches[0].stale >= 3 and known.settled(0)
    assert unknown.watches[0].stale == 0 and not unknown.settled(0)
    # a jump of the schedule is a new regime, whatever the ratio between the two readings
    known.read(0, 1.0, 0.1 / 2 ** 10, regime=700)
    assert known.watches[0].stale == 0 and known.watches[0].straddling is False and not known.settled(0)


def _cosine_run(caplog, speed, steps: int = 700) -> egeria.Egeria:
    warm = 50
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = _warmup_cosine(opt, steps, warm)
    config = quick_config(rule="egeria", horizon=0.0005, floor_ratio=0, eval_interval=20, speed=speed)
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=steps)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, (batches(7, seed=3) * (steps // 7 + 1))[:steps], scheduler=sched)
        eg.close()
    return eg


@pytest.mark.parametrize("speed", ["safe", "fast"])
def test_a_warmup_cosine_run_restarts_no_watch_after_its_warmup_and_freezes(caplog, speed, no_idle):
    """About 700 steps of warm-up and cosine, n=20: the rate halves between the last
    readings, which once restarted every watch so that nothing froze; now the modules'
    watches go on and they freeze once the rate is at the speed's bound."""
    eg = _cosine_run(caplog, speed)
    after = [r for r in eg.history if r["step"] > 60]
    assert after and all(r["counted"] for r in after)  # no reading straddles a "new regime"
    freezes = [e for e in eg.events if e.action == "freeze"]
    assert freezes and all("of its peak" in e.reason for e in freezes)
    bound = SPEEDS[speed]
    for e in freezes:
        row = next(r for r in eg.history if r["step"] == e.evaluated_at and r["module"] == e.modules[0])
        assert row["lr_share"] <= bound * (1 + 1e-6)
    assert not [r for r in caplog.records if "with nothing frozen" in r.getMessage()]


def test_a_warmup_cosine_run_too_short_for_the_safe_bound_blames_the_bound(caplog, no_idle):
    """At 1/100 of the peak a 319-step run (a 269-step cosine) has its last 17 steps, and
    no reading of n=20 comes there (at 300 the rate is above it, 320 is past the end):
    nothing still learning freezes, and the warning says so, not that the schedule is
    unknown."""
    eg = _cosine_run(caplog, "safe", steps=319)
    said = [r.getMessage() for r in caplog.records if "with nothing frozen" in r.getMessage()]
    assert not [e for e in eg.events if e.action == "freeze"] and len(said) == 1, said
    assert "unknown schedule" not in said[0] and "that speed='safe' allows" in said[0]
    assert re.search(r"only the run's last 1\d steps are at or under it, fewer than the n=20", said[0]), said[0]


@pytest.mark.parametrize("speed, bound", [("safe", 0.01), ("balanced", 0.03), ("fast", 0.1), (0.05, 0.05), (1, 1.0)])
def test_the_speed_knob_sets_the_rules_learning_rate_bound(speed, bound):
    assert SPEEDS["safe"] == 0.01
    assert egeria.KnowledgeGuided(egeria.EgeriaConfig(speed=speed)).rule_settings.low_lr == bound
    assert egeria.KnowledgeGuided(egeria.EgeriaConfig(speed=speed, rule="paper")).rule_settings.low_lr is None
