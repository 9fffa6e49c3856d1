"""The run's learning-rate schedule read ahead (egeria.lr_schedule): every scheduler's
prediction against the oracle of a real twin optimizer and scheduler stepped in a loop."""

from __future__ import annotations

import copy
import logging
import math
import threading
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as lrs

from egeria import Egeria
from egeria.lr_schedule import LRSchedule, ScheduleWatch, read_schedule, schedule_from
from egeria.policies import StatelessPolicy

from tiny import Chain, idle_step

TOTAL = 60  # optimizer steps of the runs below
LOGGER = "egeria.lr_schedule"


def _hf_linear(warmup: int, total: int) -> Callable[[int], float]:
    """transformers' get_linear_schedule_with_warmup factor, written out."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return factor


def _hf_cosine(warmup: int, total: int, cycles: float = 0.5) -> Callable[[int], float]:
    """transformers' get_cosine_schedule_with_warmup factor, written out."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * cycles * 2.0 * progress)))
    return factor


class Halving:
    """A scheduler of no torch class and no position: halves the learning rate every 10 steps."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.calls = 0

    def step(self) -> None:
        self.calls += 1
        if self.calls % 10 == 0:
            for group in self.optimizer.param_groups:
                group["lr"] *= 0.5


def _transformers(name: str) -> Callable[[torch.optim.Optimizer], Any]:
    def make(opt: torch.optim.Optimizer) -> Any:
        transformers = pytest.importorskip("transformers")
        return getattr(transformers, name)(opt, num_warmup_steps=6, num_training_steps=TOTAL)
    return make


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "StepLR": lambda opt: lrs.StepLR(opt, step_size=7, gamma=0.5),
    "MultiStepLR": lambda opt: lrs.MultiStepLR(opt, milestones=[20, 45], gamma=0.1),
    "CosineAnnealingLR": lambda opt: lrs.CosineAnnealingLR(opt, T_max=TOTAL, eta_min=1e-4),
    "OneCycleLR": lambda opt: lrs.OneCycleLR(opt, max_lr=0.5, total_steps=TOTAL),
    "warm-up then cosine (SequentialLR)": lambda opt: lrs.SequentialLR(
        opt, [lrs.LinearLR(opt, start_factor=0.1, total_iters=10), lrs.CosineAnnealingLR(opt, T_max=TOTAL - 10)],
        milestones=[10],
    ),
    "ChainedScheduler": lambda opt: lrs.ChainedScheduler(
        [lrs.ConstantLR(opt, factor=0.5, total_iters=5), lrs.ExponentialLR(opt, gamma=0.95)]
    ),
    "HF linear with warm-up (LambdaLR)": lambda opt: lrs.LambdaLR(opt, _hf_linear(6, TOTAL)),
    "HF cosine with warm-up (LambdaLR)": lambda opt: lrs.LambdaLR(opt, _hf_cosine(6, TOTAL)),
    "transformers linear": _transformers("get_linear_schedule_with_warmup"),
    "transformers cosine": _transformers("get_cosine_schedule_with_warmup"),
    "ExponentialLR": lambda opt: lrs.ExponentialLR(opt, gamma=0.9),
    "PolynomialLR": lambda opt: lrs.PolynomialLR(opt, total_iters=50, power=2.0),
    "a duck-typed scheduler": Halving,
}
POSITIONLESS = {"ChainedScheduler", "a duck-typed scheduler"}  # they keep no last_epoch


def _twin(make: Callable[[torch.optim.Optimizer], Any], kind: str = "sgd") -> tuple[nn.Parameter, Any, Any]:
    """A parameter, an optimizer over it (two param groups, the first one read) and its scheduler."""
    param, other = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    groups = [{"params": [param]}, {"params": [other], "lr": 0.03}]
    if kind == "sgd":
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01)
    return param, opt, make(opt)


def _run(param: nn.Parameter, opt: Any, scheduler: Any, steps: int, per: int = 1, done: int = 0) -> list[float]:
    """Steps a real optimizer and scheduler in the usual loop (the scheduler after every
    ``per`` optimizer steps, counted from step 0); returns the lr each step used."""
    used = []
    for k in range(done, done + steps):
        used.append(float(opt.param_groups[0]["lr"]))
        param.grad = torch.full_like(param, 0.01)
        opt.step()
        if (k + 1) % per == 0:
            scheduler.step()
    return used


def _oracle(make: Callable[[torch.optim.Optimizer], Any], total: int = TOTAL, per: int = 1) -> torch.Tensor:
    param, opt, scheduler = _twin(make)
    return torch.tensor(_run(param, opt, scheduler, total, per), dtype=torch.float64)


def _exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_the_schedule_read_from_step_0_is_the_learning_rate_every_step_uses(name):
    param, opt, scheduler = _twin(SCHEDULERS[name])
    schedule = read_schedule(scheduler, opt, TOTAL)
    assert schedule is not None and schedule.start == 0 and schedule.reconstructed == 0
    _exact(schedule.lrs, _oracle(SCHEDULERS[name]))


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_the_schedule_read_mid_run_continues_from_the_schedulers_state(name):
    expected = _oracle(SCHEDULERS[name])
    param, opt, scheduler = _twin(SCHEDULERS[name])
    _run(param, opt, scheduler, 23)
    start = 23 if name in POSITIONLESS else None  # the others know their own position
    schedule = read_schedule(scheduler, opt, TOTAL, start=start)
    assert schedule is not None and schedule.start == 23
    _exact(schedule.lrs[23:], expected[23:])
    # Earlier steps: the first lr read, held back to step 0, where none was observed ...
    assert schedule.reconstructed == 23
    _exact(schedule.lrs[:23], torch.full((23,), float(expected[23]), dtype=torch.float64))
    # ... and what was observed, where it was.
    observed = read_schedule(scheduler, opt, TOTAL, start=start, observed=expected[:20].tolist())
    assert observed is not None and observed.reconstructed == 3
    _exact(observed.lrs[:20], expected[:20])
    _exact(observed.lrs[20:23], torch.full((3,), float(expected[23]), dtype=torch.float64))


def test_a_scheduler_stepped_once_per_epoch_is_read_per_optimizer_step():
    make = lambda opt: lrs.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731 - stepped after each epoch
    per, total = 7, 7 * 6
    expected = _oracle(make, total, per=per)
    param, opt, scheduler = _twin(make)
    schedule = read_schedule(scheduler, opt, total, steps_per_epoch=per)
    assert schedule is not None
    _exact(schedule.lrs, expected)
    assert len(set(expected[:per].tolist())) == 1 and expected[per] == expected[0] / 2  # the oracle is per epoch
    # Read in the middle of the third epoch: the scheduler's position (2) places it.
    _run(param, opt, scheduler, 2 * per + 3, per=per)
    middle = read_schedule(scheduler, opt, total, steps_per_epoch=per)
    assert middle is not None and middle.start == 2 * per
    _exact(middle.lrs[2 * per:], expected[2 * per:])


def test_a_per_step_scheduler_with_steps_per_epoch_1_differs_from_the_per_epoch_reading():
    """The cadence matters: the same StepLR read per step is not the per-epoch schedule."""
    make = lambda opt: lrs.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    _, opt, scheduler = _twin(make)
    per_step = read_schedule(scheduler, opt, 14)
    assert per_step is not None
    _exact(per_step.lrs, _oracle(make, 14, per=1))
    assert not torch.equal(per_step.lrs, _oracle(make, 14, per=7))


def _state(param: nn.Parameter, opt: Any, scheduler: Any) -> dict:
    return copy.deepcopy({
        "param": param.detach().clone(),
        "optimizer": opt.state_dict(),
        "scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict") else
        {k: v for k, v in vars(scheduler).items() if k != "optimizer"},
        "lrs": [g["lr"] for g in opt.param_groups],
    })


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif callable(a):
        assert a is b or type(a) is type(b), where
    else:
        assert a == b and type(a) is type(b), where


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_reading_leaves_the_users_scheduler_optimizer_and_parameters_as_they_were(name):
    param, opt, scheduler = _twin(SCHEDULERS[name], kind="adamw")
    _run(param, opt, scheduler, 5)  # AdamW now holds state (moments, step)
    before = _state(param, opt, scheduler)
    steps = []
    opt.register_step_pre_hook(lambda *args: steps.append(1))
    schedule = read_schedule(scheduler, opt, TOTAL, start=5)
    assert schedule is not None
    _assert_same(_state(param, opt, scheduler), before)
    assert steps == []  # the user's optimizer never stepped
    # The user's scheduler continues exactly as an untouched twin does.
    twin_param, twin_opt, twin = _twin(SCHEDULERS[name], kind="adamw")
    _run(twin_param, twin_opt, twin, 5)
    after, untouched = _run(param, opt, scheduler, 10, done=5), _run(twin_param, twin_opt, twin, 10, done=5)
    _exact(torch.tensor(after), torch.tensor(untouched))


def test_the_copys_own_warnings_are_silenced_and_the_users_are_not():
    param, opt, scheduler = _twin(lambda opt: lrs.StepLR(opt, step_size=3))  # never stepped: the copy would warn
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read_schedule(scheduler, opt, 10) is not None
    assert [str(w.message) for w in caught] == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()  # the user's own scheduler, before any optimizer.step(): torch warns
    assert any("optimizer.step()" in str(w.message) for w in caught)


def test_mass_ahead_and_between_against_a_hand_computed_schedule():
    schedule = LRSchedule([1.0, 2.0, 3.0, 4.0])  # mass 10
    assert [schedule.mass_ahead(s) for s in range(5)] == pytest.approx([1.0, 0.9, 0.7, 0.4, 0.0], abs=1e-15)
    assert schedule.mass_ahead(0) == 1.0 and schedule.mass_ahead(4) == 0.0
    assert schedule.mass_between(1, 3) == pytest.approx(0.5)
    assert schedule.mass_between(-5, 99) == 1.0
    assert schedule.peak == 4.0 and schedule.lr(2) == 3.0 and len(schedule) == 4


def test_mass_figures_of_issue_28():
    """The figures the module docstring quotes, from schedules read off real schedulers."""
    total = 1000
    make = {
        "cosine": lambda opt: lrs.CosineAnnealingLR(opt, T_max=total),
        "linear": lambda opt: lrs.LambdaLR(opt, lambda s: 1 - s / total),
        "step": lambda opt: lrs.MultiStepLR(opt, milestones=[total // 2, total * 3 // 4], gamma=0.1),  # the demo's
    }
    ahead = {}
    for name, at in (("cosine", 700), ("linear", 800), ("step", 750)):
        _, opt, scheduler = _twin(make[name])
        schedule = read_schedule(scheduler, opt, total)
        assert schedule is not None
        ahead[name] = schedule.mass_ahead(at)
    assert ahead["cosine"] == pytest.approx(0.0424, abs=5e-4)  # the last 30% of a cosine: 4.2%
    assert ahead["linear"] == pytest.approx(0.0400, abs=5e-4)  # the last 20% of a linear decay: 4.0%
    assert ahead["step"] == pytest.approx(0.0047, abs=5e-5)  # the last phase of the step schedule: 0.47%


def test_a_metric_driven_scheduler_gives_none_with_one_warning(caplog):
    _, opt, _ = _twin(lambda opt: None)
    plateau = lrs.ReduceLROnPlateau(opt)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read_schedule(plateau, opt, TOTAL) is None
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert "metrics" in record.getMessage() and "lr_schedule=" in record.getMessage()


class _Locked(lrs.StepLR):
    """A scheduler holding something that cannot be deep-copied."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        super().__init__(opt, step_size=2)
        self.lock = threading.Lock()


