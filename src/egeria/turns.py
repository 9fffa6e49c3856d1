"""Runs that take turns on one machine, each in its own process, for side-by-side timing.

On a shared machine (a cloud VM, a laptop) the speed of the same work drifts by 10% or more
over minutes: on the 2-core VMs of the committed demo figures, plain training's own 50-step
medians moved between 321 and 420 ms within one process, and the two arms of a demo run one
after the other differed by 6-11% over the steps where they did the same work. Runs that
take turns every few steps see the same drift, so their times compare.

Each arm calls :meth:`Turns.join` when it is ready to start (after its set-up), then
:meth:`Turns.step` after each training step, outside its timed region, and
:meth:`Turns.leave` when it is done. Exactly one arm trains at a time; an arm that has left
is skipped, so the last one running trains on without waiting. :meth:`Turns.stop` (from the
parent, when an arm failed) releases every arm: each then raises :class:`Stopped` at its
next turn instead of training on alone.

The primitives come from a ``multiprocessing`` context, so a :class:`Turns` reaches the
arms' processes at their start (a pool's ``initargs``), not as a task argument.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Turns", "Stopped"]


class Stopped(RuntimeError):
    """Another arm failed, and the parent stopped the turns."""


class Turns:
    """Turn-taking among ``arms`` processes: an arm trains ``every`` steps, then hands the
    machine to the next arm still running.

    Args:
        context: a ``multiprocessing`` context (its ``Semaphore``, ``Array``, ``Barrier``).
        arms: how many arms take turns; arm 0 trains first.
        every: steps per turn.
        ready_timeout_s: how long an arm waits at :meth:`join` for the others to be ready.

    Raises:
        ValueError: for fewer than two arms or a turn of fewer than one step.
    """

    def __init__(self, context: Any, arms: int, every: int, *, ready_timeout_s: float = 900.0) -> None:
        if not isinstance(arms, int) or arms < 2:
            raise ValueError(f"Turns needs at least 2 arms, got arms={arms!r}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"a turn must be at least 1 step, got every={every!r}")
        self.every = every
        self.ready_timeout_s = ready_timeout_s
        self._go = [context.Semaphore(0) for _ in range(arms)]
        self._left = context.Array("b", arms)
        self._stopped = context.Value("b", 0)
        self._ready = context.Barrier(arms)
        self.arm: int | None = None  # this process's arm, once joined
        self._steps = 0

    def join(self, arm: int) -> None:
        """This process is arm ``arm`` and ready: wait for the others, then for its turn.

        Raises:
            Stopped: the turns were stopped, or another arm never became ready.
        """
        if not 0 <= arm < len(self._go):
            raise ValueError(f"arm={arm!r} is not one of the {len(self._go)} arms")
        self.arm = arm
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
        if self.arm is None:
            return
        self._left[self.arm] = 1
        following = self._following()
        if following is not None:
            self._go[following].release()

    def stop(self) -> None:
        """Releases every arm; each raises :class:`Stopped` at its next turn (called from
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
