"""Egeria's two freezing rules: the paper's one module at a time, and the default that
reads several front modules from one forward pass; fixed and cut-down probe batches."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

import egeria
from egeria.knowledge.executors import InlineExecutor
from egeria.knowledge.protocol import Readout, Request
from egeria.knowledge.reference import ReferenceModel
from egeria.config import SPEEDS
from egeria.checkpoint.statecheck import check
from egeria.knowledge.plasticity import ModuleWatch
from egeria.knowledge.policy import rule_settings
from egeria.knowledge.rule import IDLE_SHARE, FrontRule, Outlook, RuleSettings, at_most
from egeria.knowledge.service import ControllerSpec
from egeria.knowledge.weights import float_snapshot
from fakes import Recorder
from tiny import Chain, batches, quick_config, train


def _controller(span: int, window: int = 3, precision: str = "fp32",
                floor_ratio: float | None = None, horizon: float | None = None):
    torch.manual_seed(0)
    model = Chain(depth=4).eval()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    spec = ControllerSpec(
        partition, float_snapshot(model), precision,
        RuleSettings(window=window, tolerance_ratio=0.2, floor_ratio=floor_ratio, horizon=horizon),
        threads=1, cpu_threshold=None, span=span,
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
    with pytest.raises(ValueError, match="probe_size=-1"):
        egeria.EgeriaConfig(probe_size=-1)
    with pytest.raises(ValueError, match="probe_size.*activation_mode='eval'"):
        egeria.EgeriaConfig(probe_size=8, activation_mode="train")


def test_after_every_freeze_the_next_module_is_read_again():
    # The worker and the controller must agree on the frozen count after a decision that
    # freezes several modules at once, or every later request is stale and reading stops;
    # the controller must have the weights of the modules it watches next.
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    eg = egeria.Egeria(model, opt, config=quick_config(rule="egeria"))
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


def test_a_module_that_does_not_move_reads_its_floor_and_freezes_though_no_schedule_says_how_much_is_ahead():
    # horizon set and no schedule known: no outlook, so the slope test alone freezes nothing
    model, partition, executor = _controller(span=1, precision="bf16", floor_ratio=2.0, horizon=0.5)
    x = torch.randn(16, 8)
    results = [_evaluate(executor, model, seq, x) for seq in range(1, 7)]
    # Same weights, same batch: each reading compares the reference with the weights it was
    # refreshed from, i.e. it reads the floor itself. The floor is first measured at the
    # refresh after the 2nd evaluation (the 1st builds); the 4th is the first whose readings
    # (the 2nd to the 4th) cover a span (W = 3 steps), and their median is at the floor.
    rows = [row for r in results[1:4] for row in r.readings]
    assert rows[0]["floor"] is None and all(row["plasticity"] > 0 for row in rows)
    assert all(row["floor"] == pytest.approx(row["plasticity"], rel=1e-9) for row in rows[1:])
    assert [row["quiet"] for row in rows] == [0, 0, 1]
    assert all(r.decision is None for r in results[:3])
    decision = results[3].decision
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
    model, partition, executor = _controller(span=2, precision="bf16", floor_ratio=2.0, horizon=0.5)
    results = _evaluate_moving(executor, model, evaluations=8)
    rows = [row for r in results[2:] for row in r.readings]
    assert all(row["plasticity"] > 100 * row["floor"] for row in rows)
    assert all(row["quiet"] == 0 for row in rows) and all(r.decision is None for r in results)
    state = executor.service.controller.state_dict(dict(model.state_dict()))
    assert set(state["floors"]) == {"0", "1"}


def test_a_checkpoint_with_a_reference_of_another_precision_restarts_the_watches_and_keeps_the_outlooks(caplog):
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
    largest = {int(i): o["largest"] for i, o in saved["outlooks"].items()}
    assert {i: o.largest for i, o in controller.rule.outlooks.items()} == largest
    assert all(o.paces == [] for o in controller.rule.outlooks.values())


@pytest.mark.parametrize("rule", ["egeria", "paper"])
def test_under_egerias_rule_a_learning_rate_drop_restarts_each_watched_modules_average(rule):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    drop_at = 40
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[drop_at], gamma=0.1)
    config = quick_config(rule=rule, horizon=1e-12, floor_ratio=0)  # no schedule known: reads, never freezes
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


def test_readings_sparser_than_the_lag_compare_with_a_reference_refreshed_lag_steps_before_them(monkeypatch):
    """With readings every n > D steps, a refresh-only evaluation D steps before each reading
    refreshes the reference (answered without a reading) and the reading, which does not
    refresh, compares with it: each reading covers D steps whatever n is; its learning-rate
    mass is that of those D steps, and a jump of the schedule between the refresh and the
    reading makes the reading straddle it, one before the refresh does not."""
    torch.manual_seed(0)
    model = Chain(depth=4).eval()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    settings = RuleSettings(window=3, tolerance_ratio=0.2, regimes=True, lag=5)
    executor = InlineExecutor(ControllerSpec(partition, float_snapshot(model), "fp32", settings, threads=1,
                                             cpu_threshold=None, span=2))
    refreshed = []
    original = ReferenceModel.refresh
    monkeypatch.setattr(ReferenceModel, "refresh", lambda self, *a, **kw: (refreshed.append(step), original(self, *a, **kw)))
    x = torch.randn(16, 8)
    results = {}
    seq = 0
    for read_step, regime in ((20, -1), (40, 28), (60, 57)):  # n = 20, D = 5; jumps at 28 and at 57
        for step, read in ((read_step - 5, False), (read_step, True)):
            seq += 1
            executor.offer(Request(seq, 0, step, 0, ((x,), {}), lr=0.1, mass_ahead=1000.0 - step, lr_peak=0.1,
                                   regime=regime if step >= max(regime, 0) else -1, read=read, refresh=not read, lag=5))
            executor.readout(Readout(seq, None, dict(model.state_dict())))
            [results[step]] = executor.poll()
    assert refreshed == [15, 35, 55]  # the refreshes only: no reading refreshed
    assert [results[s].note for s in (15, 35, 55)] == ["building", "refreshed", "refreshed"]
    assert results[20].note == "" and all(not results[s].readings for s in (15, 35, 55))
    rows = {s: results[s].readings[0] for s in (20, 40, 60)}
    assert [rows[s]["mass"] for s in (20, 40, 60)] == [5.0, 5.0, 5.0]  # the mass of D steps, not of n
    assert rows[40]["counted"]  # the jump at 28 came before the refresh at 35: the reading is of the new regime
    assert not rows[60]["counted"]  # the jump at 57 lies within the reading's own drift (55, 60]


def test_the_front_rule_counts_settled_modules_from_the_front_and_keeps_the_largest_outlook_across_restarts():
    rule = FrontRule(RuleSettings(window=2, tolerance_ratio=0.2, horizon=0.1))
    for k in range(6):  # module 1: flat, with half the run's mass still ahead: not settled
        rule.read(1, 1.0, mass=0.01, ahead=0.5)
    for ahead in (0.9, 0.5, 0.1, 0.05, 0.05, 0.05):  # module 0: flat, the mass ahead runs out
        rule.read(0, 1.0, mass=0.01, ahead=ahead)
    assert rule.outlook(0).largest == pytest.approx(90.0) and rule.outlook(0).share == pytest.approx(0.05 / 0.9)
    assert rule.settled(0) and not rule.settled(1)
    assert rule.settled_front([0, 1]) == 1 and rule.settled_front([1, 0]) == 0
    rule.forget_before(1)
    assert set(rule.watches) == set(rule.outlooks) == {1}
    rule.restart(window=3)
    assert rule.watches == {} and rule.window == 3 and rule.outlook(1).largest == 50.0 and rule.outlook(1).paces == []
    copy = FrontRule(RuleSettings(window=9, tolerance_ratio=0.2))
    copy.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert copy.window == 3 and copy.outlook(1).largest == 50.0


def test_a_settled_module_waits_for_the_learning_rate_to_come_down_to_the_bound_of_the_peak():
    """Egeria's criterion: a module whose slope is flat and whose outlook is within the
    horizon still waits for a learning rate at most SPEEDS["safe"] of the highest the rule was
    told of (the schedule's peak or any reading's); a rate built as 0.1 * 0.1 * peak is at
    the bound; a quiet module freezes at any rate; the paper's rule has no bound."""
    settings = RuleSettings(window=2, tolerance_ratio=0.2, horizon=0.5, floor_ratio=4.0, low_lr=SPEEDS["safe"])
    peak = 0.1
    rule = FrontRule(settings)
    for ahead in (0.9, 0.5, 0.1, 0.05, 0.05, 0.05):  # flat, the mass ahead runs out, at a tenth of the peak
        rule.read(0, 1.0, 0.1 * peak, mass=0.01, ahead=ahead, peak=peak)
    assert rule.outlook(0).share <= 0.5 and rule.watches[0].stale >= 2
    assert rule.lr_share == pytest.approx(0.1) and not rule.settled(0)
    rule.read(0, 1.0, peak * 0.1 * 0.1, mass=0.01, ahead=0.01)  # the second tenfold drop
    assert peak * 0.1 * 0.1 > SPEEDS["safe"] * peak  # in floats, a hair above the bound
    assert rule.lr_share == pytest.approx(SPEEDS["safe"]) and rule.settled(0)
    rule.read(0, 1.0, 0.5, mass=0.01, ahead=0.01)  # a reading above the peak raises it
    assert rule.peak == 0.5 and not rule.settled(0)
    # the peak and the latest rate go through a checkpoint; a state without them loads
    copy = FrontRule(settings)
    copy.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert (copy.peak, copy.lr) == (0.5, 0.5)
    old = {k: v for k, v in rule.state_dict().items() if k not in FrontRule.OPTIONAL_FIELDS}
    copy.load_state_dict(old)
    assert copy.peak is None and not copy.lr_low()  # no rate known: not low
    # quiet (at its floor): frozen at the peak's rate
    quiet = FrontRule(settings)
    for _ in range(6):
        quiet.read(0, 1.0, peak, floor=1.0, mass=0.01, ahead=0.9, peak=peak)
    assert quiet.quiet(0) and quiet.settled(0)
    # the paper's rule (no horizon, no bound): the slope alone
    paper = FrontRule(RuleSettings(window=2, tolerance_ratio=0.2))
    for _ in range(6):
        paper.read(0, 1.0, peak, mass=0.01, ahead=0.9, peak=peak)
    assert paper.settled(0)