@pytest.mark.parametrize("case, says", [
    ("copy fails", "cannot be copied"),
    ("not finite", "not finite"),
    ("no total steps", "total_steps="),
    ("step fails", "failed to step"),
])
def test_unknowable_schedules_give_none_and_say_what_to_pass(case, says, caplog):
    total: int | None = TOTAL
    if case == "copy fails":
        _, opt, scheduler = _twin(_Locked)
    elif case == "not finite":
        _, opt, scheduler = _twin(lambda opt: lrs.LambdaLR(opt, lambda s: float("nan") if s == 5 else 1.0))
    elif case == "step fails":
        _, opt, scheduler = _twin(lambda opt: lrs.OneCycleLR(opt, max_lr=0.5, total_steps=10))  # steps past its end
    else:
        _, opt, scheduler = _twin(SCHEDULERS["StepLR"])
        total = None
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read_schedule(scheduler, opt, total) is None
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert says in record.getMessage()


def test_the_callable_escape_hatch():
    schedule = schedule_from(lambda step: 0.1 * (1 - step / 10), 10)
    assert schedule is not None
    _exact(schedule.lrs, torch.tensor([0.1 * (1 - s / 10) for s in range(10)], dtype=torch.float64))
    assert schedule.mass_ahead(5) == pytest.approx(15 / 55)
    assert schedule_from(lambda step: -1.0, 10) is None


