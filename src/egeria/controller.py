"""The controller: turns evaluation batches into freezing decisions (paper 4.1.1, 4.2).

It owns the reference model and the freezing rule's state for the watched module. The
training side hands it an :class:`Evaluation` (the batch and the training model's
activation at the watched module) and applies the :class:`Decision` it returns at a step
boundary. Here it runs inline, in the training process; the same object is meant to run
in a separate process, fed by queues, with nothing in it that reads the clock.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .partition import Partition
from .plasticity import ModuleWatch
from .reference import Batch, ReferenceModel
from .similarity import sp_loss

__all__ = ["Evaluation", "Decision", "Controller"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """One plasticity evaluation's inputs, taken from a training forward pass.

    Attributes:
        step: the optimizer step whose forward pass produced them.
        module: index of the watched layer module.
        batch: the model's call arguments ``(args, kwargs)``, on the CPU.
        activation: the training model's activation at the module's output, on the CPU.
    """

    step: int
    module: int
    batch: Batch
    activation: torch.Tensor


@dataclass(frozen=True)
class Decision:
    """A change of the frozen set, applied at the end of ``step``.

    Attributes:
        step: the step at whose end it applies.
        action: ``"freeze"`` or ``"unfreeze"``.
        modules: names of the layer modules it affects.
        reason: a short human-readable cause.
    """

    step: int
    action: str
    modules: tuple[str, ...]
    reason: str = ""


@dataclass
class Controller:
    """Reference model plus freezing rule for the frontmost active module.

    Args:
        partition: the model's layer modules.
        precision: reference precision.
        window: W.
        tolerance_ratio: see :class:`EgeriaConfig`.
        refresh_every: refresh the reference every this many readings.
        threads: torch threads for reference work.
    """

    partition: Partition
    precision: str
    window: int
    tolerance_ratio: float
    refresh_every: int = 1
    threads: int | None = 1
    reference: ReferenceModel | None = None
    watch: ModuleWatch | None = None
    readings_since_refresh: int = 0
    history: list[dict] = field(default_factory=list)

    def evaluate(self, ev: Evaluation, model: nn.Module, frozen: int, skip_hooks: Sequence[int] = ()) -> Decision | None:
        """Reads the plasticity of module ``ev.module`` and decides whether it freezes.

        The first evaluation after a (re)start builds the reference and reads nothing.

        Args:
            ev: the evaluation.
            model: the training model, read for reference refreshes.
            frozen: how many leading modules are frozen now (``ev.module == frozen``).
            skip_hooks: hook ids not to copy into the reference.
        """
        if ev.module != frozen or ev.module >= self.partition.freezable:
            return None
        if self.reference is None:
            self.reference = ReferenceModel(
                model, self.partition, self.precision, threads=self.threads, skip_hooks=skip_hooks
            )
            self._refresh(model, frozen, ev)
            return None
        if self.watch is None:
            self.watch = ModuleWatch(self.window, self.tolerance_ratio)
        plasticity = float(sp_loss(ev.activation, self.reference.activation(ev.batch, ev.module)))
        if not math.isfinite(plasticity):
            logger.warning("non-finite plasticity at step %d (module %s); reading ignored", ev.step, self._name(ev))
            return None
        reading = self.watch.update(plasticity)
        self.history.append(
            {
                "step": ev.step,
                "module": self._name(ev),
                "plasticity": reading.plasticity,
                "smoothed": reading.smoothed,
                "slope": reading.slope,
                "tolerance": reading.tolerance,
                "stale": reading.stale,
            }
        )
        if reading.freeze:
            return Decision(
                ev.step,
                "freeze",
                (self._name(ev),),
                f"plasticity slope within tolerance {reading.tolerance:.3g} for {self.window} readings",
            )
        self.readings_since_refresh += 1
        if self.readings_since_refresh >= self.refresh_every:
            self._refresh(model, frozen, ev)
        return None

    def frozen_one(self, model: nn.Module, ev: Evaluation) -> None:
        """After module ``ev.module`` froze: watch the next one with a fresh reference."""
        self.watch = None
        if ev.module + 1 < self.partition.freezable:
            self._refresh(model, ev.module + 1, ev, upto=ev.module + 1)

    def restart(self, window: int) -> None:
        """After an unfreeze: forget everything, watch module 0 with window ``window``."""
        self.window = window
        self.watch = None
        self.reference = None
        self.readings_since_refresh = 0

    def _refresh(self, model: nn.Module, frozen: int, ev: Evaluation, upto: int | None = None) -> None:
        assert self.reference is not None
        self.reference.refresh(model, frozen, ev.module if upto is None else upto, ev.batch)
        self.readings_since_refresh = 0

    def _name(self, ev: Evaluation) -> str:
        return self.partition.modules[ev.module].name

    def state_dict(self, model: nn.Module) -> dict:
        return {
            "window": self.window,
            "watch": None if self.watch is None else self.watch.state_dict(),
            "readings_since_refresh": self.readings_since_refresh,
            "reference": None if self.reference is None else self.reference.state_dict(model),
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict, model: nn.Module, skip_hooks: Sequence[int] = ()) -> None:
        self.window = int(state["window"])
        self.watch = None if state["watch"] is None else ModuleWatch.from_state(state["watch"])
        self.readings_since_refresh = int(state["readings_since_refresh"])
        self.history = list(state["history"])
        self.reference = None
        if state["reference"] is not None:
            self.reference = ReferenceModel(
                model, self.partition, self.precision, threads=self.threads, skip_hooks=skip_hooks
            )
            self.reference.load_state_dict(state["reference"], model)
