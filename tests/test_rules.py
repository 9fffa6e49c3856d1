"""Egeria's two freezing rules: the paper's one module at a time, and the default that
reads several front modules from one forward pass; fixed and cut-down probe batches."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import egeria
from egeria.decays import decays_ahead
from egeria.executors import InlineExecutor
from egeria.protocol import Readout, Request
from egeria.reference import ReferenceModel
from egeria.rule import FrontRule
from egeria.service import ControllerSpec
from egeria.weights import float_snapshot
from fakes import Recorder
from tiny import Chain, batches, quick_config, train


def _controller(span: int, fixed_probe: bool = False, window: int = 3, precision: str = "fp32",
                floor_ratio: float | None = None, ceiling_ratio: float | None = None):
    torch.manual_seed(0)
    model = Chain(depth=4).eval()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    spec = ControllerSpec(
        partition, float_snapshot(model), precision, window, 0.2, 1, 1, None, span, fixed_probe,
        floor_ratio=floor_ratio, ceiling_ratio=ceiling_ratio,
    )
    return model, partition, InlineExecutor(spec)


def _evaluate(executor, model, seq: int, batch: torch.Tensor):
    """One evaluation of module 0 at step ``seq`` on ``batch`` with the model's weights."""
    executor.offer(Request(seq, 0, seq, 0, ((batch,), {})))
    executor.readout(Readout(seq, None, dict(model.state_dict())))
    [result] = executor.poll()
    return result


@pytest.mark.parametrize("span", [1, 2, None])
def test_modules_whose_plasticity_is_flat_freeze_together_when_watched_together(span):
    model, partition, executor = _controller(span=span or 99)
    x = torch.randn(16, 8)
    results = [_evaluate(executor, model, seq, x) for seq in range(1, 8)]
    # Constant weights and batch: every reading of every watched module is the same, every
    # slope is 0, so each watched module is stale from its 3rd slope (4th reading) and
    # reaches W = 3 stale readings at the 6th reading (the 1st evaluation builds the reference).
    assert [r.note for r in results[:1]] == ["building"]
    assert all(r.decision is None for r in results[1:6])
    watched = min(span or 99, partition.freezable)
    assert [len(r.readings) for r in results[1:6]] == [watched] * 5
    assert results[6].decision is not None
    assert results[6].decision.modules == tuple(partition.names[:watched])


def test_a_fixed_probe_reads_the_first_batch_every_time():
    readings = {}
    for fixed in (False, True):
        # bf16: a reference error that depends on the batch (fp32 would read 0 on any batch)
        model, _, executor = _controller(span=1, fixed_probe=fixed, precision="bf16")
        g = torch.Generator().manual_seed(3)
        results = [_evaluate(executor, model, seq, torch.randn(16, 8, generator=g)) for seq in range(1, 5)]
        readings[fixed] = [r.readings[0]["plasticity"] for r in results[1:]]
    assert len(set(readings[True])) == 1  # same weights, same probe: the same reading
    assert len(set(readings[False])) == 3  # a new batch each time


def test_the_default_rule_reads_modules_before_their_predecessor_freezes():
    first_reading, first_freeze = {}, {}
    for rule in ("paper", "egeria"):
        torch.manual_seed(0)
        model = Chain()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        eg = egeria.Egeria(model, opt, config=quick_config(rule=rule))
        decisions = train(model, opt, eg, batches(1) * 120)
        freezes = [d for d in decisions if d.action == "freeze"]
        assert freezes, (rule, eg.history[-3:])
        second = eg.modules[1]
        first_freeze[rule] = freezes[0].evaluated_at
        first_reading[rule] = min(r["step"] for r in eg.history if r["module"] == second)
        eg.close()
    assert first_reading["paper"] > first_freeze["paper"]  # its history starts after the freeze
    assert first_reading["egeria"] < first_freeze["egeria"]  # read from the first evaluation on


