"""The training side's link to the controller (the paper's Egeria worker, 4.1.1).

It owns everything about one evaluation on the training side: which step's forward pass
to capture, the captured batch (and activation, in ``"train"`` mode), the request and
the readout sent through the executor. It collects the answers at step boundaries and
applies a decision exactly ``lag`` steps after the reading it came from, whichever executor
answered: the training thread waits there for an answer not yet in (at most the
controller's timeout), so inline, thread and process freeze at the same steps. It keeps the
plasticity history and counts drops and lags. A controller that fails costs one warning and no more evaluations; a process
that cannot start or cannot receive a batch is replaced by a thread.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..checkpoint.statecheck import Spec, anything, integer, items, mapping, number, optional, record, text
from ..decision import Decision
from .device import HostCopy, LocalCopy, as_float32
from .executors import ControllerStartError, Executor, ThreadExecutor
from .protocol import Readout, Request, Result, result_from_json, result_to_json
from .service import ControllerSpec
from .similarity import Gram
from .weights import ModuleKeys

__all__ = ["ControllerLink"]

logger = logging.getLogger(__name__)


@dataclass
class _Evaluation:
    """One evaluation in progress on the training side."""

    step: int
    module: int
    batch: HostCopy | LocalCopy  # the call arguments, on their way to the controller
    sent: bool = False  # its request went to the controller
    open: bool = True  # its forward pass is running (activations may be captured)
    activations: dict[int, HostCopy | LocalCopy] = field(default_factory=dict)
    lr: float | None = None  # the learning rate of its step
    mass_ahead: float | None = None  # the learning-rate mass still to come after its step
    lr_peak: float | None = None  # the schedule's highest learning rate
    regime: int | None = None  # the schedule's latest jump at or before its step (-1: none)
    read: bool = True  # it takes a reading
    refresh: bool = True  # it refreshes the reference afterwards
    lag: int | None = None  # D, the steps a reading's drift covers


# Evaluations tried before the link judges whether most of them were lost.
_STARVED_AFTER = 10

class ControllerLink:
    """One controller, reached through an executor.

    Args:
        executor: the executor to start with.
        spec_factory: builds the controller's spec (with a fresh CPU snapshot of the
            model), for a thread that replaces a failed process.
        keys: the model's state keys per layer module.
        freezable: how many leading modules may freeze.
        watch: returns the (frozen count, window W) a replacement controller watches.
        hooked: the training activations come from the training forward pass
            (``activation_mode="train"``) rather than the controller's eval-mode copy.
        span: how many modules, from the front one, each evaluation reads.
        max_in_flight, timeout: for a replacement controller (`egeria.config.MAX_IN_FLIGHT`, `egeria.config.CONTROLLER_TIMEOUT`).
    """

    def __init__(
        self,
        executor: Executor,
        spec_factory: Callable[[], ControllerSpec],
        keys: ModuleKeys,
        freezable: int,
        watch: Callable[[], tuple[int, int]],
        *,
        hooked: bool,
        span: int = 1,
        max_in_flight: int,
        timeout: float,
    ) -> None:
        self._spec_factory = spec_factory
        self._options = dict(max_in_flight=max_in_flight, timeout=timeout)
        self.keys = keys
        self.freezable = freezable
        self.watch = watch
        self.hooked = hooked
        self.span = span
        self.executor = executor
        self._finalizer = weakref.finalize(self, _close_quietly, self.executor)
        self.generation = 0
        self.seq = 0
        self.armed_for: int | None = None  # the step whose forward pass is captured
        self.evaluation: _Evaluation | None = None
        self.history: list[dict] = []
        self.lags: list[int] = []
        self._armed = (True, True, None)  # (read, refresh, lag) of the armed step
        self._awaited: dict[int, int] = {}  # reading requests sent and not answered: seq -> step
        self._held: list[Result] = []  # decisions received, applied at their reading's step + lag
        self.waits = 0  # step boundaries where training waited for a due answer
        self.waited_s = 0.0  # and how long, in all
        self.fallbacks: list[str] = []
        self._newly_frozen: list[int] = []
        self._pending: list[Result] = []
        self._fallback_due: str | None = None  # a replacement decided in a forward hook
        self._warned = False
        self.unread: dict[str, int] = {}  # answers without a reading, by the controller's note
        self.read = 0  # answers with readings
        self._unread_warned = False

    @property
    def usable(self) -> bool:
        """False once the controller failed: no more evaluations are sent."""
        return self.executor.failure is None

    # -- one evaluation, on the training side ------------------------------------------

    def arm(self, step: int | None, *, read: bool = True, refresh: bool = True, lag: int | None = None) -> None:
        """Capture the forward pass of ``step`` (None: none), to take a reading (``read``),
        refresh the reference after it (``refresh``), or both; ``lag`` is the steps a
        reading's drift covers."""
        self.armed_for = step if self.usable else None
        self._armed = (read, refresh, lag)

    def begin(
        self,
        step: int,
        module: int,
        batch: Callable[[], HostCopy | LocalCopy],
        send: bool,
        state: Callable[[], Mapping[str, torch.Tensor]],
        lr: Callable[[], float] | None = None,
        mass_ahead: Callable[[], float | None] | None = None,
        lr_peak: Callable[[], float | None] | None = None,
        regime: Callable[[], int | None] | None = None,
    ) -> None:
        """A training forward pass of ``step`` starts: capture its batch if armed, and send
        the request now when ``send`` (guided freezing is on) and the batch is on the host
        already (on the CPU; a device's copy is sent at the step boundary instead). ``batch``,
        ``lr``, ``mass_ahead`` (the sum of the learning rates of the steps after it) and
        ``lr_peak`` (the schedule's highest learning rate) and ``regime`` (the step of the
        schedule's latest jump of 2x or more, -1: none; each None where not known) are read
        only when the step is armed: this runs at every forward pass."""
        if self.armed_for != step or self.evaluation is not None:
            return
        read, refresh, lag = self._armed
        evaluation = _Evaluation(
            step, module, batch(), lr=None if lr is None else lr(), mass_ahead=None if mass_ahead is None else mass_ahead(),
            lr_peak=None if lr_peak is None else lr_peak(), regime=None if regime is None else regime(),
            read=read, refresh=refresh, lag=lag,
        )
        if send and evaluation.batch.ready() and not self._offer(evaluation, state, in_hook=True):
            return  # dropped: the controller is behind (or must be replaced at the step's end)
        self.evaluation = evaluation

    def wants_activation(self, module: int) -> bool:
        """Whether the running forward pass's output of ``module`` is to be captured."""
        e = self.evaluation
        return (
            self.hooked
            and e is not None
            and e.open
            and e.module <= module < e.module + self.span
            and module not in e.activations
        )

    def capture(self, module: int, activation: HostCopy | LocalCopy) -> None:
        assert self.evaluation is not None
        self.evaluation.activations[module] = activation

    def forward_ended(self) -> None:
        if self.evaluation is not None:
            self.evaluation.open = False

    def complete(self, guided: bool, state: Callable[[], Mapping[str, torch.Tensor]]) -> bool:
        """The step boundary after the captured forward pass: the evaluation goes out with
        the weights after the update (a batch captured while bootstrapping goes out only if
        guided freezing has just started). True when an evaluation went out."""
        evaluation, self.evaluation = self.evaluation, None
        if evaluation is None or not guided or not self.usable:
            return False
        if not evaluation.sent and not self._offer(evaluation, state):
            return False
        activations = None
        if self.hooked:
            watched = range(evaluation.module, min(evaluation.module + self.span, self.freezable))
            if any(i not in evaluation.activations for i in watched):
                self._cancel()
                return False
            activations = [_as_reading(evaluation.activations[i].get()) for i in watched]
        weights = self._front_weights(state(), evaluation.module)
        self.executor.readout(Readout(self.seq, activations, weights))
        return True

    def _offer(self, evaluation: _Evaluation, state: Callable[[], Mapping[str, torch.Tensor]], in_hook: bool = False) -> bool:
        """Sends the evaluation's request; False when it was dropped. ``state()`` is read
        only when modules froze since the previous request (their final weights go along).
        A process that cannot take it is replaced by a thread, at once at a step boundary,
        at the step's end when the request was sent from a forward hook (which only records)."""
        if not self.usable or self._fallback_due is not None:
            return False
        final = tuple(self._newly_frozen)
        request = Request(
            self.seq + 1,
            self.generation,
            evaluation.step,
            evaluation.module,
            as_float32(evaluation.batch.get()),
            self.executor.weights(state(), self.keys.of(final, loose=False)) if final else None,
            final,
            evaluation.lr,
            evaluation.mass_ahead,
            evaluation.lr_peak,
            evaluation.regime,
            evaluation.read,
            evaluation.refresh,
            evaluation.lag,
        )
        try:
            sent = self.executor.offer(request)
        except ControllerStartError as err:
            if in_hook:
                self._fallback_due = str(err)
                return False
            self._fall_back(str(err))
            request.generation = self.generation
            sent = self.executor.offer(request)
        if sent:
            self.seq = request.seq
            evaluation.sent = True
            self._newly_frozen = []
            if evaluation.read:
                self._awaited[request.seq] = evaluation.step
        return sent

    def _front_weights(self, state: Mapping[str, torch.Tensor], front: int) -> Any:
        """What the controller refreshes from, watching from module ``front``: every module
        it may read after freezing up to ``span`` of them (``front + 2 span - 1``; the paper's
        rule: the watched module and the next), and the loose entries."""
        return self.executor.weights(state, self.keys.of(range(min(front + 2 * self.span, self.freezable + 1))))

    def _cancel(self) -> None:
        """Completes the sent request without a reading."""
        if self.usable:
            self.executor.readout(Readout(self.seq, None, None))

    def _drop_evaluation(self) -> None:
        evaluation, self.evaluation = self.evaluation, None
        if evaluation is not None and evaluation.sent:
            self._cancel()

    # -- answers -------------------------------------------------------------------

    def decisions(self, step: int, frozen: int, lag: int) -> list[Result]:
        """This generation's answers that arrived since the last call, their readings added
        to :attr:`history`; returns the freeze decisions due now: those about module
        ``frozen`` (and the ones after it) whose reading was taken ``lag`` steps ago (or
        earlier, after a resume), which the worker applies; the next request carries the
        final weights of the modules they freeze. A reading due now whose answer is not in
        yet is waited for (at most the controller's timeout, past which it counts as
        failed): the step a decision applies at depends on the run, not on the executor nor
        on how busy the machine is."""
        if self._fallback_due is not None:
            reason, self._fallback_due = self._fallback_due, None
            self._fall_back(reason)
        due = {seq for seq, asked in self._awaited.items() if asked + lag <= step}
        try:
            arrived = self._pending + self.executor.poll()
            missing = due - {r.seq for r in arrived}
            if missing:
                started = time.perf_counter()
                arrived += self.executor.wait(missing)
                self.waits += 1
                self.waited_s += time.perf_counter() - started
        except ControllerStartError as err:
            arrived = self._pending
            self._fall_back(str(err))
        self._pending = []
        self._warn_failure()
        for result in arrived:
            self._awaited.pop(result.seq, None)
            self.lags.append(step - result.step)
            if result.generation != self.generation:
                continue
            self.history.extend(result.readings)
            self._count_reading(result)
            if result.decision is not None:
                self._held.append(result)
        accepted: list[Result] = []
        taken = 0  # modules the accepted decisions freeze
        held = []
        for result in self._held:
            assert result.decision is not None
            if result.step + lag > step:
                held.append(result)
            elif result.module == frozen + taken:
                accepted.append(result)
                taken += len(result.decision.modules)
        self._held = held
        self._newly_frozen.extend(range(frozen, frozen + taken))  # applied by the worker now
        return accepted

    def _count_reading(self, result: Result) -> None:
        """Counts an answer with or without readings; one WARNING when the controller has
        answered ``_STARVED_AFTER`` evaluations and none held a reading: nothing can freeze."""
        if result.readings:
            self.read += 1
            return
        note = result.note or "none"
        self.unread[note] = self.unread.get(note, 0) + 1
        if self._unread_warned or self.read or sum(self.unread.values()) < _STARVED_AFTER:
            return
        self._unread_warned = True
        notes = ", ".join(f"{count} {why}" for why, count in sorted(self.unread.items()))
        hint = (
            " Non-finite readings mean the model's outputs or the reference's hold inf or NaN: check the loss, or "
            "try EgeriaConfig(reference_precision='fp32')."
            if "non-finite" in self.unread
            else ""
        )
        logger.warning(
            "Egeria can freeze nothing yet: its controller answered %d evaluations without a plasticity reading (%s), "
            "and a module freezes only on its readings.%s",
            sum(self.unread.values()), notes, hint,
        )

    def restart(self, frozen: int, window: int) -> None:
        """A new generation: the controller forgets its watch and watches module ``frozen``
        with window ``window`` (after an unfreeze)."""
        self.generation += 1
        self._newly_frozen = []
        self._awaited, self._held = {}, []  # the old generation's answers decide nothing
        self._drop_evaluation()
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
        self._pending = []
        self._awaited, self._held = {}, []
        if self.evaluation is not None:
            self.evaluation.sent = False
        self.generation += 1
        self._newly_frozen = []
        frozen, window = self.watch()
        self.executor.restart(self.generation, frozen, window)

    # -- checkpointing ----------------------------------------------------------------

    def state_dict(self, state: Mapping[str, torch.Tensor], frozen: int) -> dict:
        """The controller's state (waiting for it to finish what was sent) and the
        link's bookkeeping, JSON-safe except for the controller's tensors."""
        self._drop_evaluation()
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
            "held": [result_to_json(r) for r in self._held],
            "history": list(self.history),
        }

    @staticmethod
    def state_spec(controller: Callable[[int], Spec], modules: list[str], steps: int) -> Spec:
        """What :meth:`state_dict` output holds; ``controller(generation)`` is the spec of
        the controller's state saved beside a link at that generation, ``modules`` the
        layer modules' names, ``steps`` the step it was saved at."""
        decision = Decision.state_spec(modules, steps)

        def spec(value: Any, path: str) -> None:
            generation = value.get("generation") if isinstance(value, dict) else None
            result = record(
                {
                    "seq": integer(0),
                    "generation": integer(0, generation if type(generation) is int else None),
                    "step": integer(0, steps),
                    "module": integer(0, len(modules) - 1),
                    "readings": items(mapping(anything)),
                    "decision": optional(decision),
                    "note": text(),
                    "seconds": number(0),
                    "waited_s": number(0),
                }
            )
            record(
                {
                    "controller": optional(controller(generation if type(generation) is int else -1)),
                    "generation": integer(0),
                    "seq": integer(0),
                    "newly_frozen": items(integer(0, len(modules) - 1)),
                    "pending": items(result),
                    "held": items(result),
                    "history": items(mapping(anything)),
                },
                optional=("held",),  # absent before decisions applied a fixed lag after their reading
            )(value, path)

        return spec

    def load_state_dict(self, saved: dict, state: Mapping[str, torch.Tensor], frozen: int) -> None:
        self.generation = int(saved["generation"])
        self.seq = int(saved["seq"])
        self._newly_frozen = list(saved["newly_frozen"])
        self._pending = [result_from_json(r) for r in saved["pending"]]
        self._held = [result_from_json(r) for r in saved.get("held", [])]
        self._awaited = {}
        self.history = list(saved["history"])
        self.evaluation = None
        if saved["controller"] is not None:
            self.executor.load_state_dict(saved["controller"], self._front_weights(state, frozen), self.seq)
            if self.executor.failure is not None:
                raise ValueError(f"the controller could not load the saved Egeria state: {self.executor.failure}")
        elif self.generation > 0:  # saved without a controller (it had failed): start this one in step
            frozen_now, window = self.watch()
            self.executor.restart(self.generation, frozen_now, window)

    def stats(self) -> dict:
        """Counts of the link: sent, dropped, answered, lags, faults."""
        out = self.executor.stats()
        out.update({"lags": list(self.lags), "fallbacks": list(self.fallbacks), "training_waits": self.waits,
                    "training_waited_s": self.waited_s})
        return out

    def close(self) -> None:
        self._finalizer.detach()
        self.evaluation = None
        self.executor.close()


def _as_reading(captured: Any) -> Any:
    """A captured activation as the controller reads it: the tensor, or its Gram matrix
    when it was reduced where it lives (``{"gram": matrix}``)."""
    if isinstance(captured, dict) and set(captured) == {"gram"}:
        return Gram(captured["gram"])
    return captured


def _close_quietly(executor: Executor) -> None:
    try:
        executor.close()
    except Exception:  # interpreter shutdown: nothing left to report to
        pass