# -- in the engine ----------------------------------------------------------------------


class Watcher(StatelessPolicy):
    """A policy that freezes nothing and asks for the schedule at every step."""

    name = "watcher"

    def __init__(self) -> None:
        self.seen: list[LRSchedule | None] = []

    def bind(self, binding: Any) -> None:
        self.binding = binding

    def target(self, info: Any) -> None:
        self.seen.append(self.binding.lr_schedule())
        return None


def _engine(make: Callable[[torch.optim.Optimizer], Any] | None, total: int | None, **kwargs: Any):
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make(opt) if make is not None else None
    watcher = Watcher()
    eg = Egeria(model, opt, lr_scheduler=scheduler, total_steps=total, policy=watcher,
                example_inputs=(torch.randn(4, 8),), **kwargs)
    return eg, opt, scheduler, watcher


def _boundaries(eg: Egeria, opt: Any, scheduler: Any, count: int, per: int = 1) -> list[float]:
    """The usual loop: optimizer step, the scheduler after every ``per`` steps, then
    Egeria's step (for per > 1 Egeria's step comes first, as in an epoch loop)."""
    used = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # idle optimizer steps
        for k in range(count):
            used.append(float(opt.param_groups[0]["lr"]))
            opt.zero_grad(set_to_none=True)
            opt.step()
            if per == 1:
                scheduler.step()
                eg.step(torch.tensor(1.0))
            else:
                eg.step(torch.tensor(1.0))
                if (k + 1) % per == 0:
                    scheduler.step()
    return used


