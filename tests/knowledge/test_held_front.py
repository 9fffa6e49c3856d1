"""Both sides of a reading run one frozen front: a module the controller decided to freeze
trains on until the training side applies the decision, and until its final weights reach
the reference the controller runs it as the reference holds it, so readings and floors
measure the watched modules alone (docs/decisions/041-quiet-modules-pass-the-cap.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import egeria
from egeria.knowledge.controller import Controller
from egeria.knowledge.protocol import Readout, Request
from egeria.knowledge.rule import RuleSettings
from egeria.knowledge.weights import float_snapshot


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(),
        nn.Linear(16, 16), nn.ReLU(),
        nn.Linear(16, 16), nn.ReLU(),
        nn.Linear(16, 4),
    ).eval()


def _run(front_moves: bool, hold: bool = True) -> tuple[dict[int, float], list[float]]:
    """Module 0 decided frozen; a refresh-only request (readings further apart than D) while
    it still trains, then a reading. Returns the floors measured at that refresh and the
    reading's values."""
    model = _model()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    controller = Controller(partition, float_snapshot(model), precision="bf16",
                            rule=RuleSettings(window=3, tolerance_ratio=0.2, floor_ratio=8.0), span=partition.freezable)
    if not hold:
        controller._held_front = lambda: {}
    controller.restart(generation=0, frozen=1, window=3)  # module 0 decided frozen, not yet applied
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    g, front = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)

    def send(seq: int, read: bool) -> list[dict]:
        request = Request(seq, 0, 20 * seq, 1, ((x,), {}), read=read)
        reference = controller.reference_activation(request)
        readout = Readout(seq, None, {k: v.clone() for k, v in model.state_dict().items()})
        return controller.finish(request, reference, readout).readings or []

    def train_on() -> None:
        with torch.no_grad():
            if front_moves:  # the decided module's last steps before the decision applies
                model[0].weight.add_(0.05 * torch.randn(model[0].weight.shape, generator=front))
            for layer in (model[2], model[4]):  # the watched modules move a little
                layer.weight.add_(1e-3 * torch.randn(layer.weight.shape, generator=g))

    send(1, read=True)  # builds the reference, module 0 final in it
    train_on()
    send(2, read=False)  # refresh only: the floors are measured here
    floors = dict(controller.floors)
    train_on()
    readings = [row["plasticity"] for row in send(3, read=True)]
    return floors, readings


def test_a_module_decided_frozen_reads_as_frozen_until_its_final_weights_arrive():
    still_floors, still_readings = _run(front_moves=False)
    floors, readings = _run(front_moves=True)
    assert set(floors) == {1, 2} and len(readings) == 2
    assert floors == still_floors  # the module's last steps are in neither floor nor reading
    assert readings == pytest.approx(still_readings, rel=0, abs=0)
    # without the held front they are in both: the floors far above the reference's own error
    loose_floors, loose_readings = _run(front_moves=True, hold=False)
    assert all(loose_floors[i] > 100 * floors[i] for i in floors)
    assert all(a > b for a, b in zip(loose_readings, readings))
