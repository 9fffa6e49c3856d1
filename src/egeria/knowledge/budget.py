"""The cost budget: Egeria's own time on the training thread kept under a share of training.

Egeria times what it does on the training thread (copying an evaluation's batch, and
inline the whole reading) and the training steps around it. Once a few evaluations are
measured, the interval n that keeps the readings' cost under ``budget`` follows from
``cost per evaluation / (n x step time) <= budget``. Timing is wall-clock: the
adjustment is made once, early (the rule's watches go on), and only to a derived n (an explicit ``eval_interval``
is kept and a budget it breaks is reported once).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable, Iterator

__all__ = ["CostBudget"]

# Evaluations and plain steps measured before n is judged.
_EVALUATIONS = 3
_STEPS = 5


class CostBudget:
    """Measures Egeria's time against training time.

    Args:
        budget: the share of training time Egeria may take (e.g. 0.01).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, budget: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget = budget
        self.clock = clock
        self.evaluation_s: list[float] = []  # Egeria's time at each measured evaluation step
        self.step_s: list[float] = []  # training time of steps without an evaluation
        self._spent = 0.0
        self._step_started: float | None = None
        self.total_spent_s = 0.0  # Egeria's time on the training thread over the run
        self.total_s = 0.0  # the run's time between the first and the last step boundary

    @contextlib.contextmanager
    def spending(self) -> Iterator[None]:
        """Counts the body as Egeria's time in the current step."""
        started = self.clock()
        try:
            yield
        finally:
            self._spent += self.clock() - started

    def step_done(self, evaluated: bool) -> None:
        """Closes the current step: its Egeria time, and its training time if it had no
        evaluation. The first call only starts the clock."""
        now = self.clock()
        if self._step_started is not None:
            self.total_spent_s += self._spent
            self.total_s += now - self._step_started
            if evaluated:
                self.evaluation_s.append(self._spent)
            else:
                self.step_s.append(now - self._step_started - self._spent)
            self.evaluation_s, self.step_s = self.evaluation_s[-9:], self.step_s[-25:]
        self._step_started, self._spent = now, 0.0

    def summary(self) -> dict:
        """Egeria's time on the training thread over the run, and its share of the run."""
        share = self.total_spent_s / self.total_s if self.total_s > 0 else None
        return {"egeria_s": self.total_spent_s, "run_s": self.total_s, "share": share}

    @property
    def measured(self) -> bool:
        return len(self.evaluation_s) >= _EVALUATIONS and len(self.step_s) >= _STEPS

    def figures(self) -> tuple[float, float]:
        """(median Egeria seconds per evaluation, median seconds per training step)."""
        return statistics.median(self.evaluation_s), statistics.median(self.step_s)

    def share(self, interval: int) -> float:
        """Egeria's share of training time at one evaluation every ``interval`` steps."""
        cost, step = self.figures()
        return cost / (interval * max(step, 1e-9))

    def interval(self) -> int:
        """The smallest n whose share is within the budget."""
        cost, step = self.figures()
        return max(1, math.ceil(round(cost / (self.budget * max(step, 1e-9)), 9)))  # 30.000000000000004 is 30