def test_readings_run_on_a_cut_down_probe_of_the_batch():
    made = []

    def recorder(spec):
        made.append(Recorder(spec))
        return made[-1]

    config = quick_config(probe_size=5)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    eg = egeria.Egeria(model, opt, config=config, policy=egeria.KnowledgeGuided(config, executor=recorder))
    train(model, opt, eg, batches(6, batch=16))
    eg.close()
    requests = [m for kind, m in made[0].messages if kind == "request"]
    assert requests and all(r.batch[0][0].shape == (5, 8) for r in requests)


def test_bad_rule_options_are_named():
    with pytest.raises(ValueError, match="rule='fast'"):
        egeria.EgeriaConfig(rule="fast")
    with pytest.raises(ValueError, match="watch_span=0"):
        egeria.EgeriaConfig(rule="egeria", watch_span=0)
    with pytest.raises(ValueError, match="watch_span=2 applies to rule='egeria'"):
        egeria.EgeriaConfig(rule="paper", watch_span=2)
    with pytest.raises(ValueError, match="probe_size=-1"):
        egeria.EgeriaConfig(probe_size=-1)
    with pytest.raises(ValueError, match="activation_mode='eval'"):
        egeria.EgeriaConfig(fixed_probe=True, activation_mode="train")
    with pytest.raises(ValueError, match="probe_size.*activation_mode='eval'"):
        egeria.EgeriaConfig(probe_size=8, activation_mode="train")


@pytest.mark.parametrize("span", [None, 2])
def test_after_every_freeze_the_next_module_is_read_again(span):
    # The worker and the controller must agree on the frozen count after a decision that
    # freezes several modules at once, or every later request is stale and reading stops;
    # the controller must have the weights of the modules it watches next.
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    eg = egeria.Egeria(model, opt, config=quick_config(rule="egeria", watch_span=span))
    decisions = train(model, opt, eg, batches(1) * 60)
    freezes = [d for d in decisions if d.action == "freeze"]
    assert freezes
    frozen = 0
    for d in freezes:
        frozen += len(d.modules)
        if frozen < eg.partition.freezable:
            front = eg.modules[frozen]
            assert any(r["module"] == front and r["step"] > d.step for r in eg.history), (d, front)
    assert len(eg.frozen) == frozen
    assert eg.controller_stats["failure"] is None
    eg.close()


@pytest.mark.parametrize("ratio, freezes", [(None, True), (1.0, True), (0.5, False)])
def test_settle_ratio_holds_a_flat_module_whose_level_is_still_at_its_peak(ratio, freezes):
    model, partition, executor = _controller(span=1, precision="bf16")  # bf16: readings above 0
    executor.service.controller.rule.settle_ratio = ratio
    x = torch.randn(16, 8)
    results = [_evaluate(executor, model, seq, x) for seq in range(1, 9)]
    # Constant readings (same weights, same batch): flat from the start, always at their peak.
    assert results[1].readings[0]["plasticity"] > 0
    assert any(r.decision is not None for r in results) is freezes
    assert all(row["peak"] == row["smoothed"] for r in results for row in r.readings)


def test_a_module_that_does_not_move_reads_its_floor_and_freezes_though_it_never_fell_from_its_peak():
    model, partition, executor = _controller(span=1, precision="bf16", floor_ratio=2.0)
    executor.service.controller.rule.settle_ratio = 0.5  # holds a module at its peak (test above)
    x = torch.randn(16, 8)
    results = [_evaluate(executor, model, seq, x) for seq in range(1, 7)]
    # Same weights, same batch: each reading compares the reference with the weights it was
    # refreshed from, i.e. it reads the floor itself. The floor is first measured at the
    # refresh after the 2nd evaluation (the 1st builds); the 3rd, 4th and 5th are quiet.
    rows = [row for r in results[1:5] for row in r.readings]
    assert rows[0]["floor"] is None and all(row["plasticity"] > 0 for row in rows)
    assert all(row["floor"] == pytest.approx(row["plasticity"], rel=1e-9) for row in rows[1:])
    assert [row["quiet"] for row in rows] == [0, 1, 2, 3]
    assert all(r.decision is None for r in results[:4])
    decision = results[4].decision
    assert decision is not None and decision.modules == (partition.names[0],)
    assert "the reference's own error" in decision.reason


