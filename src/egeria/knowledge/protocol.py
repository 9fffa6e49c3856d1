"""What the training side and the controller say to each other (paper 4.1.2, Figure 6).

One evaluation is two messages from the worker: a :class:`Request` on the input queue when
the evaluation step's forward pass starts (the batch, so the controller can run the
reference while the worker trains), and a :class:`Readout` on the training-output queue
at the step's end (the hooked training activation, if any, and a copy of the weights the
controller refreshes from). Every request is followed by exactly one readout, in order.
The controller answers each evaluation with one :class:`Result` on the decision queue.
Control messages (restart, state, load, stop) go on a separate, unbounded queue.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from ..decision import Decision

__all__ = ["Request", "Readout", "Result", "Control", "Reply", "result_to_json", "result_from_json"]


@dataclass
class Request:
    """An evaluation's input batch.

    Attributes:
        seq: the worker's running number of the evaluation (1, 2, ...).
        generation: bumped by every restart of the controller's watch; older ones are stale.
        step: the optimizer step whose forward pass produced the batch.
        module: index of the watched layer module.
        batch: the model's call arguments ``(args, kwargs)`` on the CPU.
        final_weights: weights of modules frozen since the previous request (their final
            values), or None.
        final_modules: indices of those modules.
        lr: the learning rate the evaluated step trained at (None: not known).
        mass_ahead: the learning-rate mass still to come: the sum of the learning rates of
            the steps after the evaluated one (None: the schedule is not known).
        lr_peak: the schedule's highest learning rate (None: the schedule is not known).
        regime: the step of the schedule's latest jump of 2x or more at or before ``step``
            (-1: none yet; None: the schedule is not known): readings of one regime share it.
        read: take a reading (compare the model with the reference refreshed before it).
        refresh: refresh the reference from the readout's weights afterwards (a reading
            ``lag`` steps later compares with it).
        lag: D, the steps a reading's drift covers: the rule's spans are W x D steps (None:
            the controller's own).
    """

    seq: int
    generation: int
    step: int
    module: int
    batch: tuple
    final_weights: Any = None
    final_modules: tuple[int, ...] = ()
    lr: float | None = None
    mass_ahead: float | None = None
    lr_peak: float | None = None
    regime: int | None = None
    read: bool = True
    refresh: bool = True
    lag: int | None = None


@dataclass
class Readout:
    """The end of an evaluation step.

    Attributes:
        seq: the request it completes.
        activation: the training activations at the watched modules, front first
            (``activation_mode`` "train"), or None to let the controller compute them from
            ``weights``.
        weights: the model's state after the step's update, for the modules the
            controller refreshes (a mapping or a packed copy); None cancels the evaluation.
    """

    seq: int
    activation: list[torch.Tensor] | None
    weights: Any


@dataclass
class Result:
    """The controller's answer to one evaluation.

    Attributes:
        seq, generation, step: those of the request.
        module: the front module the controller watched (its own view of the frozen set,
            which runs ahead of the training side's by the decisions not yet applied).
        readings: the plasticity readings (history rows, one per watched module, front
            first); empty when none was taken.
        decision: a freeze decision, or None.
        note: why there is no reading ("stale", "cancelled", "building", "refreshed",
            "non-finite").
        seconds: controller time spent on the evaluation.
        waited_s: time the controller waited for a quiet CPU before it.
    """

    seq: int
    generation: int
    step: int
    module: int
    readings: list[dict] = field(default_factory=list)
    decision: Decision | None = None
    note: str = ""
    seconds: float = 0.0
    waited_s: float = 0.0


def result_to_json(result: Result) -> dict:
    """A JSON-safe dict of ``result`` (for checkpoints)."""
    out = asdict(result)
    if result.decision is not None:
        out["decision"]["modules"] = list(result.decision.modules)
    return out


def result_from_json(entry: dict) -> Result:
    decision = entry.get("decision")
    fields = dict(entry)
    fields["decision"] = None if decision is None else Decision(**{**decision, "modules": tuple(decision["modules"])})
    return Result(**fields)


@dataclass
class Control:
    """A control message: ``kind`` is "restart", "state", "load" or "stop"."""

    kind: str
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """A control answer on the decision queue: ``kind`` is "ready", "state", "loaded" or
    "failed" (the controller raised; ``payload`` is the traceback text)."""

    kind: str
    payload: Any = None
