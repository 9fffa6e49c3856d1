"""Runs taking turns on one machine (egeria.turns), in spawned processes as the demo runs them."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

import pytest

from egeria.turns import Stopped, Turns

_TURNS: tuple[Turns, int, "_Log"] | None = None


class _Log:
    """(arm, step) pairs in the order the steps ran, written synchronously to shared memory
    (a queue's feeder thread could reorder two processes' writes)."""

    def __init__(self, context, size: int = 256) -> None:
        self.entries = context.Array("i", size)
        self.count = context.Value("i", 0)

    def add(self, arm: int, step: int) -> None:
        with self.count.get_lock():
            self.entries[self.count.value] = arm * 1000 + step
            self.count.value += 1

    def read(self) -> list[tuple[int, int]]:
        return [divmod(v, 1000) for v in self.entries[: self.count.value]]


def _start(turns: Turns, arm: int, log: _Log) -> None:
    global _TURNS
    _TURNS = (turns, arm, log)


def _arm(steps: int, fail_at: int | None = None) -> int:
    """Takes ``steps`` steps in turns, logging (arm, step) as each runs; raises at step
    ``fail_at``."""
    assert _TURNS is not None
    turns, arm, log = _TURNS
    try:
        if fail_at == 0:
            raise RuntimeError(f"arm {arm} failed in its set-up")
        turns.join(arm)
        for step in range(1, steps + 1):
            if step == fail_at:
                raise RuntimeError(f"arm {arm} failed at step {step}")
            log.add(arm, step)
            turns.step()
    finally:
        turns.leave()
    return steps


def _run(steps: list[int], every: int, fail_at: list[int | None] | None = None):
    """Runs the arms as the demo does (egeria.demo._in_turns); the futures and the log."""
    context = multiprocessing.get_context("spawn")
    turns = Turns(context, len(steps), every, ready_timeout_s=120)
    log = _Log(context)
    fails = fail_at or [None] * len(steps)
    pools = [
        ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_start, initargs=(turns, arm, log))
        for arm in range(len(steps))
    ]
    try:
        futures = [pool.submit(_arm, n, fails[arm]) for arm, (pool, n) in enumerate(zip(pools, steps))]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION, timeout=300)
        if any(f.exception() is not None for f in done):
            turns.stop()
        wait(futures, timeout=300)
        return futures, log.read()
    finally:
        for pool in pools:
            pool.shutdown()


def test_arms_take_turns_of_every_steps_and_the_last_one_running_trains_on_alone():
    futures, order = _run([7, 3], every=2)
    assert [f.result() for f in futures] == [7, 3]
    # Arm 0 starts; turns of 2 steps; arm 1 leaves after its 3rd step, and arm 0 goes on.
    assert order == [(0, 1), (0, 2), (1, 1), (1, 2), (0, 3), (0, 4), (1, 3), (0, 5), (0, 6), (0, 7)]


def test_an_arm_failing_before_its_first_turn_stops_the_others_instead_of_leaving_them_waiting():
    futures, order = _run([5, 5], every=2, fail_at=[None, 0])
    with pytest.raises(RuntimeError, match="arm 1 failed in its set-up"):
        futures[1].result()
    with pytest.raises(Stopped):
        futures[0].result()
    assert order == []


def test_an_arm_failing_mid_run_hands_on_its_turn():
    futures, order = _run([6, 6], every=2, fail_at=[None, 3])
    with pytest.raises(RuntimeError, match="arm 1 failed at step 3"):
        futures[1].result()
    # Arm 0 is released by the failed arm, not left waiting: it either finished before the
    # parent stopped the turns or stopped at its next turn.
    assert order[:4] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert futures[0].exception() is None or isinstance(futures[0].exception(), Stopped)


@pytest.mark.parametrize("arms, every", [(1, 2), (2, 0), (2, True), ("2", 1)])
def test_bad_turns_are_refused_naming_the_value(arms, every):
    with pytest.raises(ValueError, match="arms=|every="):
        Turns(multiprocessing.get_context("spawn"), arms, every)