def test_egeria_hands_policies_the_schedule_read_from_step_0():
    make = SCHEDULERS["warm-up then cosine (SequentialLR)"]
    eg, opt, scheduler, watcher = _engine(make, TOTAL)
    used = _boundaries(eg, opt, scheduler, 4)
    assert watcher.seen[0] is None  # one scheduler step seen: its cadence is not known yet
    schedule = watcher.seen[-1]
    assert schedule is not None and schedule.start == 0 and schedule.reconstructed == 0
    _exact(schedule.lrs, _oracle(make))
    _exact(schedule.lrs[:4], torch.tensor(used, dtype=torch.float64))
    assert all(s is schedule for s in watcher.seen[2:])  # read once


def test_egeria_learns_a_per_epoch_cadence_from_the_scheduler():
    make = lambda opt: lrs.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    per, total = 5, 5 * 6
    eg, opt, scheduler, watcher = _engine(make, total)
    used = _boundaries(eg, opt, scheduler, 3 * per, per=per)
    assert all(s is None for s in watcher.seen[: 2 * per])  # fewer than two advances seen
    schedule = watcher.seen[-1]
    assert schedule is not None and eg._schedule.steps_per_epoch == per
    _exact(schedule.lrs, _oracle(make, total, per=per))
    _exact(schedule.lrs[: 3 * per], torch.tensor(used, dtype=torch.float64))


def test_egeria_reads_a_resumed_schedulers_schedule_from_its_position():
    make = SCHEDULERS["HF cosine with warm-up (LambdaLR)"]
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(17):  # the run so far, before Egeria is built (a resumed Trainer)
            scheduler.step()
    watcher = Watcher()
    eg = Egeria(model, opt, lr_scheduler=scheduler, total_steps=TOTAL, policy=watcher,
                example_inputs=(torch.randn(4, 8),))
    _boundaries(eg, opt, scheduler, 3)
    schedule = watcher.seen[-1]
    assert schedule is not None and schedule.start == 17 and schedule.reconstructed == 17
    _exact(schedule.lrs[17:], _oracle(make)[17:])


def test_a_run_resumed_after_a_schedules_jumps_reads_and_decides_as_the_uninterrupted_one(caplog):
    """Egeria's checkpoint carries the learning rates of the steps taken, so a run resumed
    after a step schedule's drops reads the same schedule (its jumps and peak, not the rate
    at the resume held back to step 0) and its readings stay in their regime: the same
    readings, bit for bit, and the same decisions (issue 74: a restart changes nothing)."""
    import json

    import torch.nn.functional as F

    import egeria
    from tiny import batches

    total, resume_at = 48, 36  # drops at steps 20 and 30: the resume is in the last regime
    config = egeria.EgeriaConfig(executor="inline", eval_interval=2, cost_budget=None, cpu_threshold=None)
    data = batches(4, seed=1)

    def run(first: int, last: int, model, opt, sched, eg) -> None:
        for step in range(first, last):
            x, y = data[step % len(data)]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            eg.step(loss)

    def build():
        torch.manual_seed(0)
        model = Chain()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, lrs.MultiStepLR(opt, milestones=[20, 30], gamma=0.1)

    model, opt, sched = build()
    eg = Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=total)
    run(0, resume_at, model, opt, sched, eg)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), sched.state_dict(),
             json.loads(json.dumps(eg.state_dict())))
    run(resume_at, total, model, opt, sched, eg)
    read, history, events = eg._schedule.schedule(opt, total), eg.history, [d.to_dict() for d in eg.events]
    eg.close()

    model, opt, sched = build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    resumed = Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=total)
    resumed.load_state_dict(saved[3])
    with caplog.at_level(logging.WARNING, logger="egeria"):
        run(resume_at, total, model, opt, sched, resumed)
    reread = resumed._schedule.schedule(opt, total)
    assert reread.jumps(2.0) == read.jumps(2.0) == [20, 30] and reread.peak == read.peak == 0.05
    assert torch.equal(reread.lrs, read.lrs)
    after = [row for row in history if row["step"] > resume_at]
    assert after and [row for row in resumed.history if row["step"] > resume_at] == after
    assert all(row["counted"] for row in after)  # no reading after the resume starts a regime
    assert [d.to_dict() for d in resumed.events] == events
    assert "never falls" not in caplog.text  # the peak is the run's, not the rate at the resume
    resumed.close()