@pytest.mark.parametrize("speed", ["safe", "fast"])
def test_a_schedule_that_never_comes_down_to_the_bound_says_so_once_and_freezes_nothing_still_learning(
        caplog, no_idle, speed):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)  # 0.7 ** 5: 0.17 of the peak at its end
    config = quick_config(rule="egeria", horizon=0.5, floor_ratio=0, eval_interval=2, speed=speed)
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=60)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        decisions = train(model, opt, eg, batches(1) * 60, scheduler=sched)
    history = eg.history
    eg.close()
    said = [r.getMessage() for r in caplog.records if "never falls to" in r.getMessage()]
    assert len(said) == 1 and "0.17 of it" in said[0] and "at their floor" in said[0]
    assert not [d for d in decisions if d.action == "freeze"]
    settled = [row for row in history if row["stale"] >= 2 and row["outlook_share"] is not None
               and row["outlook_share"] <= 0.5]
    assert settled, "the test needs a module the bound alone holds back"
    ended = [r.getMessage() for r in caplog.records if "nothing frozen" in r.getMessage()]
    assert len(ended) == 1 and f"of its peak, above the {SPEEDS[speed]:g} that speed='{speed}' allows" in ended[0]
    assert "the schedule never comes down that low" in ended[0]
    # the same run under the paper's rule is not told
    caplog.clear()
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
    eg = egeria.Egeria(model, opt, config=quick_config(rule="paper", eval_interval=2), lr_scheduler=sched, total_steps=60)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 20, scheduler=sched)
    eg.close()
    assert not [r for r in caplog.records if "never falls to" in r.getMessage()]


