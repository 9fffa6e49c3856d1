"""The controller: turns evaluations into freezing decisions (paper 4.1.1, 4.2).

It owns the reference model's life cycle (generation, refresh, quantization, execution)
and the freezing rule's state for the watched module. It knows nothing of queues, threads
or clocks: the executors in :mod:`egeria.executors` feed it the same messages inline, in a
thread or in a process, so the same sequence of evaluations gives the same decisions in
all three.

One evaluation, in two halves:

1. :meth:`Controller.reference_activation` (when the request arrives): the reference's
   activation at the watched module for the batch. The reference was refreshed at the
   previous evaluation, so the reading measures how far the module moved since then.
2. :meth:`Controller.finish` (when the readout arrives): the training activation (sent by
   the worker, or computed here by an fp32 copy of the model's front loaded with the
   weights the readout carries, in eval mode), the SP loss between the two, the rule,
   then the refresh of the reference from those weights.

The controller keeps its own view of the frozen set: after deciding to freeze module k it
watches k + 1 and treats requests still about k as stale, until a restart (an unfreeze, or
a decision the worker applied too late to use) says otherwise.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Mapping

import torch
from torch import nn

from .decision import Decision
from .nested import first_tensor
from .partition import Partition
from .plasticity import ModuleWatch
from .protocol import Readout, Request, Result
from .reference import ReferenceModel
from .similarity import sp_loss
from .threads import limited_threads
from .truncated import run_until
from .weights import as_mapping

__all__ = ["Controller"]

logger = logging.getLogger(__name__)


class Controller:
    """Reference model plus freezing rule for the frontmost active module.

    Args:
        partition: the model's layer modules.
        template: a CPU fp32 copy of the model (without Egeria's hooks); kept as the fp32
            front that computes eval-mode training activations, and copied for the reference.
        precision: reference precision.
        window: W.
        tolerance_ratio: see :class:`EgeriaConfig`.
        refresh_every: refresh the reference every this many readings.
        threads: torch threads for the controller's work (None: leave torch's setting).
    """

    def __init__(
        self,
        partition: Partition,
        template: nn.Module,
        *,
        precision: str,
        window: int,
        tolerance_ratio: float,
        refresh_every: int = 1,
        threads: int | None = 1,
    ) -> None:
        self.partition = partition
        self.current = template.eval()
        self.precision = precision
        self.tolerance_ratio = tolerance_ratio
        self.refresh_every = refresh_every
        self.threads = threads
        self.reference: ReferenceModel | None = None
        self.watch: ModuleWatch | None = None
        self.restart(generation=0, frozen=0, window=window)

    # -- one evaluation ------------------------------------------------------------

    def is_current(self, request: Request) -> bool:
        """Whether the request is about this generation's watched module."""
        return (
            request.generation == self.generation
            and request.module == self.frozen
            and request.module < self.partition.freezable
        )

    @torch.no_grad()
    def reference_activation(self, request: Request) -> torch.Tensor | None:
        """The reference's activation for the request's batch (None: stale, or no reference yet)."""
        if not self.is_current(request):
            return None
        if request.final_weights is not None and self.reference is not None:
            self.reference.refinalize(as_mapping(request.final_weights), request.final_modules, request.batch)
        if self.reference is None:
            return None
        return self.reference.activation(request.batch, request.module)

    @torch.no_grad()
    def finish(self, request: Request, reference: torch.Tensor | None, readout: Readout) -> Result:
        """Pairs the training activation with the reference's and runs the freezing rule."""
        started = time.perf_counter()
        result = self._finish(request, reference, readout)
        result.seconds = time.perf_counter() - started
        return result

    def _finish(self, request: Request, reference: torch.Tensor | None, readout: Readout) -> Result:
        def answer(**kw) -> Result:
            return Result(request.seq, request.generation, request.step, request.module, **kw)

        if readout.weights is None:
            return answer(note="cancelled")
        if not self.is_current(request):
            return answer(note="stale")
        weights = as_mapping(readout.weights)
        module = request.module
        if self.reference is None or reference is None:
            if self.reference is None:
                self.reference = ReferenceModel(self.current, self.partition, self.precision, threads=self.threads)
            self._refresh(weights, request, upto=module)
            return answer(note="building")
        training = readout.activation
        if training is None:
            training = self._front(weights, request)
        plasticity = float(sp_loss(training.float(), reference))
        if not math.isfinite(plasticity):
            logger.warning("non-finite plasticity at step %d (module %s); reading ignored", request.step, self._name(module))
            return answer(note="non-finite")
        if self.watch is None:
            self.watch = ModuleWatch(self.window, self.tolerance_ratio)
        reading = self.watch.update(plasticity)
        row = {
            "step": request.step,
            "module": self._name(module),
            "plasticity": reading.plasticity,
            "smoothed": reading.smoothed,
            "slope": reading.slope,
            "tolerance": reading.tolerance,
            "stale": reading.stale,
        }
        if reading.freeze:
            decision = Decision(
                request.step,
                "freeze",
                (self._name(module),),
                f"plasticity slope within tolerance {reading.tolerance:.3g} for {self.window} readings",
                evaluated_at=request.step,
            )
            self._frozen_one(weights, request)
            return answer(reading=row, decision=decision)
        self.readings_since_refresh += 1
        if self.readings_since_refresh >= self.refresh_every:
            self._refresh(weights, request, upto=module)
        return answer(reading=row)

    def _front(self, weights: Mapping[str, torch.Tensor], request: Request) -> torch.Tensor:
        """The watched module's fp32 eval-mode output for the batch, with the sent weights."""
        own = self.current.state_dict()
        for key, value in weights.items():
            own[key].copy_(value)
        block = self.partition.modules[request.module].output_block
        args, kwargs = request.batch
        with limited_threads(self.threads):
            tensor = first_tensor(run_until(self.current, block, args, kwargs))
        if tensor is None:
            raise RuntimeError(f"block {block} returned no tensor")
        return tensor

    def _frozen_one(self, weights: Mapping[str, torch.Tensor], request: Request) -> None:
        """Module ``request.module`` froze: watch the next one with a fresh reference."""
        self.frozen += 1
        self.watch = None
        if self.frozen < self.partition.freezable:
            self._refresh(weights, request, upto=self.frozen)

    def _refresh(self, weights: Mapping[str, torch.Tensor], request: Request, upto: int) -> None:
        assert self.reference is not None
        self.reference.refresh(weights, self.frozen, upto, request.batch)
        self.readings_since_refresh = 0

    # -- control -------------------------------------------------------------------

    def restart(self, generation: int, frozen: int, window: int) -> None:
        """Forget the reference and the watch; watch module ``frozen`` with window ``window``.

        Sent after an unfreeze (``frozen=0``) or when the worker discarded a decision
        that reached it too late (the frozen set the worker actually has).
        """
        self.generation = generation
        self.frozen = frozen
        self.window = window
        self.watch = None
        self.reference = None
        self.readings_since_refresh = 0

    def state_dict(self, live: Mapping[str, torch.Tensor]) -> dict:
        """JSON-safe state; ``live`` is the training model's state now."""
        return {
            "generation": self.generation,
            "frozen": self.frozen,
            "window": self.window,
            "watch": None if self.watch is None else self.watch.state_dict(),
            "readings_since_refresh": self.readings_since_refresh,
            "reference": None if self.reference is None else self.reference.state_dict(live),
        }

    def load_state_dict(self, state: dict, weights: Mapping[str, torch.Tensor]) -> None:
        self.generation = int(state["generation"])
        self.frozen = int(state["frozen"])
        self.window = int(state["window"])
        self.watch = None if state["watch"] is None else ModuleWatch.from_state(state["watch"])
        self.readings_since_refresh = int(state["readings_since_refresh"])
        self.reference = None
        if state["reference"] is not None:
            self.reference = ReferenceModel(self.current, self.partition, self.precision, threads=self.threads)
            self.reference.load_state_dict(state["reference"], weights)

    def _name(self, index: int) -> str:
        return self.partition.modules[index].name