def _evaluate_moving(executor, model, evaluations: int) -> list:
    """Evaluations 1 to ``evaluations`` on one batch, the weights moved by noise before each."""
    x = torch.randn(16, 8)
    results = []
    for seq in range(1, evaluations + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        results.append(_evaluate(executor, model, seq, x))
    return results


def test_a_module_that_moves_reads_far_above_its_floor_and_is_never_quiet():
    model, partition, executor = _controller(span=2, precision="bf16", floor_ratio=2.0)
    executor.service.controller.rule.settle_ratio = 0.5
    results = _evaluate_moving(executor, model, evaluations=8)
    rows = [row for r in results[2:] for row in r.readings]
    assert all(row["plasticity"] > 100 * row["floor"] for row in rows)
    assert all(row["quiet"] == 0 for row in rows) and all(r.decision is None for r in results)
    state = executor.service.controller.state_dict(dict(model.state_dict()))
    assert set(state["floors"]) == {"0", "1"}


def test_a_checkpoint_with_a_reference_of_another_precision_restarts_the_watches_and_keeps_the_peaks(caplog):
    model, partition, executor = _controller(span=2, precision="bf16", floor_ratio=2.0)
    _evaluate_moving(executor, model, evaluations=5)
    saved = json.loads(json.dumps(executor.service.controller.state_dict(dict(model.state_dict()))))
    assert saved["watches"] and saved["floors"] and saved["reference"] is not None
    _, _, other = _controller(span=2, precision="fp32", floor_ratio=2.0)  # e.g. an int8 default before
    controller = other.service.controller
    with caplog.at_level("WARNING"):
        controller.load_state_dict(saved, dict(model.state_dict()))
    assert "readings start afresh" in caplog.text
    assert controller.reference is None and controller.rule.watches == {} and controller.floors == {}
    assert controller.rule.peaks == {int(i): v for i, v in saved["peaks"].items()} != {}


@pytest.mark.parametrize("floor_ratio, ceiling_ratio", [(2.0, None), (None, 10.0)])
def test_a_module_far_above_its_floor_is_held_by_the_ceiling_however_flat_its_slope(floor_ratio, ceiling_ratio):
    model, partition, executor = _controller(span=1, precision="bf16", floor_ratio=floor_ratio, ceiling_ratio=ceiling_ratio)
    executor.service.controller.rule.tolerance_ratio = 1e9  # every slope is within tolerance
    results = _evaluate_moving(executor, model, evaluations=8)
    rows = [row for r in results[2:] for row in r.readings]
    # Floors are measured for either ratio (the ceiling alone too), and the module moves:
    # it reads more than 100x its floor, so a ceiling of 10x holds what the slope freezes.
    assert all(row["plasticity"] > 100 * row["floor"] for row in rows)
    assert all(row["above_ceiling"] is (ceiling_ratio is not None) for row in rows)
    frozen = [r.decision for r in results if r.decision is not None]
    assert (frozen == []) is (ceiling_ratio is not None)


def test_the_ceiling_releases_a_module_once_its_drift_is_within_it_and_stops_a_carry_over():
    rule = FrontRule(window=3, tolerance_ratio=0.2, regimes=True, ceiling_ratio=100.0)
    for _ in range(6):  # flat at 1,000x the floor: stale, but held
        reading = rule.read(0, 1.0, lr=0.1, floor=1e-3)
    assert reading.stale >= 3 and rule.above_ceiling(0) and not rule.settled(0)
    rule.read(0, 1.0, lr=0.01)  # the rate falls 10x: a module held by the ceiling carries nothing over
    rule.read(0, 1.0, lr=0.01, floor=1e-3)
    assert not rule.carried_over(0) and not rule.settled(0)
    for _ in range(3):  # the floor rises to 1/50 of the reading: within the ceiling
        rule.read(0, 1.0, lr=0.01, floor=0.02)
    assert not rule.above_ceiling(0) and rule.settled(0)
    no_floor = FrontRule(window=3, tolerance_ratio=0.2, ceiling_ratio=100.0)
    for _ in range(6):
        no_floor.read(0, 1.0)
    assert not no_floor.above_ceiling(0) and no_floor.settled(0)  # no floor known: the ceiling holds nothing


@pytest.mark.parametrize("rule", ["egeria", "paper"])
def test_under_egerias_rule_a_learning_rate_drop_restarts_each_watched_modules_average(rule):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    drop_at = 40
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[drop_at], gamma=0.1)
    config = quick_config(rule=rule, settle_ratio=1e-12)  # reads every step, never freezes
    eg = egeria.Egeria(model, opt, config=config)
    train(model, opt, eg, batches(1) * 60, scheduler=sched)
    history = eg.history
    eg.close()
    # The reading of step drop_at + 1 is the first at LR 0.005 (the scheduler stepped after step drop_at).
    before = [r for r in history if r["step"] == drop_at]
    after = [r for r in history if r["step"] == drop_at + 1]
    assert before and after and all(r["smoothed"] != r["plasticity"] for r in before)
    then = [r for r in history if r["step"] == drop_at + 2]
    assert all(r["lr"] == pytest.approx(0.05) for r in before) and all(r["lr"] == pytest.approx(0.005) for r in after)
    if rule == "egeria":
        # The first reading after the drop compares with a reference from before it: it
        # joins no average; the next one starts the new average alone, with no slope yet.
        assert all(not r["counted"] and r["slope"] is None and r["stale"] == 0 for r in after)
        assert then and all(r["counted"] and r["smoothed"] == r["plasticity"] and r["slope"] is None for r in then)
    else:  # the paper's rule keeps averaging across the drop
        assert all(r["counted"] and r["smoothed"] != r["plasticity"] for r in after + then)


