"""Linear warm-up then cosine decay to 0, as one ``LambdaLR`` stepped per optimizer step.

This is the shape most recipes train with today (and how Hugging Face's schedule helpers
build it: one multiplicative factor per step in a ``LambdaLR``): the factor rises linearly
from ``1 / warmup`` at the first step to 1 at step ``warmup``, then follows half a cosine
from 1 down to 0 at step ``total``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["warmup_cosine", "warmup_cosine_factor"]


def warmup_cosine_factor(step: int, warmup: int, total: int) -> float:
    """The learning-rate factor before optimizer step ``step + 1`` (``step`` counts the
    steps already taken, as ``LambdaLR`` passes it): ``(step + 1) / warmup`` during the
    warm-up, then ``(1 + cos(pi * p)) / 2`` with ``p = (step - warmup) / (total - warmup)``,
    and 0 from ``total`` on."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return 0.0
    progress = (step - warmup) / (total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` with :func:`warmup_cosine_factor`.

    Args:
        warmup: warm-up steps, ``0 <= warmup < total``.
        total: optimizer steps of the whole run; the factor reaches 0 there.

    Raises:
        ValueError: naming the value when ``total`` is not a positive integer or ``warmup``
            is not in ``[0, total)``.
    """
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"warmup_cosine total must be a positive integer, got total={total!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < total:
        raise ValueError(f"warmup_cosine warmup must be an integer in [0, total={total}), got warmup={warmup!r}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine_factor(step, warmup, total))
