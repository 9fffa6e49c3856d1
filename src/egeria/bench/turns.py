"""Runs that take turns on one machine, each in its own process, for side-by-side timing.

On a shared machine (a cloud VM, a laptop) the speed of the same work drifts by 10% or more
over minutes: on the 2-core VMs of the committed demo figures, plain training's own 50-step
medians moved between 321 and 420 ms within one process, and the two arms of a demo run one
after the other differed by 6-11% over the steps where they did the same work. Runs that
take turns every few steps see the same drift, so their times compare.

:func:`run_in_turns` starts one spawned process per arm and runs a function in each. In
its process an arm gets its :class:`Turns` from :func:`current`, calls :meth:`Turns.join`
when it is ready to start (after its set-up), then :meth:`Turns.step` after each training
step, outside its timed region, and :meth:`Turns.leave` when it is done. Exactly one arm
trains at a time; an arm that has left is skipped, so the last one running trains on
without waiting. When an arm fails, the parent stops the turns (:meth:`Turns.stop`): every
other arm raises :class:`Stopped` at its next step instead of training on alone, and the
failed arm's error is raised.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any, Callable, Sequence

from ..checks import check_int

__all__ = ["Turns", "Stopped", "run_in_turns", "current"]


class Stopped(RuntimeError):
    """Another arm failed, and the parent stopped the turns."""


def run_in_turns(
    fn: Callable[..., Any],
    calls: Sequence[tuple],
    every: int,
    *,
    initializer: Callable[..., None] | None = None,
    initargs: tuple = (),
    ready_timeout_s: float = 900.0,
) -> list[Any]:
    """``fn(*args)`` for each ``args`` of ``calls``, each in a new (spawned) process, all at
    once, taking turns every ``every`` steps (``fn`` takes them through :func:`current`);
    ``initializer(*initargs)`` runs first in each process. Returns the answers in order.

    Raises:
        The error of the first arm that failed of itself (the others raise
        :class:`Stopped`); a crashed process's ``BrokenProcessPool``.
    """
    context = multiprocessing.get_context("spawn")
    turns = Turns(context, len(calls), every, ready_timeout_s=ready_timeout_s)
    pools = [
        ProcessPoolExecutor(
            max_workers=1, mp_context=context, initializer=_start_arm, initargs=(turns, arm, initializer, initargs)
        )
        for arm in range(len(calls))
    ]
    try:
        futures = [pool.submit(fn, *args) for pool, args in zip(pools, calls)]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(future.exception() is not None for future in done):
            turns.stop()
            wait(futures)
            errors = [future.exception() for future in futures if future.exception() is not None]
            raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])
        return [future.result() for future in futures]
    finally:
        turns.stop()  # nothing once every arm is done; else no arm is left waiting on a turn
        for pool in pools:
            pool.shutdown()


_CURRENT: Turns | None = None  # in an arm's process: its turns


def current() -> Turns | None:
    """This process's turns, with its arm set, when :func:`run_in_turns` started it."""
    return _CURRENT


def _start_arm(turns: Turns, arm: int, initializer: Callable[..., None] | None, initargs: tuple) -> None:
    global _CURRENT
    turns.arm = arm
    _CURRENT = turns
    if initializer is not None:
        initializer(*initargs)


class Turns:
    """Turn-taking among ``arms`` processes: an arm trains ``every`` steps, then hands the
    machine to the next arm still running. Made by :func:`run_in_turns`; its primitives
    come from a ``multiprocessing`` context, so it reaches the arms' processes at their
    start, not as a task argument.

    Args:
        context: a ``multiprocessing`` context (its ``Semaphore``, ``Array``, ``Barrier``).
        arms: how many arms take turns; arm 0 trains first.
        every: steps per turn.
        ready_timeout_s: how long an arm waits at :meth:`join` for the others to be ready.

    Raises:
        ValueError: for fewer than two arms or a turn of fewer than one step.
    """

    def __init__(self, context: Any, arms: int, every: int, *, ready_timeout_s: float = 900.0) -> None:
        check_int(arms, "Turns arms", minimum=2)
        check_int(every, "Turns every")
        self.every = every
        self.ready_timeout_s = ready_timeout_s
        self._go = [context.Semaphore(0) for _ in range(arms)]
        self._left = context.Array("b", arms)
        self._stopped = context.Value("b", 0)
        self._ready = context.Barrier(arms)
        self.arm: int | None = None  # this process's arm (set where the process starts)
        self._joined = False
        self._steps = 0

    def join(self) -> None:
        """This arm is ready: wait for the others, then for its turn.

        Raises:
            Stopped: the turns were stopped, or another arm never became ready.
        """
        arm = self.arm
        assert arm is not None, "an arm's Turns comes from turns.current() in a process run_in_turns started"
        self._joined = True
        try:
            self._ready.wait(self.ready_timeout_s)
        except threading.BrokenBarrierError:
            raise Stopped(f"not every arm became ready within {self.ready_timeout_s:g} s, or one failed") from None
        if arm != 0:
            self._wait()

    def step(self) -> None:
        """One training step done: every ``every`` steps, the next arm's turn.

        Raises:
            Stopped: the turns were stopped.
        """
        self._check()
        self._steps += 1
        if self._steps % self.every:
            return
        following = self._following()
        if following is None:  # every other arm has left
            return
        self._go[following].release()
        self._wait()

    def leave(self) -> None:
        """This arm is done (or failed): the next arm still running trains on. Nothing
        for an arm that never joined (it failed in its set-up; the parent stops the rest)."""
        if self.arm is None or not self._joined:
            return
        self._left[self.arm] = 1
        following = self._following()
        if following is not None:
            self._go[following].release()

    def stop(self) -> None:
        """Releases every arm; each raises :class:`Stopped` at its next step (called from
        the parent when an arm failed)."""
        self._stopped.value = 1
        self._ready.abort()
        for go in self._go:
            go.release()

    def _wait(self) -> None:
        assert self.arm is not None
        self._go[self.arm].acquire()
        self._check()

    def _check(self) -> None:
        if self._stopped.value:
            raise Stopped("another arm failed; the turns were stopped")

    def _following(self) -> int | None:
        """The next arm after this one that has not left (None: none has not)."""
        assert self.arm is not None
        count = len(self._go)
        for offset in range(1, count):
            other = (self.arm + offset) % count
            if not self._left[other]:
                return other
        return None
