"""Is a module quiet on every average of a run, or on the median of its readings? Replayed on runs.

Record 042 (docs/decisions/042-quiet-on-the-median.md) judges the quiet test (a module's drift
within ``floor_ratio`` of the reference's own error) on the median of the module's readings of
the last three spans, where it was judged on every moving average of a run of readings that
covers a span. This replays the library's rule (:class:`egeria.knowledge.rule.FrontRule`, the
settings ``EgeriaConfig()`` gives, D = ``egeria.config.MIN_EVAL_INTERVAL`` or a pinned interval
below it) on committed runs
made before the change, with three quiet tests:

- ``every average``: the test the runs were made with (it must reproduce their own freezes);
- ``median of 2 spans`` and ``median of 3 spans`` (the test as it is): the median of the
  raw readings of the last two or three spans, at least one span of them, at most
  ``floor_ratio`` x the floor;

each with record 042's floor, the mean of the span's floors (record 043 takes their median:
``floor_replay.py``), front first as the controller does, stopping after the first
evaluation where a replay parts from the run's own freezes (past it the readings come from a
model the replayed rule would not have trained): the freezes of that evaluation are the
replay's last.

The runs: (a) seed 0 from scratch, the demo's task nine times (the same-decisions matrix: three
runs in the default layout, three channels-last, the reading interval pinned at 10, 20 and 40),
the demo's default arm on seeds 0-2,
(e) seeds 0 and 1 each twice, (f) seed 0; all made with record 041's code on one 2-core Intel
Xeon VM. Then (b), (c) and (d), seeds 0 and 1, from their committed suite runs (an AMD EPYC VM,
code from before record 038): the rule as it stands does not reproduce those runs' own freezes
(its spans and bounds changed since), so there the three tests are compared with one another
on the same readings, not with the run.

    .venv/bin/python benchmarks/studies/quiet_replay.py [RUN.json ...]

Prints the command, the machine and, per run, each module's freeze step per test ("-": not by
the end of the replay); writes ``benchmarks/results/quiet_replay/replay.json``. No training:
seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from egeria.knowledge.plasticity import ModuleWatch, Reading

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
OUT = ROOT / "benchmarks/results/quiet_replay/replay.json"
RUNS = "benchmarks/results/tta-full"
MATRIX = "benchmarks/results/same-decisions/intel-avx512-quiet"
SUITE = [
    f"{RUNS}/intel-avx512-quiet/cpu/resnet-fmnist/egeria-cache-seed0.json",
    *(f"{MATRIX}/{name}.json" for name in ("default-1", "default-2", "default-3", "channels-last-1",
                                           "channels-last-2", "channels-last-3", "n10", "n20", "n40")),
    *(f"benchmarks/results/demo/intel-avx512-quiet/seed{seed}/demo.json" for seed in (0, 1, 2)),
    f"{RUNS}/intel-avx512-quiet/cpu/finetune-mnist/egeria-cache-seed0.json",
    f"{RUNS}/intel-avx512-turns/cpu/finetune-mnist/egeria-cache-seed0.json",
    f"{RUNS}/intel-avx512-quiet/cpu/finetune-mnist/egeria-cache-seed1.json",
    f"{RUNS}/intel-avx512-turns/cpu/finetune-mnist/egeria-cache-seed1.json",
    f"{RUNS}/intel-avx512-quiet/cpu/minilm-ptb-order/egeria-seed0.json",
    *(f"{RUNS}/cpu/{task}-seed{seed}.json" for task in ("vgg-fmnist/egeria-cache", "transformer-ptb-cosine/egeria-cache",
                                                           "gpt-ptb-order/egeria") for seed in (0, 1)),
]


class SpanMeanFloor(ModuleWatch):
    """A watch with record 042's floor, the mean of the floors of the span (record 043 took
    their median), so that this study replays the quiet tests as they were compared then."""

    @property
    def floor_level(self) -> float | None:
        return statistics.fmean(self.floors) if self.floors else None


class EveryAverage(SpanMeanFloor):
    """The quiet test before record 042: quiet at a reading whose moving average (over the
    span) is at most ``floor_ratio`` x the floor, freezing once a run of such readings
    covers a span."""

    def update(self, plasticity: float, floor: float | None = None, step: int | None = None) -> Reading:
        run, since = self.quiet, self.quiet_from
        reading = super().update(plasticity, floor, step)
        if not reading.counted:
            self.quiet, self.quiet_from = run, since
            return reading
        level = self.floor_level
        quiet = self.floor_ratio is not None and level is not None and reading.smoothed <= self.floor_ratio * level
        self.quiet, self.quiet_from = (run + 1, since if run else self.step) if quiet else (0, None)
        freeze = self.holds(self.stale_from) or self.holds(self.quiet_from)
        return dataclasses.replace(reading, freeze=freeze, quiet=self.quiet)


class MedianOfTwo(SpanMeanFloor):
    """The median of the readings of two spans."""

    quiet_spans = 2


TESTS = {"every average": EveryAverage, "median of 2 spans": MedianOfTwo, "median of 3 spans": SpanMeanFloor}


@contextlib.contextmanager
def watches_of(kind: type[ModuleWatch]):
    """The rule's watches are ``kind`` while the block runs."""
    import egeria.knowledge.rule as rule_module

    saved = rule_module.ModuleWatch
    rule_module.ModuleWatch = kind
    try:
        yield
    finally:
        rule_module.ModuleWatch = saved


