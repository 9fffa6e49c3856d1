"""Where the controller runs, seen from the training side (the worker): inline, in a
thread, or in its own process (paper 4.1.1-4.1.2; ``EgeriaConfig.executor``).

All three put the same messages on the same four queues, served by the same loop
(:class:`~egeria.knowledge.service.Service`) around the same :class:`~egeria.knowledge.controller.Controller`,
so the same sequence of evaluations gives the same readings and decisions by construction. They differ in when an answer comes back:

* ``inline``: each message is handled as it is sent, in the caller's thread, so an answer
  is in at the end of its evaluation step.
* ``thread`` / ``process``: the worker sends the request and the readout and carries on;
  :meth:`poll` at later step boundaries picks up whatever answers are in, and :meth:`wait`
  blocks for one that is due (:class:`~egeria.knowledge.link.ControllerLink` applies a
  decision a fixed number of steps after its reading, whichever executor answered). At most
  ``max_in_flight`` (``egeria.config.MAX_IN_FLIGHT``, 2) evaluations are unanswered at a
  time; a further one would be dropped (counted) rather than queued, which the fixed
  application step keeps from happening (a reading and a refresh at most are in flight).

Faults never stop training: a controller that raises, exits or stops beating its heart
for ``egeria.config.CONTROLLER_TIMEOUT`` seconds is reported once (:attr:`failure`) and gives no more
answers; the engine then trains on with the modules frozen so far. A controller process
that exits before it is ready is replaced by a thread; one that exits with
:data:`~egeria.knowledge.mainguard.GUARD_EXIT` found itself re-running a script without the
``if __name__ == "__main__":`` guard (:mod:`egeria.knowledge.mainguard`), and the warning says so.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading
import time
from typing import Any, Mapping

import torch

from ..nested import map_tensors
from .cpuload import CpuLoad
from .device import safe_start_method
from .mainguard import CONTROLLER_NAME, GUARD_EXIT, guard_message
from .protocol import Control, Readout, Reply, Request, Result
from .service import Channels, ControllerSpec, Service, process_main
from .weights import PackedState

__all__ = ["Executor", "InlineExecutor", "ThreadExecutor", "ProcessExecutor", "ControllerStartError", "picklable"]

logger = logging.getLogger(__name__)

_REPLY_TIMEOUT_S = 60.0
# How often a wait for a due answer checks the controller's health.
_WAIT_POLL_S = 0.05
# How long a checkpoint waits for the controller's state; past it the checkpoint is saved
# without it (a resumed run watches afresh) and the controller goes on.
_STATE_REPLY_S = 10.0


class ControllerStartError(RuntimeError):
    """The controller could not be started (or died before it was ready)."""


class Executor:
    """Common bookkeeping: counts of evaluations offered, dropped and answered.

    Attributes:
        name: "inline", "thread" or "process".
        failure: why the controller stopped answering, or None.
    """

    name = "inline"

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.sent = 0
        self.dropped = 0
        self.answered = 0
        self.controller_seconds = 0.0
        self.waited_s = 0.0
        self.failure: str | None = None

    def weights(self, state: Mapping[str, torch.Tensor], keys: list[str]) -> Any:
        """What a message carries of the model's weights: copies, unless inline."""
        return PackedState(state, keys)

    def offer(self, request: Request) -> bool:
        """Sends an evaluation's request; False when it is dropped (too many in flight)."""
        if self.failure is not None:
            return False
        if self.in_flight >= self.max_in_flight:
            self.dropped += 1
            return False
        self._send_request(request)
        self.in_flight += 1
        self.sent += 1
        return True

    def poll(self) -> list[Result]:
        """The answers that arrived since the last poll, without waiting."""
        results = self._receive()
        for result in results:
            self._count(result)
        return results

    def wait(self, seqs: set[int]) -> list[Result]:
        """Blocks until the answers to the requests ``seqs`` are in; returns every answer
        received meanwhile. Past the controller's timeout without them the controller counts
        as failed (:attr:`failure`), as a silent one does."""
        raise NotImplementedError

    def _count(self, result: Result) -> None:
        self.in_flight -= 1
        self.answered += 1
        self.controller_seconds += result.seconds
        self.waited_s += result.waited_s

    def stats(self) -> dict:
        return {
            "executor": self.name,
            "sent": self.sent,
            "dropped": self.dropped,
            "answered": self.answered,
            "in_flight": self.in_flight,
            "controller_seconds": self.controller_seconds,
            "waited_s": self.waited_s,
            "failure": self.failure,
        }

    # implemented by each executor
    def _send_request(self, request: Request) -> None:
        raise NotImplementedError

    def _receive(self) -> list[Result]:
        raise NotImplementedError

    def readout(self, readout: Readout) -> None:
        raise NotImplementedError

    def restart(self, generation: int, frozen: int, window: int) -> None:
        raise NotImplementedError

    def state_dict(self, live: Any, last_seq: int) -> dict | None:
        raise NotImplementedError

    def load_state_dict(self, state: dict, weights: Any, last_seq: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _QueueExecutor(Executor):
    """A controller behind queues, served by :class:`~egeria.knowledge.service.Service`."""

    def __init__(self, max_in_flight: int, timeout: float) -> None:
        super().__init__(max_in_flight)
        self.timeout = timeout
        self.ready = False
        self._early: list[Result] = []
        self._late_replies: set[str] = set()  # replies a caller stopped waiting for
        self._closed = False
        self.channels: Channels

    def _put(self, channel: Any, message: Any) -> None:
        channel.put_nowait(message)

    def _send_request(self, request: Request) -> None:
        self._put(self.channels.requests, request)

    def readout(self, readout: Readout) -> None:
        if self.failure is None:
            self._put(self.channels.readouts, readout)

    def restart(self, generation: int, frozen: int, window: int) -> None:
        self._control("restart", generation=generation, frozen=frozen, window=window)

    def _control(self, kind: str, **args: Any) -> None:
        if self.failure is None:
            self._put(self.channels.control, Control(kind, args))

    def _receive(self) -> list[Result]:
        results, self._early = self._early, []
        if self.failure is not None:
            return results
        while True:
            try:
                message = self.channels.results.get_nowait()
            except queue.Empty:
                break
            if not self._take(message, results):
                break
        self._check_health()
        return results

    def wait(self, seqs: set[int]) -> list[Result]:
        results: list[Result] = []
        missing = set(seqs)
        deadline = time.monotonic() + self.timeout
        while missing and self.failure is None:
            if time.monotonic() >= deadline:
                self._fail(f"no answer to the reading(s) {sorted(missing)} within {self.timeout:.0f} s")
                break
            try:
                message = self.channels.results.get(timeout=_WAIT_POLL_S)
            except queue.Empty:
                self._check_health()
                continue
            got: list[Result] = []
            if not self._take(message, got):
                break
            for result in got:
                self._count(result)
                missing.discard(result.seq)
            results += got
        return results

    def _take(self, message: Any, results: list[Result]) -> bool:
        """Files one message from the decision queue; False after a failure."""
        if isinstance(message, Result):
            results.append(message)
            return True
        if message.kind in self._late_replies:  # a reply a checkpoint stopped waiting for
            self._late_replies.discard(message.kind)
            return True
        if message.kind == "ready":
            self.ready = True
            return True
        if message.kind == "failed":
            self._fail(f"the controller raised an exception:\n{message.payload}")
            return False
        raise RuntimeError(f"unexpected reply {message.kind!r} from the controller")

    def _ask(self, kind: str, answer: str, *, limit_s: float = _REPLY_TIMEOUT_S, fail: bool = True, **args: Any) -> Any:
        """Sends a control message and waits (up to the timeout, at most ``limit_s``) for
        its reply; results arriving first are kept for the next :meth:`poll`. Without a
        reply in time: the controller is failed when ``fail``, else None is returned and
        the late reply is dropped when it comes."""
        if self.failure is not None:
            return None
        self._control(kind, **args)
        limit_s = min(self.timeout, limit_s)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                message = self.channels.results.get(timeout=0.05)
            except queue.Empty:
                self._check_health()
                if self.failure is not None:
                    return None
                continue
            if isinstance(message, Reply) and message.kind == answer:
                return message.payload
            if not self._take(message, self._early):
                return None
        if not fail:
            self._late_replies.add(answer)
            logger.warning(
                "Egeria: the controller did not answer %r within %.0f s; saved without its readings (a resumed run "
                "watches the front module afresh), and it goes on", kind, limit_s,
            )
            return None
        self._fail(f"no answer to {kind!r} within {limit_s:.0f} s")
        return None

    def state_dict(self, live: Any, last_seq: int) -> dict | None:
        """The controller's state for a checkpoint, or None when it does not answer within
        a few seconds (the checkpoint never blocks for long nor stops the controller)."""
        return self._ask("state", "state", limit_s=_STATE_REPLY_S, fail=False, last_seq=last_seq, live=live)

    def load_state_dict(self, state: dict, weights: Any, last_seq: int) -> None:
        self._ask("load", "loaded", state=state, weights=weights, last_seq=last_seq)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self._stop(graceful=False)

    # -- per kind --------------------------------------------------------------------

    def _check_health(self) -> None:
        raise NotImplementedError

    def _stop(self, graceful: bool) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            self._control("stop")
        self._stop(graceful=self.failure is None)


class InlineExecutor(_QueueExecutor):
    """The controller served in the caller's thread: each message is handled as soon as
    it is put on its queue, so an answer is ready at the next :meth:`poll`.

    Args:
        spec: what the controller is built from.
        max_in_flight, timeout: as for the other executors.
    """

    name = "inline"

    def __init__(self, spec: ControllerSpec, *, max_in_flight: int = 2, timeout: float = 60.0) -> None:
        super().__init__(max_in_flight, timeout)
        self.channels = Channels(queue.Queue(), queue.Queue(), queue.Queue(), queue.Queue())
        self.service = Service(
            spec.build(), self.channels, cpu_threshold=None, load=None, beat=lambda: None, alive=lambda: True
        )
        self.ready = True

    def weights(self, state: Mapping[str, torch.Tensor], keys: list[str]) -> Any:
        return {k: state[k] for k in keys}  # handled before the call returns: no copy needed

    def _put(self, channel: Any, message: Any) -> None:
        channel.put_nowait(message)
        self.deliver()

    def deliver(self) -> None:
        """Lets the controller handle every message sent so far."""
        self.service.pump()

    def _check_health(self) -> None:
        return None

    def _stop(self, graceful: bool) -> None:
        self.service.pump()  # obeys the stop
        self.service.controller.reference = None


class ThreadExecutor(_QueueExecutor):
    """The controller in a daemon thread of the training process. It shares torch's
    thread pool with training, so the controller's thread count does not apply."""

    name = "thread"

    def __init__(self, spec: ControllerSpec, *, max_in_flight: int, timeout: float) -> None:
        super().__init__(max_in_flight, timeout)
        self.channels = Channels(
            queue.Queue(max_in_flight + 1), queue.Queue(max_in_flight + 1), queue.Queue(), queue.Queue()
        )
        self._heartbeat = time.monotonic()
        self._abandon = threading.Event()
        spec.threads = None
        service = Service(
            spec.build(),
            self.channels,
            cpu_threshold=spec.cpu_threshold,
            load=CpuLoad([os.getpid()]) if spec.cpu_threshold is not None else None,
            beat=self._beat,
            alive=lambda: not self._abandon.is_set() and threading.main_thread().is_alive(),
        )
        self.thread = threading.Thread(target=service.run, name="egeria-controller", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        self._heartbeat = time.monotonic()

    def _check_health(self) -> None:
        if self.failure is not None:
            return
        if not self.thread.is_alive():
            self._fail("the controller thread ended")
        elif time.monotonic() - self._heartbeat > self.timeout:
            self._fail(f"the controller gave no heartbeat for {self.timeout:g} s (hung)")

    def _stop(self, graceful: bool) -> None:
        self._abandon.set()
        if graceful:
            self.thread.join(timeout=2.0)


class ProcessExecutor(_QueueExecutor):
    """The controller in its own process (torch.multiprocessing; fork, spawn or forkserver).

    Raises:
        ControllerStartError: when the process cannot be started, e.g. the model cannot be
            pickled for the ``spawn`` start method.
    """

    name = "process"

    def __init__(self, spec: ControllerSpec, *, max_in_flight: int, timeout: float, start_method: str | None) -> None:
        super().__init__(max_in_flight, timeout)
        import torch.multiprocessing as tmp

        ctx = tmp.get_context(start_method)
        safe = safe_start_method(ctx.get_start_method())
        if safe != ctx.get_start_method():
            ctx = tmp.get_context(safe)
        if ctx.get_start_method() == "fork" and spec.threads != 1:
            # OpenMP is not fork-safe: a forked child that runs torch ops on more than one
            # thread after the parent used its thread pool hangs.
            if start_method is None:
                logger.info("Egeria: %s controller threads need a fresh process; starting it with spawn", spec.threads)
                ctx = tmp.get_context("spawn")
            else:
                logger.warning("Egeria: a forked controller process runs on 1 thread (OpenMP is not fork-safe)")
                spec.threads = 1
        self.start_method = ctx.get_start_method()
        self.channels = Channels(
            ctx.Queue(max_in_flight + 1), ctx.Queue(max_in_flight + 1), ctx.Queue(), ctx.Queue()
        )
        for q in (self.channels.requests, self.channels.readouts, self.channels.control):
            q.cancel_join_thread()  # never block interpreter exit on a dead controller's pipe
        self._heartbeat = ctx.Value("d", time.monotonic(), lock=False)
        self.process = ctx.Process(
            target=process_main,
            args=(spec, self.channels, self._heartbeat, os.getpid()),
            name=CONTROLLER_NAME,
            daemon=True,
        )
        try:
            self.process.start()
        except Exception as err:  # pickling the model for spawn, resource limits
            raise ControllerStartError(f"{type(err).__name__}: {err}{self._guard_hint()}") from err
        self._started = time.monotonic()
        self._guard_said = False  # the exit for a script without the __main__ guard was reported

    def _guard_hint(self) -> str:
        return (
            " (under the spawn or forkserver start method, guard the script's training code with "
            "`if __name__ == '__main__':`)" if self.start_method != "fork" else ""
        )

    def _guard_exit(self) -> bool:
        """Whether the process exited because it re-ran a script without the guard."""
        return not self.ready and self.process.exitcode == GUARD_EXIT

    def _send_request(self, request: Request) -> None:
        problem = picklable(request.batch)
        if problem is not None:
            raise ControllerStartError(f"the evaluation batch cannot be sent to a process: {problem}")
        super()._send_request(request)

    def _check_health(self) -> None:
        if self.failure is not None:
            return
        if not self.process.is_alive():
            code = self.process.exitcode
            if self._guard_exit():
                self._guard_said = True
                raise ControllerStartError(guard_message(_main_script()))
            if not self.ready:
                raise ControllerStartError(
                    f"the controller process exited with code {code} before it was ready{self._guard_hint()}"
                )
            self._fail(f"the controller process exited with code {code}")
        elif self.ready and time.monotonic() - self._heartbeat.value > self.timeout:
            self._fail(f"the controller process gave no heartbeat for {self.timeout:g} s (hung)")
        elif not self.ready and time.monotonic() - self._started > max(self.timeout, 60.0):
            self._fail("the controller process did not start")

    def _stop(self, graceful: bool) -> None:
        if graceful:
            self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=1.0)

    def close(self) -> None:
        super().close()
        if self._guard_exit() and not self._guard_said:  # closed before a step boundary saw it
            self._guard_said = True
            logger.warning("Egeria: %s; no module was read", guard_message(_main_script()))

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def stats(self) -> dict:
        return super().stats() | {"pid": self.process.pid, "start_method": self.start_method}


def _main_script() -> str | None:
    return getattr(sys.modules.get("__main__"), "__file__", None)


def picklable(value: Any) -> str | None:
    """None when ``value`` (its tensors aside) can be pickled, else the reason."""
    try:
        pickle.dumps(map_tensors(value, lambda t: None))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def make_executor(
    kind: str,
    spec: ControllerSpec,
    *,
    max_in_flight: int,
    timeout: float,
    start_method: str | None,
) -> Executor:
    """The executor of ``kind``; a process that cannot start falls back to a thread."""
    if kind == "inline":
        return InlineExecutor(spec, max_in_flight=max_in_flight, timeout=timeout)
    if kind == "process":
        try:
            return ProcessExecutor(spec, max_in_flight=max_in_flight, timeout=timeout, start_method=start_method)
        except ControllerStartError as err:
            logger.warning("Egeria: the controller process could not start (%s); running it in a thread", err)
    return ThreadExecutor(spec, max_in_flight=max_in_flight, timeout=timeout)
