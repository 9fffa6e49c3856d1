"""Freezing on a fixed schedule: FreezeOut, a linear schedule (as in MosaicML Composer),
static freezing at a given step, and none (plain training through the same loop)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import StatelessPolicy, StepInfo, require_total_steps

__all__ = ["NoFreezing", "FreezeOut", "LinearSchedule", "StaticFreezing"]

_SCALINGS = {"linear": 1, "squared": 2, "cubic": 3}


@dataclass
class NoFreezing(StatelessPolicy):
    """Plain training: nothing is ever frozen (the baseline for every comparison)."""

    name: str = "none"

    def target(self, info: StepInfo) -> int | None:
        return 0


@dataclass
class FreezeOut(StatelessPolicy):
    """FreezeOut (Brock et al., 2017): module i stops training at a fixed share of the run.

    Module i of L freezable modules stops at ``t_i = scale(t0 + (1 - t0) * i / L)``, with
    ``scale`` the identity, square or cube; defaults t0 = 0.8, cubic, as in the paper's
    best setting. (FreezeOut also anneals each layer's learning rate to zero by t_i; here,
    as for every policy, only the freezing time differs: the optimizer is left as it is.)

    Args:
        t0: the share of training at which the first module stops, before scaling.
        scaling: ``"linear"``, ``"squared"`` or ``"cubic"``.
    """

    t0: float = 0.8
    scaling: str = "cubic"
    name: str = "freezeout"

    def __post_init__(self) -> None:
        if not 0 < self.t0 <= 1:
            raise ValueError(f"FreezeOut t0={self.t0!r} must be in (0, 1]")
        if self.scaling not in _SCALINGS:
            raise ValueError(f"FreezeOut scaling={self.scaling!r} is not one of {sorted(_SCALINGS)}")

    def stop_times(self, freezable: int) -> list[float]:
        """The share of training at which each freezable module stops."""
        power = _SCALINGS[self.scaling]
        return [(self.t0 + (1 - self.t0) * i / freezable) ** power for i in range(freezable)]

    def target(self, info: StepInfo) -> int | None:
        progress = require_total_steps(info, self.name)
        return sum(1 for t in self.stop_times(info.freezable) if progress >= t)


@dataclass
class LinearSchedule(StatelessPolicy):
    """Freezes modules front to back at a constant pace, as MosaicML Composer's layer freezing.

    Nothing freezes before ``start`` of training; from there the frozen share grows
    linearly to ``final`` of the freezable modules at the end of training.

    Args:
        start: share of training before the first freeze (Composer's ``freeze_start``).
        final: share of the freezable modules frozen at the end (``freeze_level``).
    """

    start: float = 0.5
    final: float = 1.0
    name: str = "linear"

    def __post_init__(self) -> None:
        if not 0 <= self.start < 1:
            raise ValueError(f"LinearSchedule start={self.start!r} must be in [0, 1)")
        if not 0 < self.final <= 1:
            raise ValueError(f"LinearSchedule final={self.final!r} must be in (0, 1]")

    def target(self, info: StepInfo) -> int | None:
        progress = require_total_steps(info, self.name)
        if progress < self.start:
            return 0
        share = self.final * (progress - self.start) / (1 - self.start)
        return min(info.freezable, math.floor(share * info.freezable + 1e-9))


@dataclass
class StaticFreezing(StatelessPolicy):
    """Freezes the first ``count`` modules at ``at_step`` and keeps them frozen (the paper's
    Figure 2 experiment).

    Args:
        count: how many leading modules to freeze.
        at_step: the step after which they freeze (e.g. epoch x steps per epoch).
    """

    count: int = 1
    at_step: int = 0
    name: str = "static"

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"StaticFreezing count={self.count!r} must be a non-negative integer")
        if not isinstance(self.at_step, int) or self.at_step < 0:
            raise ValueError(f"StaticFreezing at_step={self.at_step!r} must be a non-negative integer")

    def target(self, info: StepInfo) -> int | None:
        return min(self.count, info.freezable) if info.step >= self.at_step else 0
