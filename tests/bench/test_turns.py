"""Runs taking turns on one machine (egeria.bench.turns): the turn order with threads standing for
the arms' processes, and the demo's path (spawned processes through run_in_turns)."""

from __future__ import annotations

import copy
import threading
import types

import pytest

from egeria.bench.turns import Stopped, Turns, current, run_in_turns


class _Threads:
    """A multiprocessing context for arms that are threads of this process."""

    Semaphore = staticmethod(threading.Semaphore)
    Barrier = staticmethod(threading.Barrier)

    @staticmethod
    def Array(kind: str, size: int) -> list[int]:  # noqa: N802 - multiprocessing's name
        return [0] * size

    @staticmethod
    def Value(kind: str, value: int) -> types.SimpleNamespace:  # noqa: N802
        return types.SimpleNamespace(value=value)


def _arms(steps: list[int], every: int, fail_at: dict[int, int] | None = None, stop_on_failure: bool = True):
    """Each arm a thread with its own copy of the Turns (as each process has its own),
    sharing its primitives: takes ``steps[arm]`` steps, failing at ``fail_at[arm]`` (0:
    before joining). Returns the (arm, step) order and each arm's outcome. An arm still
    waiting after 60 s fails the test (the barrier would wait 600 s)."""
    shared = Turns(_Threads(), len(steps), every, ready_timeout_s=600)
    order: list[tuple[int, int]] = []
    outcome: dict[int, object] = {}
    failed = threading.Event()

    def run(arm: int) -> None:
        turns = copy.copy(shared)
        turns.arm = arm
        try:
            if (fail_at or {}).get(arm) == 0:
                raise RuntimeError(f"arm {arm} failed in its set-up")
            turns.join()
            for step in range(1, steps[arm] + 1):
                if (fail_at or {}).get(arm) == step:
                    raise RuntimeError(f"arm {arm} failed at step {step}")
                order.append((arm, step))
                turns.step()
            outcome[arm] = "done"
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome[arm] = error
            if not isinstance(error, Stopped):
                failed.set()
        finally:
            turns.leave()

    threads = [threading.Thread(target=run, args=(arm,), daemon=True) for arm in range(len(steps))]
    for thread in threads:
        thread.start()
    if stop_on_failure:  # what run_in_turns does when an arm fails
        while any(t.is_alive() for t in threads) and not failed.wait(0.01):
            pass
        if failed.is_set():
            shared.stop()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "an arm was left waiting"
    return order, outcome


def test_arms_take_turns_of_every_steps_and_the_last_one_running_trains_on_alone():
    order, outcome = _arms([7, 3], every=2)
    assert outcome == {0: "done", 1: "done"}
    # Arm 0 starts; turns of 2 steps; arm 1 leaves after its 3rd step, and arm 0 goes on.
    assert order == [(0, 1), (0, 2), (1, 1), (1, 2), (0, 3), (0, 4), (1, 3), (0, 5), (0, 6), (0, 7)]


def test_three_arms_rotate_and_one_that_left_is_skipped():
    order, _ = _arms([3, 1, 3], every=1)
    assert order == [(0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (0, 3), (2, 3)]


def test_an_arm_failing_mid_run_hands_on_its_turn_so_the_others_finish():
    order, outcome = _arms([6, 6], every=2, fail_at={1: 3}, stop_on_failure=False)
    assert isinstance(outcome[1], RuntimeError) and outcome[0] == "done"
    assert order == [(0, 1), (0, 2), (1, 1), (1, 2), (0, 3), (0, 4), (0, 5), (0, 6)]


def test_stopping_releases_an_arm_waiting_for_the_others_to_be_ready():
    # Arm 1 fails before joining; without the stop, arm 0 would wait at the barrier.
    order, outcome = _arms([5, 5], every=2, fail_at={1: 0})
    assert isinstance(outcome[0], Stopped) and isinstance(outcome[1], RuntimeError)
    assert order == []


def test_a_stopped_arm_raises_at_its_next_step():
    turns = Turns(_Threads(), 2, 5)
    turns.arm = 0
    turns.stop()
    with pytest.raises(Stopped):
        turns.step()


@pytest.mark.parametrize("arms, every", [(1, 2), (2, 0), (2, True), ("2", 1)])
def test_bad_turns_are_refused_naming_the_value(arms, every):
    with pytest.raises(ValueError, match="arms=|every="):
        Turns(_Threads(), arms, every)


# -- the demo's path: spawned processes ---------------------------------------------------


def _spawned_arm(steps: int, fail_at: int | None) -> int:
    turns = current()
    assert turns is not None and turns.arm is not None
    try:
        if fail_at == 0:
            raise RuntimeError(f"arm {turns.arm} failed in its set-up")
        turns.join()
        for _ in range(steps):
            turns.step()
    finally:
        turns.leave()
    return turns.arm


@pytest.mark.slow
def test_run_in_turns_answers_in_order_and_raises_the_failed_arms_own_error():
    assert run_in_turns(_spawned_arm, [(5, None), (3, None)], 2) == [0, 1]
    # The second arm fails in its set-up, so the first is stopped at the start: the error
    # raised is the second's, not the first's Stopped.
    with pytest.raises(RuntimeError, match="arm 1 failed in its set-up"):
        run_in_turns(_spawned_arm, [(5, None), (5, 0)], 1)
