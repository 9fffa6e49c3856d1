"""The training harness shared by the demo, ``egeria bench`` and the benchmark scripts.

Egeria itself never owns the training loop: a user calls :meth:`egeria.Egeria.step` from
theirs. The library's own runs (the demo, the benchmark CLI, ``benchmarks/*.py``) all
train the same way, so they share this one loop instead of spelling it out each::

    for epoch in 1..epochs:
        model.train()
        for batch in batches():            # data_s: waiting for the batch
            loss = loss_fn(model, batch)   # time_s starts here
            optimizer.zero_grad(set_to_none=True)
            loss.backward()                # forward and backward: FLOPs counted here (apart)
            optimizer.step()
            scheduler.step()               # when given
            egeria.step(loss)              # when given; time_s ends here
            on_step(result)
            every eval_every steps (None: each epoch end) and after the last step:
                model.eval(); evaluate(result); model.train()   # not timed

Only the step is timed (``time.perf_counter``); callbacks and evaluation are not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_int

if TYPE_CHECKING:
    from .flops import StepFlops
    from ..decision import Decision
    from ..engine import Egeria

__all__ = ["LossFn", "StepResult", "classification_loss", "forward_backward", "train"]

#: ``loss(model, batch) -> scalar tensor``: the forward pass and the loss of one batch.
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """What one training step of :func:`train` did."""

    # Optimizer steps so far, this one included (the first step is 1).
    step: int
    # The epoch this step belongs to (the first epoch is 1).
    epoch: int
    # The step's training loss.
    loss: float
    # Seconds of the step: forward, backward, optimizer, scheduler, ``egeria.step`` (and
    # the FLOP counting on the steps that count).
    time_s: float
    # Seconds spent waiting for the batch before the step (the loader's time).
    data_s: float
    # Sum of ``time_s`` over all steps so far, this one included.
    train_time_s: float
    # FLOPs of the step's forward and backward (counted on the first step of each frozen
    # set, carried over to the next steps with the same set); None when not counting.
    flops: float | None
    # Egeria's decisions at this step (empty without Egeria).
    decisions: tuple[Decision, ...]
    # FLOPs of the step's backward alone (a part of ``flops``); None when not counting.
    backward_flops: float | None = None


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The :data:`LossFn` of a classifier: cross-entropy of ``model(inputs)`` (shape
    ``(batch, classes)``) against ``labels`` (shape ``(batch,)``), ``batch = (inputs, labels)``."""
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def forward_backward(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss: LossFn) -> torch.Tensor:
    """The loss of ``batch`` and its gradients, the optimizer's old gradients cleared first.

    Returns:
        The loss (a scalar tensor, still attached to the graph it was computed in).
    """
    value = loss(model, batch)
    _backward(optimizer, value)
    return value


def _backward(optimizer: torch.optim.Optimizer, value: torch.Tensor) -> None:
    """Clears the optimizer's old gradients and backpropagates ``value``."""
    optimizer.zero_grad(set_to_none=True)
    value.backward()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[], Iterable[Any]],
    loss: LossFn,
    *,
    epochs: int = 1,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    egeria: Egeria | None = None,
    count_flops: bool = False,
    on_step: Callable[[StepResult], None] | None = None,
    evaluate: Callable[[StepResult], None] | None = None,
    eval_every: int | None = None,
) -> list[StepResult]:
    """Trains ``model`` for ``epochs`` passes over ``batches()``; see the module docstring.

    Args:
        model: the model; put in train mode at the start of each epoch and after each
            evaluation.
        optimizer: stepped once per batch.
        batches: called at the start of each epoch for that epoch's batches, in order.
        loss: ``loss(model, batch) -> scalar tensor``.
        epochs: passes over the data.
        scheduler: stepped after each optimizer step when given.
        egeria: ``egeria.step(loss)`` after each optimizer (and scheduler) step when given.
        count_flops: count the FLOPs of the forward and of the backward with
            :func:`egeria.bench.flops.count_forward_backward` on the first step and on the
            first step after each change of ``egeria.frozen``.
        on_step: called after each step with its result.
        evaluate: called with the model in eval mode every ``eval_every`` steps and after
            the last step, with the result of the step just done; its time is not counted.
        eval_every: steps between evaluations; None evaluates at the end of each epoch.

    Returns:
        Every step's result, in order.

    Raises:
        ValueError: ``epochs`` or ``eval_every`` is not a positive integer.
    """
    for name, value in (("epochs", epochs), ("eval_every", eval_every)):
        if value is not None:
            check_int(value, f"train {name}")
    counter = _FlopCounter(egeria) if count_flops else None
    results: list[StepResult] = []
    evaluated = 0
    train_time = 0.0

    def run_evaluation(result: StepResult) -> None:
        nonlocal evaluated
        model.eval()
        evaluate(result)
        model.train()
        evaluated = result.step

    for epoch in range(1, epochs + 1):
        model.train()
        waiting = time.perf_counter()
        for batch in batches():
            started = time.perf_counter()
            if counter is not None:
                value, flops = counter.run(lambda: loss(model, batch), lambda v: _backward(optimizer, v))
            else:
                value, flops = forward_backward(model, optimizer, batch, loss), None
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            decisions = tuple(egeria.step(value)) if egeria is not None else ()
            # Read before the clock stops: on an accelerator it waits for the step's last kernel.
            loss_value = value.detach().item()
            elapsed = time.perf_counter() - started
            train_time += elapsed
            result = StepResult(
                len(results) + 1, epoch, loss_value, elapsed, started - waiting, train_time,
                None if flops is None else flops.total, decisions, None if flops is None else flops.backward,
            )
            results.append(result)
            if on_step is not None:
                on_step(result)
            if evaluate is not None and eval_every is not None and result.step % eval_every == 0:
                run_evaluation(result)
            waiting = time.perf_counter()
        if evaluate is not None and eval_every is None and results and evaluated != results[-1].step:
            run_evaluation(results[-1])
    if evaluate is not None and results and evaluated != results[-1].step:
        run_evaluation(results[-1])
    return results


class _FlopCounter:
    """Counts a step's FLOPs when the frozen set changed since the last count."""

    def __init__(self, egeria: Egeria | None) -> None:
        self._egeria = egeria
        self._counted_for: tuple[str, ...] | None = None
        self._flops: StepFlops | None = None

    def run(
        self, forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None]
    ) -> tuple[torch.Tensor, StepFlops | None]:
        """Runs ``backward(forward())``, counting its FLOPs where the frozen set is new."""
        from .flops import count_forward_backward

        frozen = tuple(self._egeria.frozen) if self._egeria is not None else ()
        if frozen == self._counted_for:
            value = forward()
            backward(value)
            return value, self._flops
        value, self._flops = count_forward_backward(forward, backward)
        self._counted_for = frozen
        return value, self._flops
