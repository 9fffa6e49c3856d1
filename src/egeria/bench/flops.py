"""FLOPs a training step actually executes, counted by torch's own FLOP counter.

A frozen module's skipped backward (and, later, a skipped cached forward) is not counted,
because it does not run. The backward is counted apart from the forward: freezing the
front of a CNN saves few parameters but much of the backward's FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

from torch.utils.flop_counter import FlopCounterMode

__all__ = ["StepFlops", "count_flops", "count_forward_backward", "share"]

T = TypeVar("T")


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step's matrix multiplications and convolutions."""

    # The forward pass and the loss.
    forward: float
    # The backward pass (``loss.backward()``).
    backward: float

    @property
    def total(self) -> float:
        """Forward and backward."""
        return self.forward + self.backward


def count_flops(step: Callable[[], None]) -> float:
    """Runs ``step`` once under ``torch.utils.flop_counter.FlopCounterMode`` and returns the
    FLOPs of the matrix multiplications and convolutions it ran, forward and backward."""
    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())


def count_forward_backward(forward: Callable[[], T], backward: Callable[[T], None]) -> tuple[T, StepFlops]:
    """Runs ``backward(forward())`` once under :func:`count_flops`, with the backward
    counted again on its own (FLOP counters nest: both count what runs inside both).

    Args:
        forward: computes the loss, e.g. ``lambda: loss_fn(model, batch)``.
        backward: takes what ``forward`` returned and runs the backward pass.

    Returns:
        What ``forward`` returned, and the step's :class:`StepFlops`.
    """
    held: list[T] = []
    backward_flops: list[float] = []

    def step() -> None:
        held.append(forward())
        with FlopCounterMode(display=False) as counter:
            backward(held[0])
        backward_flops.append(float(counter.get_total_flops()))

    total = count_flops(step)
    return held[0], StepFlops(forward=total - backward_flops[0], backward=backward_flops[0])


def share(flops: float | None, first: float | None) -> float | None:
    """``flops / first``: the share of a first (nothing frozen) measurement still computed;
    None where either is unknown or ``first`` is 0."""
    if flops is None or first is None or not first:
        return None
    return flops / first