@pytest.mark.parametrize("regimes", [True, False])
def test_a_reading_spanning_a_learning_rate_change_refreshes_the_reference_whatever_refresh_every_says(monkeypatch, regimes):
    torch.manual_seed(0)
    model = Chain(depth=4).eval()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    refresh_every = 1000  # only the build, and the reading spanning the change
    spec = ControllerSpec(partition, float_snapshot(model), "fp32", 3, 0.2, refresh_every, 1, None, 2, False, regimes=regimes)
    executor = InlineExecutor(spec)
    refreshed = []
    original = ReferenceModel.refresh
    monkeypatch.setattr(ReferenceModel, "refresh", lambda self, *a, **kw: (refreshed.append(seq), original(self, *a, **kw)))
    x = torch.randn(16, 8)
    for seq in range(1, 7):  # no freeze yet (its refresh would count)
        lr = 0.1 if seq <= 4 else 0.01  # the reading of seq 5 is the first at the new rate
        executor.offer(Request(seq, 0, seq, 0, ((x,), {}), lr=lr))
        executor.readout(Readout(seq, None, dict(model.state_dict())))
        [result] = executor.poll()
        if seq == 5:
            assert [row["counted"] for row in result.readings] == [not regimes] * 2
    assert refreshed == ([1, 5] if regimes else [1])


def test_the_front_rule_counts_settled_modules_from_the_front_and_keeps_peaks_across_restarts():
    rule = FrontRule(window=2, tolerance_ratio=0.2, settle_ratio=0.5)
    for value in (1.0, 1.0, 1.0, 1.0, 1.0):  # module 1: flat, but at its peak: never settled
        rule.read(1, value)
    for value in (4.0, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4):  # module 0: flat, well under its peak
        rule.read(0, value)
    assert rule.settled(0) and not rule.settled(1)
    assert rule.settled_front([0, 1]) == 1 and rule.settled_front([1, 0]) == 0
    rule.forget_before(1)
    assert set(rule.watches) == {1} and rule.peak(0) == 4.0  # its first average, the highest
    rule.restart(window=3)
    assert rule.watches == {} and rule.window == 3 and rule.peak(1) == 1.0
    copy = FrontRule(window=9, tolerance_ratio=0.2)
    copy.load_state_dict(rule.state_dict())
    assert copy.window == 3 and copy.peaks == rule.peaks


