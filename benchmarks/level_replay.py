"""Replays the recorded runs of Egeria's own rule under two readings of a module's *level*
for the settle test (its plasticity against ``settle_ratio`` x its peak): the moving
average of its last W readings (the rule before commit 0545474) and their median (since).

A run's readings do not depend on the rule until its first freeze, so up to that step the
replay gives what a run with the other level would have decided; it reports the step of
each run's first freeze under each level (None: none by the run's own first freeze, or
none at all where the run froze nothing). The replay runs the library's :class:`egeria.rule.FrontRule` as the controller
does: every watched module read at each evaluation, freezes held until the schedule's last
decay where the run held them (``wait_for_last_decay``; the decay step is the demo's last
LR drop, or for a bench run the last reading whose learning rate fell 2x or more), then
the front modules that have settled freeze. Floors are replayed from the smoothed floor
each reading recorded (the raw floors are not recorded), so a run that froze by the floor
test may replay off its own record, as do runs made by the rule's earlier code (a carry
from the last reading before a fall only; freezing at the reading spanning the decay):
``reproduces`` says whether the replay under the run's own level gives its recorded first
freeze, and only those runs compare the two levels.

    .venv/bin/python benchmarks/level_replay.py

Prints the command and a table; writes ``benchmarks/results/level_replay/level_replay.json``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results"
OUT = RESULTS / "level_replay"


def rules():
    from egeria.rule import FrontRule

    class MeanLevel(FrontRule):
        """The rule before 0545474: the level is the moving average's latest value."""

        def level(self, index: int) -> float:
            watch = self.watches.get(index)
            return watch.smoothed[-1] if watch is not None and watch.smoothed else 0.0

    return {"mean": MeanLevel, "median": FrontRule}


def recorded_runs() -> list[dict]:
    """Every recorded run of Egeria's rule with a settle ratio and readings that carry their
    learning rate: its readings, modules, rule settings, hold step and first freeze."""
    runs = []
    for path in sorted(RESULTS.rglob("*.json")):
        if "level_replay" in path.parts or "rule_replay" in path.parts:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        if "runs" in data and "egeria_config" in data:  # egeria demo
            run, config = data["runs"].get("egeria", {}), data["egeria_config"]
            rows, hold = run.get("history") or [], max(data.get("lr_drop_steps", []), default=0)
            modules, events = run.get("modules", []), run.get("events", [])
        elif {"plasticity", "config", "modules", "events"} <= data.keys():  # egeria bench run file
            config, rows, modules, events = data["config"], data["plasticity"], data["modules"], data["events"]
            hold = last_fall(rows)
        else:
            continue
        if not isinstance(config, dict) or config.get("rule") != "egeria" or config.get("settle_ratio") is None or not rows or "lr" not in rows[0]:
            continue
        first = next((e for e in events if e["action"] == "freeze"), None)
        runs.append({
            "run": str(path.relative_to(RESULTS)),
            "rows": rows,
            "modules": modules,
            "config": config,
            "hold": hold if config.get("wait_for_last_decay") else 0,
            # the step the freezing reading was taken at (an asynchronous run applies it later)
            "recorded": None if first is None else first.get("evaluated_at") or first["step"],
            "own_level": "median" if "level" in rows[0] else "mean",
        })
    return runs


def last_fall(rows: list[dict]) -> int:
    """The step before the last reading whose learning rate fell 2x or more (0: none)."""
    hold, previous = 0, None
    for row in rows:
        lr = row.get("lr")
        if previous and lr and previous / lr >= 2:
            hold = row["step"] - 1
        previous = lr or previous
    return hold


def replay(run: dict, rule_class) -> int | None:
    """The step of the first freeze the rule decides (None: none by the run's own first
    freeze, or in all its readings where it froze nothing)."""
    config = run["config"]
    rule = rule_class(config["window"], config["tolerance_ratio"], settle_ratio=config["settle_ratio"],
                      regimes=True, floor_ratio=config.get("floor_ratio"), ceiling_ratio=config.get("ceiling_ratio"))
    by_step: dict[int, list[dict]] = defaultdict(list)
    for row in run["rows"]:
        by_step[row["step"]].append(row)
    for step in sorted(by_step):
        if run["recorded"] is not None and step > run["recorded"]:
            break  # readings after a freeze come from a model with a frozen front
        watched = [run["modules"].index(row["module"]) for row in by_step[step]]
        for index, row in zip(watched, by_step[step]):
            rule.read(index, row["plasticity"], row.get("lr"), row.get("floor"))
        if step <= run["hold"]:
            continue
        if rule.settled_front(watched):
            return step
    return None


def main() -> None:
    command = " ".join([".venv/bin/python", "benchmarks/level_replay.py", *sys.argv[1:]])
    print(command)
    classes = rules()
    results = []
    for run in recorded_runs():
        row = {"run": run["run"], "recorded": run["recorded"], "own_level": run["own_level"],
               **{name: replay(run, cls) for name, cls in classes.items()}}
        row["reproduces"] = row[run["own_level"]] == row["recorded"]
        results.append(row)
    print(f"{'run':72} {'recorded':>9} {'mean':>9} {'median':>9}  reproduces")
    for row in results:
        print(f"{row['run']:72} {str(row['recorded']):>9} {str(row['mean']):>9} {str(row['median']):>9}  "
              f"{row['reproduces']}")
    OUT.mkdir(parents=True, exist_ok=True)
    target = OUT / "level_replay.json"
    target.write_text(json.dumps({"command": command, "results": results}, indent=1) + "\n")
    print(f"wrote {target.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