def test_the_outlook_is_the_median_pace_times_the_mass_ahead_against_the_largest_it_had():
    outlook = Outlook(window=3)
    assert outlook.pace is None and outlook.value is None and outlook.share is None
    outlook.add(2.0, mass=0.1, ahead=0.8)  # pace 20, outlook 16
    outlook.add(9.0, mass=0.1, ahead=0.6)  # one reading far above: paces 20, 90 -> median 55
    assert outlook.pace == pytest.approx(55.0) and outlook.value == pytest.approx(33.0)
    outlook.add(1.0, mass=0.1, ahead=0.4)  # paces 20, 90, 10: median 20, outlook 8
    assert outlook.pace == pytest.approx(20.0) and outlook.largest == pytest.approx(33.0)
    assert outlook.share == pytest.approx(8.0 / 33.0)
    outlook.add(1.0, mass=0.0, ahead=0.2)  # an interval without mass (a learning rate of 0) adds no pace
    assert outlook.paces == pytest.approx([20.0, 90.0, 10.0]) and outlook.value == pytest.approx(4.0)
    outlook.add(1.0, mass=None, ahead=None)  # the schedule unknown: no outlook
    assert outlook.value is None and outlook.share is None
    outlook.restart()
    assert outlook.paces == [] and outlook.largest == pytest.approx(33.0)


