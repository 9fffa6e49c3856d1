"""Does "drift x learning-rate mass still ahead" say how far a module still has to go?

Issue 28 asks for one criterion in place of the rule's patches: a module freezes when its
readings say it has settled *and the movement still to come is small*. The oracle
(``oracle.py``) measured, for plain seed 0 of resnet-fmnist at full length, each module's
distance to where it ends; the readings of an Egeria run of the same task (every module
read at every evaluation until its first freeze) give each module's drift over each
evaluation interval. This study puts the two side by side:

- ``v`` = a reading's drift per unit of learning-rate mass over its interval (the drift
  the module makes per unit of LR; the run's schedule read by :mod:`egeria.lr_schedule`);
- ``A`` = ``v`` x the LR mass still ahead: the drift still to come if the module keeps
  drifting per unit of LR as it does now (a path length, an upper bound of the distance);
- ``R`` = the median of the last 3 ``A`` over the largest such median so far: how much of
  its largest outlook the module still has ahead.

For each threshold on ``R`` it prints the first step each module would cross it and the
oracle's distance to the end there (relative to the module's largest); it writes
``results/movement_ahead/movement_ahead.json`` and a plot of ``R`` and the oracle's
relative distance over the run.

    .venv/bin/python benchmarks/studies/movement_ahead.py

No training: it reads committed results (seconds).
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORACLE = ROOT / "benchmarks/results/oracle/oracle.json"
OUT = ROOT / "benchmarks/results/movement_ahead"
THRESHOLDS = (0.1, 0.03, 0.01, 0.003, 0.001)


def _schedule(run: dict):
    from egeria.bench.tasks import task_of_run
    from egeria.lr_schedule import read_schedule

    task = task_of_run(run)
    return read_schedule(task.scheduler, task.optimizer, run["total_steps"])


def _nearest(steps: list[int], step: int) -> int:
    return min(range(len(steps)), key=lambda k: abs(steps[k] - step))


def outlook(run: dict, schedule, module: str) -> list[dict]:
    """Each reading of ``module``: step, drift per unit LR mass, movement ahead, R."""
    rows = [r for r in run["plasticity"] if r["module"] == module]
    out, previous, largest, recent = [], None, 0.0, []
    for row in rows:
        step = row["step"]
        start = previous if previous is not None else max(0, step - (rows[1]["step"] - rows[0]["step"] if len(rows) > 1 else 1))
        previous = step
        mass = schedule.mass_between(start, step)
        if mass <= 0:
            continue
        v = row["plasticity"] / mass
        ahead = v * schedule.mass_ahead(step)
        recent = (recent + [ahead])[-3:]
        level = statistics.median(recent)
        largest = max(largest, level)
        out.append({"step": step, "drift_per_mass": v, "ahead": ahead, "R": level / largest if largest else 1.0,
                    "mass_ahead": schedule.mass_ahead(step)})
    return out


def study(oracle: dict, run_path: str) -> dict:
    run = json.loads((ROOT / run_path).read_text())
    schedule = _schedule(run)
    steps = oracle["steps"]
    modules = {}
    for entry in oracle["modules"]:
        name, distance = entry["module"], entry["distance"]
        largest = max(distance)
        series = outlook(run, schedule, name)
        if not series:
            continue
        crossings = {}
        for tau in THRESHOLDS:
            hit = next((p for p in series if p["R"] <= tau), None)
            if hit is not None:
                at = _nearest(steps, hit["step"])
                crossings[str(tau)] = {"step": hit["step"], "oracle_relative_distance": distance[at] / largest,
                                       "mass_ahead": hit["mass_ahead"]}
        modules[name] = {"series": series, "crossings": crossings,
                         "oracle_relative": [d / largest for d in distance]}
    return {"run": run_path, "lr_drops": oracle["lr_drops"], "steps": steps, "modules": modules,
            "last_reading": max(r["step"] for r in run["plasticity"])}


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["modules"])
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), sharey=True)
    for ax, name in zip(axes, names):
        m = result["modules"][name]
        ax.semilogy([p["step"] for p in m["series"]], [p["R"] for p in m["series"]], label="R (readings x LR mass ahead)")
        ax.semilogy(result["steps"], m["oracle_relative"], "o-", ms=2, label="oracle: distance to end")
        for drop in result["lr_drops"]:
            ax.axvline(drop, color="grey", lw=0.6, ls="--")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("step")
    axes[0].set_ylabel("share of the module's largest")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    from egeria.bench.machine import describe_machine

    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/studies/movement_ahead.py", *sys.argv[1:]])
    oracle = json.loads(ORACLE.read_text())
    print("command:", command)
    print("machine:", describe_machine()["cpu"], "(no training: committed results only)")
    results = []
    for entry in oracle["egeria"]:
        result = study(oracle, entry["path"])
        results.append(result)
        print(f"\nreadings of {entry['path']} (read until step {result['last_reading']}), LR drops {oracle['lr_drops']}")
        print(f"{'module':24s}" + "".join(f"  R<={t:<6}" for t in THRESHOLDS))
        for name, m in result["modules"].items():
            cells = []
            for tau in THRESHOLDS:
                c = m["crossings"].get(str(tau))
                cells.append(f"  {c['step']:5d} {c['oracle_relative_distance']:.3f}" if c else f"  {'-':>11s}")
            print(f"{name:24s}" + "".join(cells))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "movement_ahead.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    _plot(results[-1], OUT / "movement_ahead.png")
    print(f"\nwrote {OUT / 'movement_ahead.json'} and movement_ahead.png (cells: first step with R at or under the"
          " threshold, and the oracle's distance to the end there, as a share of the module's largest)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
