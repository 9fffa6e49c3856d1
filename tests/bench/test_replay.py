"""benchmarks/studies/rule_replay.py's replay goes past a run's first freeze only while it has
frozen what the run had, and stops after the evaluation where the two part."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "studies"))
from rule_replay import replay_front  # noqa: E402


class SettlesAt:
    """A rule stub: module i settles at the evaluation of step ``steps[i]`` and on."""

    def __init__(self, steps: dict[int, int]) -> None:
        self.steps, self.step = steps, 0

    def read(self, index: int, plasticity: float, **_) -> None:
        self.step = int(plasticity)  # the fake readings carry their step

    def compare(self, indices) -> None:
        pass

    def settled_front(self, indices, cap=None) -> int:
        count = 0
        while count < len(indices) and self.step >= self.steps[indices[count]]:
            count += 1
        return count

    def forget_before(self, index: int) -> None:
        pass


RUN = {"plasticity": [{"step": s, "module": m, "plasticity": float(s)} for s in (20, 40, 60, 80) for m in ("a", "b")]}


def _inputs(step, rows):
    return lambda module: {}


def test_a_replay_that_freezes_what_the_run_froze_goes_on_until_they_part():
    frozen = replay_front(RUN, SettlesAt({0: 20, 1: 60}), None, _inputs, own={"a": 20})
    assert frozen == {"a": 20, "b": 60, None: 60}  # parted at 60, where it froze b and the run did not
    frozen = replay_front(RUN, SettlesAt({0: 20, 1: 60}), None, _inputs, own={"a": 20, "b": 60})
    assert frozen == {"a": 20, "b": 60}  # never parted: no None key


def test_a_replay_stops_after_the_evaluation_where_it_parts_from_the_run():
    frozen = replay_front(RUN, SettlesAt({0: 20, 1: 40}), None, _inputs, own={"a": 60, "b": 60})
    assert frozen == {"a": 20, "b": None, None: 20}  # froze a at 20, the run only at 60: b's later readings unused
    frozen = replay_front(RUN, SettlesAt({0: 80, 1: 80}), None, _inputs, own={"a": 40})
    assert frozen == {"a": None, "b": None, None: 40}  # the run froze a at 40, the replay had not
    frozen = replay_front(RUN, SettlesAt({0: 20, 1: 40}), 20, _inputs)  # without own: until the step given
    assert frozen == {"a": 20, "b": None}
