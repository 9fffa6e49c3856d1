"""A reading measures the weights' motion: both of its sides normalize with the reference's
running statistics, so batch norm's wandering running mean and variance read as no movement
(docs/decisions/040-readings-hold-running-statistics.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import egeria
from egeria.knowledge.controller import Controller
from egeria.knowledge.executors import InlineExecutor
from egeria.knowledge.protocol import Readout, Request
from egeria.knowledge.rule import RuleSettings
from egeria.knowledge.service import ControllerSpec
from egeria.knowledge.weights import float_snapshot


def _normed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 4),
    ).eval()


def _controller(model: nn.Module, precision: str = "bf16"):
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    spec = ControllerSpec(
        partition, float_snapshot(model), precision,
        # a window long enough that no module reads quiet for the evidence's span while
        # the tests read: both modules stay watched
        RuleSettings(window=5, tolerance_ratio=0.2, floor_ratio=2.0, horizon=0.5),
        threads=1, cpu_threshold=None, span=2,
    )
    return partition, InlineExecutor(spec)


def _evaluate(executor, model, seq: int, batch: torch.Tensor):
    executor.offer(Request(seq, 0, seq, 0, ((batch,), {})))
    executor.readout(Readout(seq, None, {k: v.clone() for k, v in model.state_dict().items()}))
    [result] = executor.poll()
    return result


def _wander(model: nn.Module, seq: int) -> None:
    """Moves the running statistics and nothing else: training-mode forward passes on
    batches of another mean and scale, no optimizer step."""
    generator = torch.Generator().manual_seed(100 + seq)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(32, 8, generator=generator) * (1 + 0.5 * seq) + seq)
    model.eval()


def _statistics(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers() if b.is_floating_point()]


def test_statistics_that_wander_while_the_weights_stand_still_read_as_the_floor():
    model = _normed()
    _, executor = _controller(model)
    controller = executor.service.controller
    x = torch.randn(16, 8)
    weights = [p.clone() for p in model.parameters()]
    floors, results = [], []
    for seq in range(1, 6):
        before = _statistics(model)
        _wander(model, seq)
        assert all(not torch.equal(a, b) for a, b in zip(before, _statistics(model)))  # they did move
        results.append(_evaluate(executor, model, seq, x))
        floors.append(dict(controller.floors))
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    # Each reading compares the weights with themselves under the statistics of the previous
    # refresh: it reads exactly the floor measured at that refresh (with those statistics).
    for result, floor in zip(results[2:], floors[1:]):
        assert [row["plasticity"] for row in result.readings] == pytest.approx(
            [floor[0], floor[1]], rel=1e-9)


def test_without_holding_them_the_same_wander_reads_far_above_the_floor(monkeypatch):
    # The contrast that shows the statistics are what the test above holds still.
    monkeypatch.setattr(Controller, "_statistics", lambda self: {})
    model = _normed()
    _, executor = _controller(model)
    controller = executor.service.controller
    x = torch.randn(16, 8)
    results, floors = [], []
    for seq in range(1, 6):
        _wander(model, seq)
        results.append(_evaluate(executor, model, seq, x))
        floors.append(dict(controller.floors))
    for result, floor in zip(results[2:], floors[1:]):
        normed = result.readings[1]  # module 0 is a Linear alone: no statistics
        assert normed["plasticity"] > 100 * floor[1]


def _outputs(model: nn.Module, x: torch.Tensor, blocks: list[str]) -> list[torch.Tensor]:
    seen = {}
    handles = [model.get_submodule(b).register_forward_hook(
        lambda _m, _a, out, b=b: seen.__setitem__(b, out.detach())) for b in blocks]
    with torch.no_grad():
        model.eval()(x)
    for h in handles:
        h.remove()
    return [seen[b] for b in blocks]


def test_a_reading_is_the_distance_of_the_new_weights_from_the_old_under_the_old_statistics():
    model = _normed()
    partition, executor = _controller(model, precision="fp32")
    x = torch.randn(16, 8)
    blocks = [partition.modules[i].output_block for i in (0, 1)]
    _evaluate(executor, model, 1, x)  # builds the reference
    old = copy.deepcopy(model)
    with torch.no_grad():  # the weights move and, in the same steps, the statistics wander
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    _wander(model, 2)
    result = _evaluate(executor, model, 2, x)
    held = copy.deepcopy(model)
    held.load_state_dict({**model.state_dict(), **{k: v for k, v in old.state_dict().items()
                                                  if k in dict(old.named_buffers())}})
    expected = [float(egeria.sp_loss(a, b)) for a, b in zip(_outputs(held, x, blocks), _outputs(old, x, blocks))]
    assert [row["plasticity"] for row in result.readings] == pytest.approx(expected, rel=1e-5)
    everything = [float(egeria.sp_loss(a, b)) for a, b in zip(_outputs(model, x, blocks), _outputs(old, x, blocks))]
    assert everything[0] == pytest.approx(expected[0], rel=1e-6)  # a Linear alone: no statistics
    assert abs(everything[1] - expected[1]) > 0.1 * expected[1]  # batch norm's: their share is not small here


def test_a_resumed_controller_reads_with_the_statistics_it_saved():
    model = _normed()
    _, executor = _controller(model)
    x = torch.randn(16, 8)
    for seq in range(1, 4):
        _wander(model, seq)
        _evaluate(executor, model, seq, x)
    # a checkpoint: the model and the controller saved together, loaded together
    saved = executor.service.controller.state_dict(dict(model.state_dict()))
    twin = copy.deepcopy(model)
    _, resumed = _controller(twin)
    resumed.service.controller.load_state_dict(copy.deepcopy(saved), dict(twin.state_dict()))
    _wander(model, 4)
    _wander(twin, 4)
    a = _evaluate(executor, model, 4, x)
    b = _evaluate(resumed, twin, 4, x)
    assert [r["plasticity"] for r in a.readings] == [r["plasticity"] for r in b.readings]


def test_a_network_without_running_statistics_reads_exactly_as_without_the_hold(monkeypatch):
    # LayerNorm and a constant buffer: nothing the forward pass accumulates, so the hold
    # changes no bit (the suite's Transformers read as before record 040)
    def layer_normed() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                              nn.ReLU(), nn.Linear(16, 4)).eval()
        model[1].register_buffer("scale", torch.ones(16))  # constant: the hold copies it unchanged
        return model

    def readings() -> list[float]:
        model = layer_normed()
        _, executor = _controller(model)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        out = []
        for seq in range(1, 6):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seq)))
            out += [(r["plasticity"], r["floor"]) for r in _evaluate(executor, model, seq, x).readings]
        return out

    held = readings()
    monkeypatch.setattr(Controller, "_statistics", lambda self: {})
    assert held and readings() == held
