"""Does the rule on step spans decide as the rule on reading counts did, and does it keep its
decisions when the readings are spaced further apart? Replayed on the suite's readings.

Record 038 (docs/decisions/038-steps-not-readings.md) moved every span of the rule from a
count of readings to a number of optimizer steps and let the cost budget space readings up to
(W - 1) x D apart. This replays the library's rule (:class:`egeria.knowledge.rule.FrontRule`,
the settings ``EgeriaConfig()`` and ``EgeriaConfig(speed="fast")`` give) on the readings each
committed Egeria run of the suite recorded, every reading covering the run's own interval
(D = its n), in three ways:

- ``every``: every recorded reading (the rule on steps, read as densely as the run read);
- ``every 2nd (a)`` and ``every 2nd (b)``: every other reading, from the first and from the
  second: what the rule decides when the budget reads every 2D steps, each reading still
  covering D (the sampling the rule allows at most, W = 3);

beside what the rule on reading counts decided on the same readings (the committed
``benchmarks/results/idle_replay/replay.json``, "the default" and "speed fast", code before
record 038) and the run's own freezes. A run's readings do not depend on the rule until its
first freeze; the replay goes on while it has frozen what the run had at each step and stops
where the two part, as ``idle_replay.py`` does.

    .venv/bin/python benchmarks/studies/span_replay.py

Prints the command, the machine and, per run, each module's freeze step per way ("-": never;
"not by N": the run froze it at N and read it no more, so a sampling that had not decided by
then cannot be followed further); writes
``benchmarks/results/span_replay/replay.json``. No training: seconds.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
OUT = ROOT / "benchmarks/results/span_replay/replay.json"
BEFORE = ROOT / "benchmarks/results/idle_replay/replay.json"
SPEEDS = {"the default": "safe", "speed fast": "fast"}


def regimes(rows: list[dict]) -> dict[int, int | None]:
    """Step -> the step of the latest 2x jump of the recorded learning rate at or before it
    (-1: none; None: no rate recorded), from every reading of the run."""
    from egeria.knowledge.plasticity import REGIME_CHANGE

    out: dict[int, int | None] = {}
    last, latest = None, -1
    for step in sorted({r["step"] for r in rows}):
        lr = next((r.get("lr") for r in rows if r["step"] == step), None)
        if lr is None:
            out[step] = None
            continue
        if last is not None and last > 0 and lr > 0 and max(lr / last, last / lr) >= REGIME_CHANGE:
            latest = step
        last, out[step] = lr, latest
    return out


def reading_inputs(rows: list[dict], window: int, lag: int | None = None):
    """``inputs_at`` for :func:`rule_replay.replay_front`: each reading's inputs to
    :meth:`FrontRule.read` as the run recorded them (learning rate, raw floor, masses, peak,
    step, regime, whether it straddles a jump), the floors recovered from ``rows`` (all of a
    run's readings) with the rule's window and, for the rule on steps, D = ``lag``."""
    from idle_replay import raw_floors

    regime = regimes(rows)
    floors = dict(zip(map(id, rows), raw_floors(rows, window, lag, regime)))

    def inputs_at(step: int, readings: dict[str, dict]):
        def inputs(module: str) -> dict:
            row = readings[module]
            lr, share = row.get("lr"), row.get("lr_share")
            return {"lr": lr, "floor": floors[id(row)], "mass": row.get("mass"), "ahead": row.get("mass_ahead"),
                    "peak": lr / share if lr and share else None, "step": step, "regime": regime[step],
                    "straddles": not row.get("counted", True)}
        return inputs

    return inputs_at


def replay(run: dict, settings, own: dict[str, int], phase: int | None) -> tuple[dict[str, int | None], int | None]:
    """Module -> its freeze step under ``settings`` on the run's readings, every one
    (``phase`` None) or every other one from the first (0) or the second (1); and the step
    where the replay parted from the run (None: replayed to the end)."""
    from egeria.knowledge.rule import FrontRule

    from rule_replay import replay_front

    rows = run["plasticity"]
    inputs_at = reading_inputs(rows, settings.window)
    steps = sorted({r["step"] for r in rows})
    lag = int(statistics.median(b - a for a, b in zip(steps, steps[1:])))
    kept = set(steps if phase is None else steps[phase::2])
    sampled = {**run, "plasticity": [r for r in rows if r["step"] in kept]}
    frozen = replay_front(sampled, FrontRule(dataclasses.replace(settings, lag=lag)), None, inputs_at, own=own)
    parted = frozen.pop(None, None)
    return frozen, parted


def main() -> int:
    from egeria import EgeriaConfig
    from egeria.knowledge.policy import rule_settings

    from idle_replay import SUITE
    from rule_replay import announce, write_results

    command = announce("span_replay.py", sys.argv[1:])
    before = {entry["run"]: entry for entry in json.loads(BEFORE.read_text())["results"]}
    results = []
    for path in SUITE:
        run = json.loads((ROOT / path).read_text())
        own = {m: e["step"] for e in run.get("events", []) if e.get("action") == "freeze" for m in e["modules"]}
        steps = sorted({r["step"] for r in run["plasticity"]})
        print(f"\n{path} ({run['task']}, seed {run['seed']}, {run['total_steps']} steps, read every "
              f"{statistics.median(b - a for a, b in zip(steps, steps[1:])):g}): its own freezes "
              + (", ".join(f"{m} {s}" for m, s in own.items()) or "none"))
        entry = {"run": path, "task": run["task"], "seed": run["seed"], "own_freezes": own, "speeds": {}}
        for name, speed in SPEEDS.items():
            settings = rule_settings(EgeriaConfig(speed=speed))
            ways = {"readings (before 038)": (before[path]["replays"][name], before[path]["parted_at"][name])}
            for way, phase in (("every", None), ("every 2nd (a)", 0), ("every 2nd (b)", 1)):
                ways[way] = replay(run, settings, own, phase)
            entry["speeds"][name] = {way: {"frozen": f, "parted_at": p} for way, (f, p) in ways.items()}
            print(f"  {name}")
            last = {}
            for row in run["plasticity"]:
                last[row["module"]] = max(last.get(row["module"], 0), row["step"])
            for way, (frozen, parted) in ways.items():
                # a module the run froze has no readings past its freeze: a sparser sampling that
                # has not decided by then is undecided, not "never"
                cells = [f"{m} {s if s is not None else f'not by {last[m]}' if m in own else '-'}"
                         for m, s in frozen.items()]
                print(f"    {way:<22}" + "; ".join(cells) + ("" if parted is None else f" [parted at {parted}]"))
        results.append(entry)
    write_results(OUT, command, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