def test_egeria_warns_once_for_an_unknowable_schedule(caplog):
    eg, opt, scheduler, watcher = _engine(lambda opt: lrs.ReduceLROnPlateau(opt), TOTAL)
    warned_at = []
    with caplog.at_level(logging.WARNING, logger=LOGGER), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            idle_step(opt, eg)
            scheduler.step(1.0)
            warned_at.append(sum(r.name == LOGGER for r in caplog.records))
    assert watcher.seen == [None] * 5
    assert warned_at == [1] * 5  # at the first request, then never again
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert "metrics" in record.getMessage() and "lr_schedule=" in record.getMessage()


def test_egeria_without_total_steps_warns_once(caplog):
    eg, opt, scheduler, watcher = _engine(SCHEDULERS["StepLR"], None)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _boundaries(eg, opt, scheduler, 4)
    assert watcher.seen == [None] * 4
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert "total_steps=" in record.getMessage()


def test_egeria_takes_the_users_callable_over_the_scheduler():
    lr_at = lambda step: 0.2 if step < 30 else 0.02  # noqa: E731
    eg, opt, scheduler, watcher = _engine(SCHEDULERS["StepLR"], TOTAL, lr_schedule=lr_at)
    _boundaries(eg, opt, scheduler, 1)
    schedule = watcher.seen[0]
    assert schedule is not None
    _exact(schedule.lrs, torch.tensor([lr_at(s) for s in range(TOTAL)], dtype=torch.float64))


def test_without_a_scheduler_the_optimizers_learning_rate_holds():
    eg, opt, _, watcher = _engine(None, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idle_step(opt, eg)
    schedule = watcher.seen[0]
    assert schedule is not None
    _exact(schedule.lrs, torch.full((10,), 0.1, dtype=torch.float64))


@pytest.mark.parametrize("bad, says", [
    (0.1, "lr_schedule=0.1"),
    ("cosine", "lr_schedule='cosine'"),
])
def test_a_bad_lr_schedule_is_refused_by_name(bad, says):
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        Egeria(model, opt, lr_schedule=bad)


def test_a_scheduler_passed_as_lr_schedule_is_pointed_to_lr_scheduler():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = lrs.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match="lr_scheduler="):
        Egeria(model, opt, lr_schedule=plateau)


def test_the_watch_needs_two_advances_whatever_the_order_of_the_calls():
    """Egeria's step before or after the scheduler's: the gap between advances is the same."""
    for offset in (0, 1):
        watch = ScheduleWatch()
        _, opt, scheduler = _twin(SCHEDULERS["StepLR"])
        watch.watch(0, scheduler, opt)
        for step in range(1, 4):
            if offset == 0:
                scheduler.last_epoch += 1
            watch.watch(step, scheduler, opt)
            if offset == 1:
                scheduler.last_epoch += 1
        assert watch.steps_per_epoch == 1


def test_before_training_a_missing_length_is_asked_for_again_quietly(caplog):
    _, opt, scheduler = _twin(SCHEDULERS["StepLR"])
    watch = ScheduleWatch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert watch.schedule(opt, None, final=False) is None  # no scheduler, no length yet
        watch.watch(0, scheduler, opt)
        assert watch.schedule(opt, None, lambda step: 0.1, final=False) is None
    assert [r for r in caplog.records if r.name == LOGGER] == []
    answer = watch.schedule(opt, 10, lambda step: 0.1, final=True)
    assert answer is not None and len(answer) == 10
