"""When to unfreeze: learning-rate annealing restarts training of frozen modules (paper 4.2.2).

A rule is any callable taking an :class:`UnfreezeContext` and returning True to unfreeze
every module. The default, :class:`LRDropRule`, fires when the learning rate has fallen
by a factor (10 by default) since the frontmost module froze, as after a step decay.
Cyclical schedules (cosine with restarts, cyclical LR, one-cycle) need a rule of the
user's own, e.g. one that unfreezes at each cycle start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["UnfreezeContext", "UnfreezeRule", "LRDropRule", "current_lr", "rises_again"]

# Relative slack so that 0.1 * 0.1 (= 0.010000000000000002) still counts as a 10x drop.
_RELATIVE_SLACK = 1e-6



def rises_again(lrs: Sequence[float], factor: float) -> int | None:
    """The first step at which a schedule's learning rate, having fallen ``factor`` times
    or more below its highest so far, has risen ``factor`` times or more above its lowest
    since (a cycle restarts: cosine with restarts, cyclical LR), where the LR-drop rule
    unfreezes at every cycle; None for a schedule that never does (a warm-up rises before
    it falls, and one-cycle's one rise does too)."""
    high = low = None  # the highest learning rate so far, and the lowest since it
    for step, lr in enumerate(map(float, lrs)):
        if high is None or low is None:
            high = low = lr
            continue
        fell = low < high and low * factor <= high * (1 + _RELATIVE_SLACK)
        if fell and lr >= factor * low * (1 - _RELATIVE_SLACK):
            return step
        if lr > high:
            high = low = lr  # still rising (a warm-up): no fall yet
        else:
            low = min(low, lr)
    return None


@dataclass(frozen=True)
class UnfreezeContext:
    """What an unfreeze rule may look at, at a step boundary."""

    step: int  # optimizer steps taken so far
    lr: float  # the largest learning rate among the optimizer's param groups now
    lr_at_freeze: float | None  # that learning rate when the frontmost module froze
    freeze_step: int | None  # the step at which the frontmost module froze
    frozen: Sequence[str]  # names of the frozen modules


UnfreezeRule = Callable[[UnfreezeContext], bool]


@dataclass(frozen=True)
class LRDropRule:
    """Unfreezes when the learning rate has dropped by ``factor`` or more since the first freeze."""

    factor: float = 10.0

    def __call__(self, ctx: UnfreezeContext) -> bool:
        if not ctx.frozen or ctx.lr_at_freeze is None:
            return False
        return ctx.lr * self.factor <= ctx.lr_at_freeze * (1 + _RELATIVE_SLACK)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The largest learning rate among the optimizer's param groups."""
    return max(float(group["lr"]) for group in optimizer.param_groups)