def test_fields_left_at_none_take_the_rules_own_values_and_follow_a_change_of_rule():
    default = egeria.EgeriaConfig()
    assert default.rule == "egeria"
    assert (default.window, default.settle_ratio, default.unfreeze_lr_drop, default.max_frozen_params) == (
        3, 0.03, math.inf, 0.25
    )
    assert (default.floor_ratio, default.ceiling_ratio) == (8.0, 300.0)
    paper = default.replace(rule="paper")  # the paper's Algorithm 1 with the paper's settings
    assert (paper.window, paper.settle_ratio, paper.unfreeze_lr_drop, paper.max_frozen_params) == (10, None, 10.0, None)
    assert (paper.floor_ratio, paper.ceiling_ratio) == (None, None)
    assert paper == egeria.EgeriaConfig(rule="paper")
    mine = egeria.EgeriaConfig(rule="paper", window=5, settle_ratio=0.2)  # values given stay under either rule
    assert (mine.replace(rule="egeria").window, mine.replace(rule="egeria").settle_ratio) == (5, 0.2)
    assert mine.replace(rule="egeria").unfreeze_lr_drop == math.inf
    baseline = egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 2})
    assert baseline.max_frozen_params is None and baseline.unfreeze_lr_drop == 10.0  # a baseline is not capped
    written = json.loads(json.dumps(default.to_dict(), allow_nan=False))  # strict JSON: no infinity
    assert written["unfreeze_lr_drop"] == "inf" and "_from_rule" not in written
    assert egeria.EgeriaConfig(**written) == default


def test_under_egerias_default_a_learning_rate_drop_unfreezes_nothing():
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[40], gamma=0.1)
    # unfreeze_lr_drop left to the rule (never); no level condition, so modules freeze
    # before the drop (with unfreeze_lr_drop=10 the drop at step 40 unfreezes them).
    config = quick_config(rule="egeria", unfreeze_lr_drop=None, settle_ratio=1.0)
    eg = egeria.Egeria(model, opt, config=config)
    train(model, opt, eg, batches(1) * 80, scheduler=sched)
    moves = [(d.step, d.action) for d in eg.events]
    eg.close()
    assert any(step < 40 and action == "freeze" for step, action in moves)
    assert not any(action == "unfreeze" for _, action in moves)


def _stepped(scheduler, steps: int) -> None:
    for _ in range(steps):
        scheduler.optimizer.step()
        scheduler.step()


def test_decays_ahead_counts_the_decays_a_step_schedule_states_and_still_has_to_come():
    def optimizer():
        return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)

    multistep = torch.optim.lr_scheduler.MultiStepLR(optimizer(), milestones=[3, 5], gamma=0.1)
    counts = []
    for _ in range(7):
        counts.append(decays_ahead(multistep))
        _stepped(multistep, 1)
    assert counts == [2, 2, 2, 1, 1, 0, 0]  # in the scheduler's own steps, whatever they stand for
    opt = optimizer()
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    then = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10], gamma=0.1)
    sequential = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, then], milestones=[4])
    assert decays_ahead(sequential) == 1  # the warm-up is no decay; the step part's is ahead
    _stepped(sequential, 4 + 10)
    assert decays_ahead(sequential) == 0
    assert decays_ahead(torch.optim.lr_scheduler.MultiStepLR(optimizer(), milestones=[3], gamma=1.0)) == 0
    for unstated in (
        None,
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer(), T_max=10),
        torch.optim.lr_scheduler.StepLR(optimizer(), step_size=3),  # open-ended: no last decay
        torch.optim.lr_scheduler.LambdaLR(optimizer(), lambda s: 1.0),
    ):
        assert decays_ahead(unstated) is None