@pytest.mark.parametrize("horizon, settles", [(None, True), (1.0, True), (0.5, False)])
def test_without_a_known_schedule_only_the_slope_test_or_the_floor_can_settle_a_module(horizon, settles):
    rule = FrontRule(RuleSettings(window=3, tolerance_ratio=0.2, horizon=horizon))
    for _ in range(8):  # flat: stale from the 4th reading
        rule.read(0, 1.0)
    assert rule.watches[0].stale >= 3 and rule.settled(0) is settles


def test_fields_left_at_none_take_the_rules_own_values_and_follow_a_change_of_rule():
    default = egeria.EgeriaConfig()
    assert default.rule == "egeria"
    assert (default.window, default.horizon, default.max_frozen_flops) == (3, 0.0005, 0.75)
    assert default.floor_ratio == 8.0
    paper = default.replace(rule="paper")  # the paper's Algorithm 1 with the paper's settings
    assert (paper.window, paper.horizon, paper.max_frozen_flops) == (10, None, None)
    assert paper.floor_ratio is None
    assert paper == egeria.EgeriaConfig(rule="paper")
    mine = egeria.EgeriaConfig(rule="paper", window=5, horizon=0.2)  # values given stay under either rule
    assert (mine.replace(rule="egeria").window, mine.replace(rule="egeria").horizon) == (5, 0.2)
    baseline = egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 2})
    assert baseline.max_frozen_flops is None  # a baseline is not capped unless a cap is given
    written = json.loads(json.dumps(default.to_dict(), allow_nan=False))  # strict JSON
    assert "_from_rule" not in written
    assert egeria.EgeriaConfig(**written) == default


def test_under_egerias_default_a_learning_rate_drop_unfreezes_nothing():
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[40], gamma=0.1)
    # Egeria's rule never unfreezes (the paper's unfreezes at a 10x drop, as the drop at
    # step 40 is); no outlook condition, so modules freeze before the drop.
    assert egeria.KnowledgeGuided(egeria.EgeriaConfig()).unfreeze_lr_drop == math.inf
    assert egeria.KnowledgeGuided(egeria.EgeriaConfig(rule="paper")).unfreeze_lr_drop == 10.0
    config = quick_config(rule="egeria", horizon=1.0)
    eg = egeria.Egeria(model, opt, config=config)
    train(model, opt, eg, batches(1) * 80, scheduler=sched)
    moves = [(d.step, d.action) for d in eg.events]
    eg.close()
    assert any(step < 40 and action == "freeze" for step, action in moves)
    assert not any(action == "unfreeze" for _, action in moves)




def test_a_readings_mass_runs_from_the_references_refresh_to_its_step():
    model, partition, executor = _controller(span=1, horizon=0.1)
    x = torch.randn(16, 8)
    ahead = [9.0, 7.5, 5.5, 4.0, 2.0]  # the sum of the learning rates still to come
    rows = []
    for seq, mass_ahead in enumerate(ahead, start=1):
        executor.offer(Request(seq, 0, seq, 0, ((x,), {}), lr=0.1, mass_ahead=mass_ahead))
        executor.readout(Readout(seq, None, dict(model.state_dict())))
        [result] = executor.poll()
        rows.extend(result.readings)
    # The 1st evaluation builds the reference (refreshed at 0.1); each reading refreshes it.
    assert [row["mass"] for row in rows] == pytest.approx([1.5, 2.0, 1.5, 2.0])
    assert [row["mass_ahead"] for row in rows] == pytest.approx([7.5, 5.5, 4.0, 2.0])
    state = json.loads(json.dumps(executor.service.controller.state_dict(dict(model.state_dict()))))
    assert state["refreshed_ahead"] == pytest.approx(2.0)


