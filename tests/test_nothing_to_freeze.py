"""A run in which nothing can ever freeze says so once, with what to change."""

from __future__ import annotations

import logging

import torch
from torch import nn

import egeria
from tiny import Chain, batches, quick_config, train


class EqualLayers(nn.Module):
    """An MLP of two equal layers and a small head: its first layer module does 42% of
    its weight computation."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.second(torch.relu(self.first(x)))))


def _warnings(caplog) -> list[str]:
    return _told(caplog, "freeze nothing")


def test_a_first_module_over_the_cap_warns_once_naming_it_and_the_setting(caplog):
    torch.manual_seed(0)
    model = EqualLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config(max_frozen_flops=0.25))
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 6)
        eg.state_dict()
    eg.close()
    found = _warnings(caplog)
    assert len(found) == 1, found
    # its weight does 64 of the 152 multiply-adds per sample (8x8, 8x8, 8x3)
    assert "'first' holds 42% of the model's weight computation" in found[0] and "max_frozen_flops=0.25" in found[0]


def test_a_model_the_cap_leaves_room_in_does_not_warn(caplog):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config(max_frozen_flops=0.25))
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 6)
    eg.close()
    assert _warnings(caplog) == []


def _told(caplog, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and words in r.getMessage()]


def test_a_state_loaded_again_does_not_repeat_the_warning(caplog):
    torch.manual_seed(0)
    model = EqualLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config(max_frozen_flops=0.25))
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 6)
        eg.load_state_dict(eg.state_dict())
    eg.close()
    assert len(_warnings(caplog)) == 1


def test_a_controller_that_never_reads_warns_once_with_its_notes(caplog):
    """Readings that are never finite (here the stem's eval-mode output is NaN, as an
    overflowing reference would give): after ten answers without one, a warning."""
    torch.manual_seed(0)
    model = Chain()
    model.stem[0].register_forward_hook(lambda module, args, out: out if module.training else out * float("nan"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config())
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 40)
    eg.close()
    assert eg.frozen == [] and eg.history == []
    found = _told(caplog, "without a plasticity reading")
    assert len(found) == 1 and "non-finite" in found[0] and "reference_precision='fp32'" in found[0], found


def test_a_run_that_reads_does_not_warn_of_missing_readings(caplog):
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config())
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * 40)
    eg.close()
    assert eg.history and _told(caplog, "without a plasticity reading") == []


def _ended_with_nothing(caplog) -> list[str]:
    return _told(caplog, "with nothing frozen")


def _run_to_the_end(caplog, steps: int, **config) -> egeria.Egeria:
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=quick_config(**config), total_steps=steps)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        train(model, opt, eg, batches(1) * steps)
        eg.close()
    return eg


def test_a_run_whose_loss_never_settles_says_so_at_its_last_step(caplog):
    eg = _run_to_the_end(caplog, 30, bootstrap_change_rate=1e-12)
    found = _ended_with_nothing(caplog)
    assert eg.stage == "bootstrap" and len(found) == 1, found
    assert "(step 30)" in found[0] and "bootstrapping never ended" in found[0] and "n=1" in found[0]


def test_a_run_whose_front_never_settles_says_what_it_read_at_its_last_step(caplog):
    eg = _run_to_the_end(caplog, 30, rule="egeria", horizon=1e-9, floor_ratio=0)
    found = _ended_with_nothing(caplog)
    assert not any(e.action == "freeze" for e in eg.events) and eg.history and len(found) == 1, found
    front = [r for r in eg.history if r["module"] == eg.modules[0]][-1]  # the first module's last reading
    assert f"the front module {front['module']!r} had not settled by its last reading (step {front['step']})" in found[0]
    # the conditions that blocked, with their figures, and none that held: at the last step no
    # drift is still to come (the horizon holds), the slope had not settled and the learning
    # rate, constant, never came down to the bound
    span = eg.policy.spans.span  # W x D steps: 3 x 1 here
    assert front["stale_steps"] < span and f"for {front['stale_steps']} of the span's {span} steps" in found[0]
    assert "horizon" not in found[0] and front["outlook_share"] == 0
    assert "learning rate 1 of its peak, above the 0.01 that speed='safe' allows" in found[0]
    assert "the schedule never comes down that low" in found[0]


def test_a_run_that_froze_does_not_say_nothing_froze(caplog):
    eg = _run_to_the_end(caplog, 60)
    assert any(e.action == "freeze" for e in eg.events) and _ended_with_nothing(caplog) == []
