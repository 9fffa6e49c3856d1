"""What a freezing policy sees and returns: the one seam between *when* and *how* to freeze.

A policy decides, at each step boundary, how many leading layer modules should be frozen;
the engine applies that with the same mechanics for every policy (``requires_grad``,
dropped gradients, eval-mode BatchNorm), so policies differ only in their timing.
Egeria's own knowledge-guided rule is the built-in default (``policy="egeria"``); the
policies in this package are the baselines it is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn

from ..partition import Partition

__all__ = ["StepInfo", "FreezePolicy", "StatelessPolicy"]


@dataclass(frozen=True)
class StepInfo:
    """The state of training at one step boundary.

    Attributes:
        step: optimizer steps taken so far (1 after the first).
        total_steps: steps the run will take, or None when unknown.
        frozen: how many leading modules are frozen now.
        freezable: how many leading modules may be frozen at most.
        lr: the largest learning rate among the optimizer's param groups.
    """

    step: int
    total_steps: int | None
    frozen: int
    freezable: int
    lr: float

    @property
    def progress(self) -> float | None:
        """Share of training done, in [0, 1], or None without ``total_steps``."""
        return None if not self.total_steps else min(1.0, self.step / self.total_steps)


@runtime_checkable
class FreezePolicy(Protocol):
    """Decides how many leading layer modules are frozen after each step."""

    #: Short name, used in logs and benchmark results.
    name: str

    def bind(self, model: nn.Module, partition: Partition) -> None:
        """Called once the layer modules are known (hooks may be installed here)."""

    def target(self, info: StepInfo) -> int | None:
        """How many leading modules should be frozen now; None keeps the current set."""

    def unbind(self) -> None:
        """Removes whatever :meth:`bind` installed."""

    def state_dict(self) -> dict:
        """JSON-safe state for checkpoints."""

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output."""


class StatelessPolicy:
    """Base for policies whose decision is a pure function of the step."""

    name = "stateless"

    def bind(self, model: nn.Module, partition: Partition) -> None:
        return None

    def unbind(self) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


def require_total_steps(info: StepInfo, policy: str) -> float:
    progress = info.progress
    if progress is None:
        raise ValueError(f"the {policy!r} policy schedules by the share of training done; pass total_steps= to Egeria")
    return progress