def test_a_module_settled_when_the_rate_fell_settles_again_at_its_first_reading_after():
    def settled_then(rule: FrontRule, index: int, first_lr: float, then_lr: float, values) -> list[bool]:
        for value in values:
            rule.read(index, value, first_lr)
        return [rule.settled(index) for _ in [rule.read(index, value, then_lr) for value in (0.04, 0.04)]]

    flat = (4.0,) + (0.4,) * 7  # settled at the first rate: flat, well under its peak
    rule = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.5, regimes=True)
    for value in flat:
        rule.read(0, value, 0.1)
    assert rule.settled(0)
    rule.read(0, 0.04, 0.01)  # spans the decay: joins no average, settles nothing
    assert not rule.settled(0)
    rule.read(0, 0.04, 0.01)  # the first reading at the new rate, under the level: settled again
    assert rule.settled(0) and rule.watches[0].stale < rule.window and rule.carried_over(0)
    copy = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.5, regimes=True)
    copy.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert copy.carried == {0} and copy.settled(0)
    # Not after a rise of the rate, nor for a module that had not settled before the fall.
    rising = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.5, regimes=True)
    assert settled_then(rising, 0, 0.01, 0.1, flat) == [False, False]
    unsettled = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.5, regimes=True)
    assert settled_then(unsettled, 0, 0.1, 0.01, (4.0, 0.4)) == [False, False]
    # A level above settle_ratio of the peak after the fall still holds it.
    high = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.05, regimes=True)
    for value in (4.0,) + (0.1,) * 7:
        high.read(0, value, 0.1)
    assert high.settled(0)
    high.read(0, 0.3, 0.01)
    high.read(0, 0.3, 0.01)
    assert not high.settled(0)


def test_noisy_readings_late_in_a_phase_do_not_undo_a_carry_across_the_fall():
    rule = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.1, regimes=True)
    for value in (4.0, 3.0) + (0.2,) * 7:  # settled at the first rate: flat at 5% of the peak
        rule.read(0, value, 0.1)
    assert rule.settled(0)
    for _ in range(2):  # the last two readings before the fall spike: the level is 1.0
        rule.read(0, 1.0, 0.1)
    assert not rule.settled(0)
    copy = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.1, regimes=True)
    copy.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    for resumed in (rule, copy):
        resumed.read(0, 0.05, 0.01)  # the reading spanning the fall: joins no average
        assert not resumed.settled(0)
        resumed.read(0, 0.05, 0.01)  # the first at the new rate, under the level
        assert resumed.settled(0) and resumed.carried_over(0)
    # A module that never settled at the rate before the fall carries nothing, however low it
    # reads across it.
    never = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.1, regimes=True)
    for value in (4.0, 3.0, 2.0, 1.0, 0.5, 0.25):  # still falling: never stale
        never.read(0, value, 0.1)
    never.read(0, 0.01, 0.01)
    never.read(0, 0.01, 0.01)
    assert not never.settled(0) and not never.carried_over(0)
    # Settled only by the carry from an earlier fall is no evidence for the next one, whether
    # its last reading before it was high or low.
    for last in (3.0, 0.04):
        chained = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.5, regimes=True)
        for value in (4.0,) + (0.4,) * 7:
            chained.read(0, value, 0.1)
        chained.read(0, 0.04, 0.01)  # spans the first fall
        chained.read(0, last, 0.01)  # one reading at the new rate: carried, if low
        assert chained.settled(0) is (last < 2.0)
        chained.read(0, 0.001, 0.001)  # spans the second fall
        chained.read(0, 0.001, 0.001)
        assert not chained.settled(0) and not chained.carried_over(0)


def test_no_module_freezes_across_a_fall_while_its_first_reading_after_is_over_the_ceiling():
    def carried(level: float, floor: float | None) -> bool:
        rule = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.5, regimes=True, ceiling_ratio=100.0)
        for value in (4.0,) + (0.4,) * 7:  # settled at the first rate, 40x its floor
            rule.read(0, value, 0.1, floor=0.01)
        assert rule.settled(0)
        rule.read(0, 0.1, 0.01, floor=0.01)  # spans the fall
        rule.read(0, level, 0.01, floor=floor)
        return rule.settled(0) and rule.carried_over(0)

    assert carried(0.5, 0.01)  # 50x its floor, within settle_ratio of the peak
    assert not carried(1.5, 0.01)  # 150x: over the ceiling
    assert carried(1.5, None)  # no floor measured: the ceiling holds nothing