def _schedulers(opt, steps: int) -> dict:
    """Schedulers users train with, each stepped once per optimizer step unless said."""
    lr = torch.optim.lr_scheduler
    warm = steps // 10
    return {
        "multistep": lr.MultiStepLR(opt, milestones=[steps // 2, 3 * steps // 4], gamma=0.1),
        "steplr-per-epoch": lr.StepLR(opt, step_size=1, gamma=0.6),  # stepped every 10 optimizer steps
        "warmup-cosine": lr.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
        ),
        # to 1/200 of the peak at step 100, then held: the bound of 1/100 of the peak is the
        # last 1% of a linear decay to 0, too short in a run of 120 steps to be read
        "linear-decay": lr.LambdaLR(opt, lambda s: max(0.005, 1 - s / (steps - 20))),
        "one-cycle": lr.OneCycleLR(opt, max_lr=1e-3, total_steps=steps + 1),
        "sequential": lr.SequentialLR(
            opt, [lr.LinearLR(opt, start_factor=0.1, total_iters=warm), lr.CosineAnnealingLR(opt, T_max=steps - warm)],
            milestones=[warm],
        ),
    }


@pytest.mark.parametrize("kind", ["multistep", "steplr-per-epoch", "warmup-cosine", "linear-decay", "one-cycle", "sequential"])
def test_one_criterion_reads_the_mass_ahead_from_any_schedule_and_freezes_under_each(kind, no_idle):
    steps = 120
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = _schedulers(opt, steps)[kind]
    every = 10 if kind == "steplr-per-epoch" else 1
    config = quick_config(rule="egeria", horizon=0.2, floor_ratio=0, eval_interval=2)
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=steps)
    model.train()
    for i, (x, y) in enumerate(batches(1) * steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (i + 1) % every == 0:
            sched.step()
        eg.step(loss)
    history, events = eg.history, eg.events
    schedule = eg._schedule.schedule(opt, steps)
    eg.close()
    assert schedule is not None
    # Every reading carries the schedule's mass still ahead of its step, read from a copy of
    # the scheduler whatever its class; one stepped per epoch is read once it has stepped
    # twice (its cadence is learnt then), and the readings before carry none.
    known = [row for row in history if row["mass_ahead"] is not None]
    assert known and all(row["mass_ahead"] == pytest.approx(schedule.lr_sum(row["step"])) for row in known)
    first = min(row["step"] for row in history)
    assert min(row["step"] for row in known) <= (first if every == 1 else max(first, 2 * every + 2))
    freezes = [d for d in events if d.action == "freeze"]
    assert freezes and all("drift still to come" in d.reason for d in freezes)
    for d in freezes:  # the front module's outlook was within the horizon when it froze, at a low rate
        row = next(r for r in history if r["step"] == d.evaluated_at and r["module"] == d.modules[0])
        assert row["outlook_share"] is not None and row["outlook_share"] <= 0.2
        assert row["lr_share"] == pytest.approx(row["lr"] / schedule.peak)
        assert at_most(row["lr_share"], SPEEDS["safe"]), (kind, row)
        assert "of its peak" in d.reason


def test_a_schedule_that_rises_again_warns_about_the_unfreeze_rule_once(caplog):
    from egeria.knowledge.unfreezing import rises_again

    assert rises_again([0.1] * 5 + [0.01] * 5 + [0.001] * 5, 10) is None  # steps down only
    assert rises_again([0.0, 0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * t / 20)) for t in range(21)], 10) is None
    assert rises_again([1.0, 0.5, 0.05, 0.3, 0.6], 10) == 4  # fell 20x, then 12x above its low
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=20)
    eg = egeria.Egeria(model, opt, config=quick_config(eval_interval=2), lr_scheduler=sched, total_steps=60)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 30, scheduler=sched)
    eg.close()
    said = [r.getMessage() for r in caplog.records if "rises again" in r.getMessage()]
    assert len(said) == 1 and "at step 20" in said[0] and "unfreeze_rule=" in said[0]


