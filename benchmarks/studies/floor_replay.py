"""Does a steadier floor keep the quiet test from firing right after a schedule jump? Replayed on runs.

The quiet test (record 042, docs/decisions/042-quiet-on-the-median.md) compares the median of
a module's readings of the last three spans with ``floor_ratio`` x its floor. Under record
042 that floor was the mean of the floors of the last span, restarted at a schedule jump.
Right after a jump it rests on one to three floors, and a module's floor swings up to
tenfold from one reading to the next: on the same-decisions matrix of 2026-12-08 (an AMD EPYC
VM) the stem of the run read every 20 steps was read quiet at step 480, three readings after
the first drop, against a mean lifted by one floor of 2.5e-7 among 7.7e-8 and 1.4e-8; every
run read every 28-40 steps froze it at 680-722. Record 043
(docs/decisions/043-floor-median.md) takes the median of the span's floors. This replays the
library's rule with:

- ``mean of the span's floors``: record 042's floor (it reproduces the runs made with its code);
- ``median of the span's floors``: record 043's, the rule as it is;
- ``median of 3 spans' floors, restarted``: the floors of the quiet test's evidence window,
  restarted at a jump as the evidence is;
- ``median of 3 spans' floors, kept``: the same, kept across a jump (a floor is the
  reference's own error, a matter of its numerics, not of the schedule);
- ``mean of 3 spans' floors, kept``.

The runs: record 042's same-decisions matrices on the Intel and the AMD VM, the demo's seeds
0-2 on the AMD VM, (e) and (f) seeds 0 and 1 with record 042's code, then quiet_replay.py's
suite (record 041's runs, (a), (b), (c), (d)). Each replay stops after the first evaluation
where it parts from the run's own freezes (see quiet_replay.py).

    .venv/bin/python benchmarks/studies/floor_replay.py [RUN.json ...]

Writes ``benchmarks/results/quiet_replay/floor_replay.json``. No training: seconds.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from egeria.knowledge.plasticity import ModuleWatch, _appended

sys.path.insert(0, str(Path(__file__).parent))

import quiet_replay  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks/results/quiet_replay/floor_replay.json"
MEDIAN = "benchmarks/results/tta-full/intel-avx512-median/cpu"
MATRICES = ("benchmarks/results/same-decisions/intel-avx512-median", "benchmarks/results/same-decisions/amd-epyc-median")
SUITE = [
    *(f"{matrix}/{name}.json" for matrix in MATRICES
      for name in ("default-1", "default-2", "default-3", "channels-last-1", "channels-last-2", "channels-last-3",
                   "n10", "n20", "n40")),
    *(f"benchmarks/results/demo/amd-epyc-median/seed{seed}/demo.json" for seed in (0, 1, 2)),
    *(f"{MEDIAN}/{task}-seed{seed}.json" for task in ("finetune-mnist/egeria-cache", "minilm-ptb-order/egeria")
      for seed in (0, 1)),
    *quiet_replay.SUITE,
]


def floor_over_evidence(statistic, restart: bool) -> type[ModuleWatch]:
    """A watch whose floor is ``statistic`` of the floors read over the quiet test's evidence
    window (three spans), restarted at a schedule jump where ``restart``."""

    class Watch(ModuleWatch):
        evidence_floors: tuple[list[int], list[float]] = ([], [])  # steps, floors

        def update(self, plasticity: float, floor: float | None = None, step: int | None = None):
            if floor is not None and not self.straddling:
                at = step if step is not None else (self.lag if self.step is None else self.step + self.lag)
                self.evidence_floors = _appended(*self.evidence_floors, at, floor,
                                                 since=at - self.quiet_spans * self.span + self.lag)
            return super().update(plasticity, floor, step)

        def new_regime(self, lr: float, regime: int | None = None, straddles: bool = True) -> bool:
            jumped = super().new_regime(lr, regime, straddles)
            if jumped and restart:
                self.evidence_floors = ([], [])
            return jumped

        @property
        def floor_level(self) -> float | None:
            floors = self.evidence_floors[1]
            return statistic(floors) if floors else None

    return Watch


TESTS = {
    "mean of the span's floors": quiet_replay.SpanMeanFloor,
    "median of the span's floors": ModuleWatch,
    "median of 3 spans' floors, restarted": floor_over_evidence(statistics.median, restart=True),
    "median of 3 spans' floors, kept": floor_over_evidence(statistics.median, restart=False),
    "mean of 3 spans' floors, kept": floor_over_evidence(statistics.fmean, restart=False),
}


if __name__ == "__main__":
    raise SystemExit(quiet_replay.main(tests=TESTS, out=OUT, suite=SUITE, script="floor_replay.py"))
