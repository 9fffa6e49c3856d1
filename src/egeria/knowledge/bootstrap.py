"""The bootstrapping stage: no freezing while the training loss still changes fast (paper 3)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.statecheck import Spec, boolean, items, number, record

__all__ = ["BootstrapMonitor"]

logger = logging.getLogger(__name__)


@dataclass
class BootstrapMonitor:
    """Watches the smoothed training loss and says when bootstrapping is over.

    The loss is smoothed by averaging it over each interval of n steps; bootstrapping
    ends at the first interval whose mean differs from the previous interval's mean by
    less than ``change_rate`` of it.

    Args:
        change_rate: the relative change below which the loss counts as settled.
    """

    change_rate: float
    means: list[float] = field(default_factory=list)
    done: bool = False
    pending: list[Any] = field(default_factory=list)  # this interval's losses (tensors or floats)

    def record(self, loss: Any) -> None:
        """Keeps one step's loss (a tensor stays on its device until the interval ends)."""
        self.pending.append(loss)

    def end_interval(self) -> bool:
        """Takes the losses recorded in this interval; returns True once bootstrapping is over."""
        losses = [float(v) for v in self.pending]  # one device sync per interval
        self.pending = []
        finite = [v for v in losses if math.isfinite(v)]
        if len(finite) < len(losses):
            logger.warning("ignored %d non-finite training losses in this interval", len(losses) - len(finite))
        if not finite or self.done:
            return self.done
        mean = math.fsum(finite) / len(finite)
        if self.means:
            previous = self.means[-1]
            change = abs(mean - previous) / max(abs(previous), 1e-12)
            logger.debug("loss %.5g -> %.5g, relative change %.3g", previous, mean, change)
            if change < self.change_rate:
                self.done = True
        self.means = (self.means + [mean])[-2:]
        return self.done

    def state_dict(self) -> dict:
        pending = [v for v in map(float, self.pending) if math.isfinite(v)]
        return {"change_rate": self.change_rate, "means": list(self.means), "done": self.done, "pending": pending}

    @staticmethod
    def state_spec() -> Spec:
        return record(
            {"change_rate": number(0), "means": items(number(), most=2), "done": boolean, "pending": items(number())},
            optional=("means", "done", "pending"),
        )

    @classmethod
    def from_state(cls, state: dict) -> BootstrapMonitor:
        return cls(**state)
