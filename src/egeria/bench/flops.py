"""FLOPs a training step actually executes, counted by torch's own FLOP counter."""

from __future__ import annotations

from typing import Callable

from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_flops"]


def count_flops(step: Callable[[], None]) -> float:
    """Runs ``step`` once under ``torch.utils.flop_counter.FlopCounterMode`` and returns the
    FLOPs of the matrix multiplications and convolutions it ran, forward and backward.
    Frozen modules' skipped backward (and, later, a skipped cached forward) is not
    counted, because it does not run."""
    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())
