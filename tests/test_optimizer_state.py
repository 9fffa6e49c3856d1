"""The optimizer state of frozen parameters: released at a freeze, restored exactly at an
unfreeze, and whole in every optimizer state dict a user saves (egeria.optimizer_state)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import egeria
from tiny import Chain, Plan, batches, train

PLAN = {4: 2, 12: 0, 16: 3}  # freeze the front two, unfreeze all, freeze three


def _optimizer(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=5e-4)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _run(kind, release, plan=PLAN):
    torch.manual_seed(0)
    model = Chain()
    opt = _optimizer(model, kind)
    eg = egeria.Egeria(model, opt, policy=Plan(plan), config=egeria.EgeriaConfig(release_optimizer_state=release))
    return model, opt, eg


def _frozen_params(model, eg):
    names = {p for m in eg.partition.modules if m.name in eg.frozen for p in m.params}
    return [p for n, p in model.named_parameters() if n in names]


def _assert_same_state_dict(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for key in a["state"]:
        for name, value in a["state"][key].items():
            torch.testing.assert_close(value, b["state"][key][name], rtol=0, atol=0, msg=f"state {key}.{name}")


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_freeze_takes_the_frozen_parameters_state_out_of_the_optimizer(kind):
    model, opt, eg = _run(kind, True)
    train(model, opt, eg, batches(6))
    frozen = _frozen_params(model, eg)
    assert eg.frozen == eg.modules[:2] and frozen
    assert not any(p in opt.state for p in frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p in opt.state for p in trainable)
    store = eg._prefix.optimizer_state
    assert set(store.held) == set(frozen)
    per_param = 2 if kind == "adamw" else 1  # Adam's two moments, SGD's momentum
    expected = sum(per_param * p.numel() * p.element_size() for p in frozen)
    if kind == "adamw":
        expected += sum(store.held[p]["step"].numel() * 4 for p in frozen)  # a float32 step count each
    assert store.nbytes == expected


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_run_with_the_release_equals_one_without_bit_for_bit_across_an_unfreeze(kind):
    data = batches(3) * 8
    runs = {}
    for release in (True, False):
        model, opt, eg = _run(kind, release)
        runs[release] = (model, opt, train(model, opt, eg, data))
    assert [d.action for d in runs[True][2]] == ["freeze", "unfreeze", "freeze"]
    assert runs[True][2] == runs[False][2]
    for (name, a), b in zip(runs[True][0].state_dict().items(), runs[False][0].state_dict().values()):
        assert torch.equal(a, b), name
    _assert_same_state_dict(runs[True][1].state_dict(), runs[False][1].state_dict())


def test_frozen_weights_stay_bit_identical_while_their_state_is_released():
    model, opt, eg = _run("adamw", True, {3: 2})
    data = batches(2) * 6
    train(model, opt, eg, data[:3])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert before
    train(model, opt, eg, data[3:])
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n


def test_the_state_dict_saved_while_released_holds_every_parameters_state():
    with_release, opt, eg = _run("adamw", True)
    train(with_release, opt, eg, batches(3) * 2)
    assert eg.frozen
    plain_model, plain_opt, plain_eg = _run("adamw", False)
    train(plain_model, plain_opt, plain_eg, batches(3) * 2)
    saved = opt.state_dict()
    assert len(saved["state"]) == len(list(with_release.parameters()))
    _assert_same_state_dict(saved, plain_opt.state_dict())
    # the optimizer itself still holds only the trainable parameters' state
    assert len(opt.state) < len(saved["state"])


@pytest.mark.parametrize("saved_by,resumed_by", [(True, True), (True, False), (False, True)],
                         ids=["new-in-new", "new-in-old", "old-in-new"])
def test_a_resume_equals_the_uninterrupted_run_whichever_code_saved_and_loads(saved_by, resumed_by):
    """Saved at step 14 (the front two frozen, their state released where ``saved_by``),
    resumed by code that releases or not (``resumed_by``; False stands for code without the
    release): the rest of the run, an unfreeze-free freeze of three included, is the
    uninterrupted run's bit for bit."""
    data = batches(3) * 8
    plan = {4: 2, 18: 3}
    model, opt, eg = _run("adamw", saved_by, plan)
    train(model, opt, eg, data[:14])
    assert len(eg.frozen) == 2
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(eg.state_dict()))
    rest = train(model, opt, eg, data[14:])

    model2, opt2, eg2 = _run("adamw", resumed_by, plan)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    eg2.load_state_dict(saved[2])
    if resumed_by:
        assert not any(p in opt2.state for p in _frozen_params(model2, eg2))
    assert train(model2, opt2, eg2, data[14:]) == rest
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    _assert_same_state_dict(opt.state_dict(), opt2.state_dict())


def test_loading_an_optimizer_state_while_frozen_releases_the_loaded_state():
    """A load replaces all state: the frozen parameters' loaded state is released again,
    and what was held before is gone."""
    model, opt, eg = _run("adamw", True, {2: 2})
    train(model, opt, eg, batches(3))
    saved = copy.deepcopy(opt.state_dict())
    train(model, opt, eg, batches(2))  # the frozen state is unchanged, the rest moves on
    frozen = _frozen_params(model, eg)
    for p in frozen:  # mark the held state, to see it replaced
        eg._prefix.optimizer_state.held[p]["exp_avg"] = torch.full_like(p, 7.0)
    opt.load_state_dict(saved)
    assert not any(p in opt.state for p in frozen)
    _assert_same_state_dict(opt.state_dict(), saved)


def test_closing_with_modules_left_frozen_gives_the_optimizer_its_state_back():
    model, opt, eg = _run("sgd", True, {2: 2})
    train(model, opt, eg, batches(3))
    frozen = _frozen_params(model, eg)
    held = {p: eg._prefix.optimizer_state.held[p]["momentum_buffer"] for p in frozen}
    eg.close(unfreeze=False)
    assert all(not p.requires_grad for p in frozen)
    for p in frozen:
        assert opt.state[p]["momentum_buffer"] is held[p]


def test_an_optimizer_without_per_parameter_state_trains_on_with_one_warning(caplog):
    class Bare:
        """A hand-written SGD without state or state-dict hooks."""

        def __init__(self, params, lr):
            self.param_groups = [{"params": list(params), "lr": lr}]

        def step(self):
            with torch.no_grad():
                for p in self.param_groups[0]["params"]:
                    if p.grad is not None:
                        p -= self.param_groups[0]["lr"] * p.grad

        def zero_grad(self):
            for p in self.param_groups[0]["params"]:
                p.grad = None

    torch.manual_seed(0)
    model = Chain()
    opt = Bare(model.parameters(), 1e-2)
    eg = egeria.Egeria(model, opt, policy=Plan({2: 2}))
    with caplog.at_level(logging.WARNING, logger="egeria.optimizer_state"):
        for x, y in batches(4):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            eg.step()
    assert eg.frozen == eg.modules[:2]
    assert [r.getMessage() for r in caplog.records if "stays in the optimizer" in r.getMessage()] != []
    assert len([r for r in caplog.records if "stays in the optimizer" in r.getMessage()]) == 1


def test_release_optimizer_state_must_be_a_bool():
    with pytest.raises(ValueError, match=r"release_optimizer_state='yes'"):
        egeria.EgeriaConfig(release_optimizer_state="yes")
