"""FLOPs of a step, the backward apart: oracle counts on a tiny two-layer model before and
after its first layer freezes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from egeria.bench.flops import StepFlops, count_flops, count_forward_backward, share


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, StepFlops]:
    return count_forward_backward(lambda: model(x).sum(), lambda loss: loss.backward())


def test_forward_and_backward_are_counted_apart() -> None:
    model, x = _model(), torch.randn(5, 8)
    loss, flops = _step(model, x)
    # Forward: 2*5*8*16 + 2*5*16*4. Backward: both weight gradients and the second
    # layer's input gradient (the input needs none).
    assert flops == StepFlops(forward=1280 + 640, backward=1280 + 640 + 640)
    assert flops.total == count_flops(lambda: model(x).sum().backward())
    assert loss.requires_grad and model[0].weight.grad is not None  # the step really ran


def test_backward_share_after_a_freeze() -> None:
    model, x = _model(), torch.randn(5, 8)
    _, first = _step(model, x)
    model[0].requires_grad_(False)
    _, frozen = _step(model, x)
    # Only the second layer's weight gradient is left: a quarter of the backward, while
    # the frozen layer holds 144 of the 212 parameters.
    assert frozen.forward == first.forward and frozen.backward == 640
    assert share(frozen.backward, first.backward) == pytest.approx(0.25)


def test_share_of_unknowns_is_none() -> None:
    assert share(None, 10.0) is None and share(5.0, None) is None and share(5.0, 0.0) is None


def test_the_harness_records_the_backward_apart_and_its_drop_after_a_freeze() -> None:
    import egeria
    from egeria.bench.harness import classification_loss, train
    from tiny import Chain, batches, quick_config

    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eg = egeria.Egeria(model, opt, config=quick_config(policy="static", policy_options={"count": 2, "at_step": 2}))
    results = train(model, opt, lambda: batches(4), classification_loss, egeria=eg, count_flops=True)
    eg.close()
    backward = [r.backward_flops for r in results]
    assert backward[:2] == [backward[0]] * 2 and backward[2:] == [backward[2]] * 2
    assert 0 < backward[2] < backward[0]
    forward = [r.flops - r.backward_flops for r in results]
    assert forward == [forward[0]] * 4  # freezing leaves the forward alone
    without = train(model, opt, lambda: batches(1), classification_loss)
    assert without[0].flops is None and without[0].backward_flops is None