def as_run(record: dict) -> dict:
    """A bench run as it is; a same-decisions run (its readings under ``history``), or a
    demo's default arm, with its readings and modules as a bench run holds them."""
    if "plasticity" in record:
        return record
    if "runs" in record:  # egeria demo's JSON: the default arm
        record = record["runs"]["egeria"]
    rows = record["history"]
    return {**record, "plasticity": rows, "modules": list(dict.fromkeys(r["module"] for r in rows))}


def replay(run: dict, settings, own: dict[str, int], kind: type[ModuleWatch]) -> tuple[dict, int | None]:
    """Module -> its freeze step with watches of ``kind``; and the step where the replay
    parted from the run (None: replayed to the end)."""
    from egeria.config import MIN_EVAL_INTERVAL
    from egeria.knowledge.rule import FrontRule

    from rule_replay import replay_front
    from span_replay import reading_inputs
    from yardstick_replay import cap_of

    # D: an interval pinned below it shortens each reading's drift to the interval
    lag = min(MIN_EVAL_INTERVAL, int(run.get("eval_interval") or MIN_EVAL_INTERVAL))
    inputs_at = reading_inputs(run["plasticity"], settings.window, lag)
    with watches_of(kind):
        rule = FrontRule(dataclasses.replace(settings, lag=lag))
        frozen = replay_front(run, rule, None, inputs_at, own=own, cap=cap_of(run))
    parted = frozen.pop(None, None)
    return frozen, parted


def main(argv: list[str] | None = None, tests: dict[str, type[ModuleWatch]] = TESTS, out: Path = OUT,
         suite: list[str] = SUITE, script: str = "quiet_replay.py") -> int:
    """Replays ``suite`` (or the runs named in ``argv``) with each of ``tests``, written to ``out``."""
    from egeria import EgeriaConfig
    from egeria.knowledge.policy import rule_settings

    from rule_replay import announce, own_freezes, print_replay, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=suite)
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    command = announce(script, sys.argv[1:] if argv is None else argv)
    settings = rule_settings(EgeriaConfig())
    results = []
    for path in args.runs:
        if not (ROOT / path).exists():
            print(f"\n{path}: not run (skipped)")
            continue
        run = as_run(json.loads((ROOT / path).read_text()))
        own = own_freezes(run)
        print(f"\n{path}: its own freezes, at their readings' steps, "
              + (", ".join(f"{m} {s}" for m, s in own.items()) or "none"))
        entry = {"run": path, "own_freezes": own, "replays": {}, "parted_at": {}}
        for name, kind in tests.items():
            frozen, parted = replay(run, settings, own, kind)
            entry["replays"][name], entry["parted_at"][name] = frozen, parted
            print_replay(name, max(map(len, tests)) + 1, frozen, parted)
        results.append(entry)
    write_results(args.out, command, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
