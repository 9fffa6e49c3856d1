"""The training side's link to the controller (the paper's Egeria worker, 4.1.1).

It numbers evaluations, sends their requests and readouts through the configured
executor, collects the answers at step boundaries, keeps the plasticity history, counts
drops and decision lags, and handles a controller that fails: one warning, no more
evaluations, training goes on. A process that cannot start or cannot receive a batch
is replaced by a thread.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable, Mapping

import torch

from .executors import ControllerStartError, Executor, ThreadExecutor, make_executor
from .protocol import Readout, Request, Result, result_from_json, result_to_json
from .service import ControllerSpec
from .weights import ModuleKeys

__all__ = ["ControllerLink"]

logger = logging.getLogger(__name__)


class ControllerLink:
    """One controller, reached through an executor.

    Args:
        kind: "process", "thread" or "inline".
        spec_factory: builds the controller's spec (with a fresh CPU snapshot of the model).
        keys: the model's state keys per layer module.
        freezable: how many leading modules may freeze.
        window: the controller's starting W.
        max_in_flight, timeout, start_method: see :class:`~egeria.config.EgeriaConfig`.
    """

    def __init__(
        self,
        kind: str,
        spec_factory: Callable[[], ControllerSpec],
        keys: ModuleKeys,
        freezable: int,
        window: int,
        *,
        max_in_flight: int,
        timeout: float,
        start_method: str | None,
    ) -> None:
        self._spec_factory = spec_factory
        self._options = dict(max_in_flight=max_in_flight, timeout=timeout)
        self.keys = keys
        self.freezable = freezable
        self.frozen = 0  # the worker's frozen count and window, for a restart after a fallback
        self.window = window
        self.executor: Executor = make_executor(kind, spec_factory, start_method=start_method, **self._options)
        self._finalizer = weakref.finalize(self, _close_quietly, self.executor)
        self.generation = 0
        self.seq = 0
        self.history: list[dict] = []
        self.lags: list[int] = []
        self.discarded = 0
        self.fallbacks: list[str] = []
        self._request: Request | None = None
        self._newly_frozen: list[int] = []
        self._pending: list[Result] = []
        self._warned = False

    @property
    def usable(self) -> bool:
        """False once the controller failed: no more evaluations are sent."""
        return self.executor.failure is None

    # -- one evaluation ------------------------------------------------------------

    def offer(self, state: Callable[[], Mapping[str, torch.Tensor]], step: int, module: int, batch: tuple) -> bool:
        """Sends the request of the evaluation at ``step`` (its forward pass is starting);
        False when it was dropped. ``state()`` gives the model's state; it is read only
        when modules froze since the previous request."""
        if not self.usable:
            return False
        final = tuple(self._newly_frozen)
        request = Request(
            self.seq + 1,
            self.generation,
            step,
            module,
            batch,
            self.executor.weights(state(), self.keys.of(final, loose=False)) if final else None,
            final,
        )
        try:
            sent = self.executor.offer(request)
        except ControllerStartError as err:
            self._fall_back(str(err))
            request.generation = self.generation
            sent = self.executor.offer(request)
        if sent:
            self.seq = request.seq
            self._request = request
            self._newly_frozen = []
        return sent

    @property
    def awaiting_readout(self) -> bool:
        return self._request is not None

    def readout(self, state: Mapping[str, torch.Tensor], activation: torch.Tensor | None) -> None:
        """Completes the sent request at the end of its step, with the weights the
        controller refreshes from: modules 0 to watched + 1 and the loose entries."""
        request, self._request = self._request, None
        if request is None or not self.usable:
            return
        self.executor.readout(Readout(request.seq, activation, self._front_weights(state, request.module)))

    def _front_weights(self, state: Mapping[str, torch.Tensor], watched: int):
        """What the controller refreshes from: modules 0 to ``watched`` + 1, loose entries."""
        return self.executor.weights(state, self.keys.of(range(min(watched + 2, self.freezable + 1))))

    def cancel(self) -> None:
        """Completes the sent request without a reading."""
        request, self._request = self._request, None
        if request is not None and self.usable:
            self.executor.readout(Readout(request.seq, None, None))

    def results(self, step: int) -> list[Result]:
        """Answers of this generation that arrived since the last call, with their
        readings added to :attr:`history`."""
        try:
            arrived = self._pending + self.executor.poll()
        except ControllerStartError as err:
            arrived = self._pending
            self._fall_back(str(err))
        self._pending = []
        self._warn_failure()
        current = []
        for result in arrived:
            self.lags.append(step - result.step)
            if result.generation != self.generation:
                continue
            if result.reading is not None:
                self.history.append(result.reading)
            current.append(result)
        return current

    def froze(self, module: int) -> None:
        """The worker froze ``module``: the next request carries its final weights."""
        self._newly_frozen.append(module)
        self.frozen = module + 1

    def restart(self, frozen: int, window: int) -> None:
        """A new generation: the controller forgets its watch and watches ``frozen``."""
        self.generation += 1
        self.frozen, self.window = frozen, window
        self._newly_frozen = []
        if self._request is not None:
            self.cancel()
        self.executor.restart(self.generation, frozen, window)

    # -- faults --------------------------------------------------------------------

    def _warn_failure(self) -> None:
        if self.executor.failure is not None and not self._warned:
            self._warned = True
            logger.warning(
                "Egeria: the controller stopped (%s); training goes on with the modules frozen so far, "
                "and no module will freeze any more",
                self.executor.failure,
            )

    def _fall_back(self, reason: str) -> None:
        logger.warning("Egeria: %s; the controller now runs in a thread of this process", reason)
        self.fallbacks.append(reason)
        self.executor.close()
        self._finalizer.detach()
        self.executor = ThreadExecutor(self._spec_factory(), **self._options)
        self._finalizer = weakref.finalize(self, _close_quietly, self.executor)
        self._request = None
        self._pending = []
        self.generation += 1
        self._newly_frozen = []
        self.executor.restart(self.generation, self.frozen, self.window)

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self, state: Mapping[str, torch.Tensor], frozen: int) -> dict:
        """The controller's state (waiting for it to finish what was sent) and the
        worker's bookkeeping, JSON-safe except for the controller's tensors."""
        if self._request is not None:
            self.cancel()
        controller = None
        if self.usable:
            controller = self.executor.state_dict(self._front_weights(state, frozen), self.seq)
            self._pending.extend(self.executor.poll())
        return {
            "controller": controller,
            "generation": self.generation,
            "seq": self.seq,
            "newly_frozen": list(self._newly_frozen),
            "pending": [result_to_json(r) for r in self._pending],
            "history": list(self.history),
        }

    def load_state_dict(self, saved: dict, state: Mapping[str, torch.Tensor], frozen: int, window: int) -> None:
        self.frozen, self.window = frozen, window
        self.generation = int(saved["generation"])
        self.seq = int(saved["seq"])
        self._newly_frozen = list(saved["newly_frozen"])
        self._pending = [result_from_json(r) for r in saved["pending"]]
        self.history = list(saved["history"])
        if saved["controller"] is not None:
            self.executor.load_state_dict(saved["controller"], self._front_weights(state, frozen), self.seq)

    def stats(self) -> dict:
        """Counts of the link: sent, dropped, answered, discarded decisions, lags, faults."""
        out = self.executor.stats()
        out.update({"discarded_decisions": self.discarded, "lags": list(self.lags), "fallbacks": list(self.fallbacks)})
        return out

    def close(self) -> None:
        self._finalizer.detach()
        self.executor.close()


def _close_quietly(executor: Executor) -> None:
    try:
        executor.close()
    except Exception:  # interpreter shutdown: nothing left to report to
        pass
