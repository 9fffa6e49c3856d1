"""The learning-rate decays a scheduler has still ahead, where the scheduler states them.

Egeria's rule holds its freezes until a step schedule's last decay has passed: a module
frozen at a higher learning rate misses what the later decays teach it, and on
resnet-fmnist that cost about 0.1 points of test accuracy, while a freeze after the last
decay cost nothing measurable (benchmarks/README.md, "Where a freeze costs").

Only schedulers that name their decay points can answer: ``MultiStepLR`` (its
``milestones``) and a ``SequentialLR`` whose last part is one (a warm-up then a step
schedule). The count is in the scheduler's own steps (``last_epoch``), so a scheduler
stepped once per epoch answers as well as one stepped once per optimizer step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["decays_ahead"]


def decays_ahead(scheduler: Any) -> int | None:
    """How many of ``scheduler``'s stated learning-rate changes are still to come; None
    when it states none (no scheduler, a continuous or open-ended schedule such as
    cosine, linear, inverse square root or ``StepLR``)."""
    if scheduler is None:
        return None
    name = type(scheduler).__name__
    if name == "MultiStepLR":
        milestones = getattr(scheduler, "milestones", None)
        step = getattr(scheduler, "last_epoch", None)
        if milestones is None or not isinstance(step, int):
            return None
        # A Counter: a milestone named twice decays twice; gamma 1 changes nothing.
        if getattr(scheduler, "gamma", None) == 1:
            return 0
        return sum(count for milestone, count in dict(milestones).items() if milestone > step)
    if name == "SequentialLR":  # e.g. a warm-up, then a step schedule
        parts = getattr(scheduler, "_schedulers", None)
        # The last part waits at its own step 0 until the switch to it, so its decays
        # count as ahead until then.
        return decays_ahead(parts[-1]) if parts else None
    return None