@pytest.mark.parametrize("interval", [7, 1])
def test_the_readings_start_again_at_the_step_after_the_last_decay_so_held_modules_freeze_n_steps_after_it(interval):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[30, 80], gamma=0.1)
    config = quick_config(rule="egeria", unfreeze_lr_drop=None, settle_ratio=1.0, wait_for_last_decay=True,
                          eval_interval=interval)
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched)
    train(model, opt, eg, batches(1) * 100, scheduler=sched)
    steps = sorted({row["step"] for row in eg.history})
    freezes = [d for d in eg.events if d.action == "freeze"]
    eg.close()
    # Readings every n steps, then from step 81, the first trained at the last rate (the
    # scheduler's 80th step passed its last milestone), every n steps again: the reading
    # of 81 spans the decay, and the modules that had settled while held freeze at the
    # next, a full interval at the last rate.
    assert 81 in steps and all(s % interval == 0 if s < 81 else (s - 81) % interval == 0 for s in steps)
    assert freezes and freezes[0].step == 81 + interval and "learning rate fell" in freezes[0].reason


def test_a_held_reading_freezes_nothing_and_the_first_unheld_one_freezes_what_has_settled():
    model, partition, executor = _controller(span=2)
    x = torch.randn(16, 8)
    results = []
    for seq in range(1, 12):
        executor.offer(Request(seq, 0, seq, 0, ((x,), {}), hold=seq <= 9))
        executor.readout(Readout(seq, None, dict(model.state_dict())))
        [result] = executor.poll()
        results.append(result)
    # Constant readings settle both modules at the 6th (see the first test); held until the 10th.
    assert all(r.decision is None for r in results[:9])
    assert all(len(r.readings) == 2 for r in results[1:9])  # read as usual while held
    assert results[9].decision is not None and results[9].decision.modules == tuple(partition.names[:2])


@pytest.mark.parametrize("give_scheduler, wait", [(True, True), (True, False), (False, True)])
def test_egerias_rule_holds_its_freezes_until_the_schedules_last_decay(give_scheduler, wait, caplog):
    caplog.set_level(logging.INFO, logger="egeria")
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[30, 50], gamma=0.1)
    # No level condition: the modules settle long before the first decay.
    config = quick_config(rule="egeria", unfreeze_lr_drop=None, settle_ratio=1.0, wait_for_last_decay=wait)
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched if give_scheduler else None)
    train(model, opt, eg, batches(1) * 70, scheduler=sched)
    freezes = [d.step for d in eg.events if d.action == "freeze"]
    eg.close()
    assert freezes
    if give_scheduler and wait:
        # The reading of step 51 is the first at the last rate and spans the decay; modules
        # that had settled freeze at the next one (here, 52), others W stale readings later.
        assert 50 < min(freezes) <= 52 + config.window
        said = [r.getMessage() for r in caplog.records]
        assert any("held until the scheduler's last learning-rate decay (2 ahead)" in m for m in said)
        assert any("last learning-rate decay has passed" in m for m in said)
    else:  # a schedule Egeria was not given, or no hold: the rule's own timing
        assert min(freezes) < 30
        assert not any("held" in r.getMessage() for r in caplog.records)


def test_one_reading_far_above_its_neighbours_does_not_hold_a_settled_level():
    """The settle test reads the median of the last W readings: one spike among low readings
    (common at a low learning rate) lifts a mean of three over settle_ratio x the peak for W
    readings, not the median; readings that stay high still hold the module."""
    def phase(values) -> FrontRule:
        rule = FrontRule(window=3, tolerance_ratio=0.2, settle_ratio=0.03, regimes=True)
        for value in (8.0, 4.0, 2.0, 1.0, 1.0, 1.0):  # the first rate: the peak level is 8.0
            rule.read(0, value, 0.1)
        rule.read(0, 0.1, 0.01)  # spans the fall: joins nothing
        for value in values:
            rule.read(0, value, 0.01)
        return rule

    spiked = phase((0.1, 0.1, 0.6, 0.1, 0.1))
    watch = spiked.watches[0]
    assert spiked.peak(0) == 8.0 and spiked.level(0) == 0.1
    assert watch.stale >= 3 and watch.smoothed[-1] > 0.03 * 8.0  # the mean would have held it
    assert spiked.settled(0)
    held = phase((0.1, 0.6, 0.6, 0.6, 0.6))
    assert held.watches[0].stale >= 3 and held.level(0) == 0.6 and not held.settled(0)
    assert FrontRule(window=3, tolerance_ratio=0.2).level(5) == 0.0  # never read