def test_an_unknown_schedule_is_said_once_with_what_it_costs_and_only_quiet_or_idle_modules_freeze(caplog):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # its step() needs a metric: unknowable ahead
    config = quick_config(rule="egeria", horizon=0.5, floor_ratio=0)
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=60)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        decisions = train(model, opt, eg, batches(1) * 60)
    history = eg.history
    eg.close()
    said = [r.getMessage() for r in caplog.records if "schedule is unknown" in r.getMessage()]
    assert len(said) == 1 and "metric" in said[0] and "at their floor" in said[0]
    assert history and all(row["mass_ahead"] is None and row["outlook_share"] is None for row in history)
    freezes = [d for d in decisions if d.action == "freeze"]
    assert freezes, "the tiny chain's stem is idle: the test needs a freeze that no schedule decides"
    assert all("of the most active watched module's" in d.reason for d in freezes)  # no floor test, no outlook


def test_the_rules_settings_are_built_once_from_the_config_and_reach_the_rule_whole():
    from egeria.config import TOLERANCE_RATIO

    config = egeria.EgeriaConfig(window=4, horizon=0.01, floor_ratio=6.0)
    policy = egeria.KnowledgeGuided(config)
    assert policy.rule_settings == RuleSettings(
        window=4, tolerance_ratio=TOLERANCE_RATIO, horizon=0.01, regimes=True, floor_ratio=6.0, low_lr=SPEEDS["safe"],
        idle_share=IDLE_SHARE,
    )
    paper = egeria.KnowledgeGuided(egeria.EgeriaConfig(rule="paper")).rule_settings
    assert (paper.window, paper.horizon, paper.regimes, paper.floor_ratio, paper.low_lr, paper.idle_share) == (
        10, None, False, None, None, None)
    assert egeria.KnowledgeGuided(config.replace(floor_ratio=0.0)).rule_settings.floor_ratio is None  # 0: off
    model, partition, executor = _controller(span=1)
    executor.close()
    settings = RuleSettings(window=5, tolerance_ratio=0.3, horizon=0.2, regimes=True, floor_ratio=4.0)
    spec = ControllerSpec(partition, float_snapshot(model), "fp32", settings, threads=1, cpu_threshold=None)
    controller = spec.build()
    assert controller.rule.settings is settings and controller.window == 5
    assert (controller.rule.tolerance_ratio, controller.rule.horizon, controller.rule.regimes) == (0.3, 0.2, True)
    assert controller.rule.floor_ratio == 4.0


def _idle_settings(**kw) -> RuleSettings:
    return RuleSettings(window=2, tolerance_ratio=0.2, horizon=0.0005, regimes=True, floor_ratio=4.0,
                        low_lr=SPEEDS["safe"], idle_share=IDLE_SHARE, **kw)


def _evaluation(rule: FrontRule, values: dict[int, float], lr: float = 0.1, floor: float | None = None) -> dict:
    """One evaluation: every module of ``values`` read at ``lr`` (the peak), then compared."""
    for index, value in values.items():
        rule.read(index, value, lr, floor, mass=0.01, ahead=0.9, peak=0.1)
    return rule.compare(list(values))


def test_a_module_moving_a_hundredth_as_much_as_the_most_active_freezes_at_the_peak_rate():
    """The idle test (docs/decisions/032-idle-modules.md): at most IDLE_SHARE of the most
    active watched module's smoothed plasticity for W evaluations settles a module, with
    most of the learning rate ahead; a hair above the share does not; nor does a module
    watched alone."""
    rule = FrontRule(_idle_settings())
    shares = _evaluation(rule, {0: 1e-6, 1: 1e-4 * 1.01, 2: 1e-3})
    assert shares == pytest.approx({0: 1e-3, 1: 0.101, 2: 1.0})
    assert rule.active == 2 and not rule.idle(0)  # one evaluation of W = 2
    _evaluation(rule, {0: 1e-6, 1: 1e-4 * 1.01, 2: 1e-3})
    assert rule.idle(0) and rule.settled(0)  # far from the horizon and the bound: idle alone
    assert not rule.idle(1) and not rule.settled(1) and not rule.idle(2)
    assert rule.settled_front([0, 1, 2]) == 1
    edge = FrontRule(_idle_settings())
    for _ in range(3):
        _evaluation(edge, {0: 1.02e-5, 1: 1e-3})  # 0.0102 of the most active
    assert not edge.idle(0)
    alone = FrontRule(_idle_settings())
    for _ in range(3):
        _evaluation(alone, {0: 1e-9})
    assert not alone.idle(0)


