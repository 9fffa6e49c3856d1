"""The controller's loop over its queues, run by the thread and process executors
(paper 4.1.2, Figure 6).

The worker puts a :class:`Request` on the input queue when an evaluation step's forward
pass starts and its :class:`Readout` on the training-output queue when the step ends. The
loop takes a request, runs the reference forward pass (only while other processes leave
the CPU quiet enough), keeps the reference activation (the reference-output queue, which
lives inside this loop), takes the matching readout, pairs the two and runs the freezing
rule, and puts the :class:`Result` on the decision queue. Evaluations are handled one at a
time and in order, so the reference a request sees was refreshed by the previous one.
Control messages (restart, state, load, stop) are read between and during evaluations.
"""

from __future__ import annotations

import logging
import queue
import signal
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..partition import Partition
from .controller import Controller
from .cpuload import CpuLoad, wait_for_quiet
from .placement import pin_to
from .protocol import Control, Readout, Reply, Request
from .rule import RuleSettings
from .weights import as_mapping

__all__ = ["Channels", "ControllerSpec", "Service", "process_main"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


@dataclass
class Channels:
    """The four queues: requests (input), readouts (training output), results (decisions
    and replies), control."""

    requests: Any
    readouts: Any
    results: Any
    control: Any


@dataclass
class ControllerSpec:
    """Everything needed to build the controller on the other side (picklable when the
    template model is)."""

    partition: Partition
    template: nn.Module
    precision: str
    rule: RuleSettings  # the freezing rule's settings, W as it is now
    threads: int | None
    cpu_threshold: float | None
    span: int = 1
    cpus: tuple[int, ...] | None = None  # cores the controller process may use

    def build(self) -> Controller:
        return Controller(
            self.partition,
            self.template,
            precision=self.precision,
            rule=self.rule,
            threads=self.threads,
            span=self.span,
        )


class Service:
    """Runs ``controller`` over ``channels`` until stopped, orphaned or broken.

    Args:
        beat: called often (at least every 50 ms while idle) to show the loop is alive.
        alive: false once the training side is gone; the loop then ends.
        load: CPU load of other processes, for the ``cpu_threshold`` gate.
    """

    def __init__(
        self,
        controller: Controller,
        channels: Channels,
        *,
        cpu_threshold: float | None,
        load: CpuLoad | None,
        beat: Callable[[], None],
        alive: Callable[[], bool],
    ) -> None:
        self.controller = controller
        self.ch = channels
        self.cpu_threshold = cpu_threshold
        self.load = load
        self.beat = beat
        self.alive = alive
        self.stopped = False
        self.pending: tuple[Request, torch.Tensor | None] | None = None
        self.done_seq = 0
        self.state_request: dict | None = None
        self.waited_s = 0.0

    def run(self) -> None:
        """Serves until stopped or orphaned, waiting for messages (thread and process)."""
        try:
            self.ch.results.put(Reply("ready"))
            while not self.stopped and self.alive():
                self.beat()
                self._turn(_POLL_S)
        except BaseException:  # noqa: B902 - report every failure, then end
            self.ch.results.put(Reply("failed", traceback.format_exc()))

    def pump(self) -> None:
        """Handles every message already queued, without waiting (the inline executor)."""
        try:
            while not self.stopped and self._turn(None):
                pass
        except Exception:  # report the failure, then serve no more; Ctrl-C stays the user's
            self.stopped = True
            self.ch.results.put(Reply("failed", traceback.format_exc()))

    def _turn(self, timeout: float | None) -> bool:
        """One round: control messages, then a request or the readout it waits for, then a
        state answer; ``timeout`` seconds of waiting for the evaluation message at most
        (None: none). True when anything was handled."""
        handled = self._read_control()
        if self.stopped:
            return handled
        if self.pending is None:
            handled = self._take_request(timeout) or handled
        else:
            handled = self._take_readout(timeout) or handled
        return self._answer_state() or handled

    # -- evaluations ---------------------------------------------------------------

    def _take_request(self, timeout: float | None) -> bool:
        request = _get(self.ch.requests, timeout)
        if request is None:
            return False
        while request.generation > self.controller.generation and not self.stopped:
            # Its restart is on the control queue; pumped (inline), it is there already or
            # never comes, and the request is answered as stale.
            if not self._read_control(block=timeout is not None) and timeout is None:
                break
        self.pending = (request, self._reference(request))
        return True

    def _reference(self, request: Request) -> torch.Tensor | None:
        if not self.controller.is_current(request) or self.controller.reference is None:
            return None
        if self.cpu_threshold is not None and self.load is not None and self.state_request is None:
            self.waited_s += wait_for_quiet(self.load, self.cpu_threshold, interrupt=self._interrupted)
        return self.controller.reference_activation(request)

    def _interrupted(self) -> bool:
        """While waiting for a quiet CPU: keep beating, obey control messages."""
        self.beat()
        self._read_control()
        return self.stopped or self.state_request is not None or not self.alive()

    def _take_readout(self, timeout: float | None) -> bool:
        readout: Readout | None = _get(self.ch.readouts, timeout)
        if readout is None:
            return False
        assert self.pending is not None
        request, reference = self.pending
        if readout.seq != request.seq:
            raise RuntimeError(f"readout {readout.seq} arrived for request {request.seq}")
        self.pending = None
        result = self.controller.finish(request, reference, readout)
        result.waited_s, self.waited_s = self.waited_s, 0.0
        self.done_seq = request.seq
        self.ch.results.put(result)
        return True

    # -- control -------------------------------------------------------------------

    def obey_control(self) -> None:
        """Handles the control messages already queued (a fake transport in tests)."""
        self._read_control()
        self._answer_state()

    def _read_control(self, block: bool = False) -> bool:
        handled = False
        while True:
            message: Control | None = _get(self.ch.control, _POLL_S if block else None)
            if message is None:
                return handled
            self._obey(message)
            handled, block = True, False

    def _obey(self, message: Control) -> None:
        args = message.args
        if message.kind == "stop":
            self.stopped = True
        elif message.kind == "restart":
            self.controller.restart(args["generation"], args["frozen"], args["window"])
        elif message.kind == "state":
            self.state_request = dict(args)
        elif message.kind == "load":
            self.controller.load_state_dict(args["state"], as_mapping(args["weights"]))
            self.done_seq = args["last_seq"]  # evaluations before the checkpoint were all answered
            self.ch.results.put(Reply("loaded"))
        else:
            raise ValueError(f"unknown control message {message.kind!r}")

    def _answer_state(self) -> bool:
        """Answers a state request once every evaluation sent before it is done."""
        request = self.state_request
        if request is None or self.done_seq < request["last_seq"]:
            return False
        self.state_request = None
        self.ch.results.put(Reply("state", self.controller.state_dict(as_mapping(request["live"]))))
        return True


def _get(q: Any, timeout: float | None) -> Any:
    try:
        return q.get(timeout=timeout) if timeout is not None else q.get_nowait()
    except queue.Empty:
        return None


def process_main(spec: ControllerSpec, channels: Channels, heartbeat: Any, trainer_pid: int) -> None:
    """Entry point of the controller process."""
    import multiprocessing
    import os

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    pin_to(spec.cpus)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    parent = multiprocessing.parent_process()

    def beat() -> None:
        heartbeat.value = time.monotonic()

    service = Service(
        spec.build(),
        channels,
        cpu_threshold=spec.cpu_threshold,
        load=CpuLoad([trainer_pid, os.getpid()]) if spec.cpu_threshold is not None else None,
        beat=beat,
        alive=(lambda: parent.is_alive()) if parent is not None else (lambda: True),
    )
    service.run()