def test_the_idle_count_restarts_with_a_reading_above_the_share_and_at_a_jump_of_the_schedule():
    rule = FrontRule(_idle_settings())
    _evaluation(rule, {0: 1e-6, 1: 1e-3})
    _evaluation(rule, {0: 1e-1, 1: 1e-3})  # its smoothed reading jumps over the share
    assert rule.watches[0].idle == 0
    _evaluation(rule, {0: 1e-6, 1: 1e-3})
    assert rule.watches[0].idle == 0  # the mean of its last two readings is still above it
    rule = FrontRule(_idle_settings())
    _evaluation(rule, {0: 1e-6, 1: 1e-3})
    assert rule.watches[0].idle == 1
    _evaluation(rule, {0: 1e-6, 1: 1e-3}, lr=0.01)  # a tenfold drop: the watches restart
    assert rule.watches[0].idle == 0 and not rule.idle(0)


def test_nothing_is_idle_next_to_a_most_active_module_at_its_floor_nor_under_the_papers_rule():
    rule = FrontRule(_idle_settings())
    for _ in range(3):
        _evaluation(rule, {0: 1e-12, 1: 1e-9}, floor=1e-9)  # both within 4x their floor: noise
    assert not rule.idle(0) and rule.quiet(0)  # the floor says settled, not the share
    paper = FrontRule(RuleSettings(window=2, tolerance_ratio=0.2))
    for _ in range(3):
        shares = _evaluation(paper, {0: 1e-6, 1: 1e-3})
    assert shares[0] == pytest.approx(1e-3) and not paper.idle(0)
    assert rule_settings(egeria.EgeriaConfig(rule="paper")).idle_share is None
    assert rule_settings(egeria.EgeriaConfig()).idle_share == IDLE_SHARE


def test_the_idle_count_goes_through_a_checkpoint_and_an_older_state_loads_without_it():
    rule = FrontRule(_idle_settings())
    _evaluation(rule, {0: 1e-6, 1: 1e-3})
    copy = FrontRule(_idle_settings())
    copy.load_state_dict(json.loads(json.dumps(rule.state_dict())))
    assert copy.watches[0].idle == 1
    _evaluation(copy, {0: 1e-6, 1: 1e-3})
    assert copy.idle(0)
    state = json.loads(json.dumps(rule.state_dict()))
    for watch in state["watches"].values():
        del watch["idle"]
    check(state["watches"]["0"], ModuleWatch.state_spec())
    older = FrontRule(_idle_settings())
    older.load_state_dict(state)
    assert older.watches[0].idle == 0


def test_idle_modules_freeze_with_a_reason_naming_the_most_active_one():
    torch.manual_seed(0)
    model = Chain(depth=4).eval()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    spec = ControllerSpec(partition, float_snapshot(model), "fp32",
                          RuleSettings(window=2, tolerance_ratio=0.2, horizon=0.0005, idle_share=IDLE_SHARE),
                          threads=1, cpu_threshold=None, span=3)
    executor = InlineExecutor(spec)
    x = torch.randn(16, 8)
    named = dict(model.named_parameters())
    stem, block = ([named[p] for p in partition.modules[i].params] for i in (0, 2))
    results = []
    for seq in range(1, 6):
        with torch.no_grad():  # the first block moves; the stem's linear layer a ten-thousandth as much
            for p in stem:
                p.add_(1e-5 * torch.randn_like(p))
            for p in block:
                p.add_(0.1 * torch.randn_like(p))
        results.append(_evaluate(executor, model, seq, x))
    rows = [row for r in results[:3] for row in r.readings]  # up to the decision; then the modules behind it
    assert all(row["active_share"] < IDLE_SHARE for row in rows if row["module"] != partition.names[2])
    assert all(row["active_share"] == 1.0 for row in rows if row["module"] == partition.names[2])
    decision = next(r.decision for r in results if r.decision is not None)
    assert decision.step == 3  # the 1st evaluation builds the reference, the 2nd and 3rd read idle: W = 2
    assert decision.modules == tuple(partition.names[:2])  # the stem, and the BatchNorm that only passes it on
    assert f"at most {IDLE_SHARE:g} of the most active watched module's ({partition.names[2]})" in decision.reason
    # the training side has not applied it yet: the next readings are of the modules behind the freeze
    assert [r.module for r in results[3:]] == [2, 2] and results[3].readings[0]["module"] == partition.names[2]
