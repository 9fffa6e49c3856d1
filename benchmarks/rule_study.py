"""Why do modules freeze late or never? The freezing rule's record in benchmark runs.

For each run (JSON written by ``egeria bench``) and each layer module it prints when its
readings started, its tolerance T and the slopes T came from, the most consecutive stale
readings it reached, when it froze and unfroze, and the latency the rule imposed between
the end of bootstrapping and each freeze (the paper's rule: bootstrap, one reading to
build the reference, 3 readings for T, W stale readings, one module at a time).

    .venv/bin/python benchmarks/rule_study.py RUN.json [RUN.json ...] [--out study.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def study(run: dict) -> dict:
    """The per-module record of one run, one episode per stretch between unfreezes."""
    events = run.get("events", [])
    guided = next((e["step"] for e in events if e["action"] == "guided"), None)
    unfreezes = [e["step"] for e in events if e["action"] == "unfreeze"]
    bounds = [0, *unfreezes, run["total_steps"] + 1]
    modules = []
    for name in run["modules"][:-1]:
        rows = [r for r in run.get("plasticity", []) if r["module"] == name]
        episodes = []
        for start, end in zip(bounds, bounds[1:]):
            part = [r for r in rows if start < r["step"] <= end]
            slopes = [r["slope"] for r in part if r["slope"] is not None]
            froze = [e["step"] for e in events if e["action"] == "freeze" and name in e["modules"] and start < e["step"] <= end]
            episodes.append(
                {
                    "from_step": start,
                    "readings": len(part),
                    "first_reading": part[0]["step"] if part else None,
                    "tolerance": part[-1]["tolerance"] if part else None,
                    "first_slopes": slopes[:3],
                    "late_slope_median": _median([abs(s) for s in slopes[3:]]),
                    "most_stale": max((r["stale"] for r in part), default=0),
                    "froze_at": froze[0] if froze else None,
                }
            )
        modules.append({"module": name, "episodes": episodes})
    return {
        "run": f"{run['task']}/{run['policy']}-seed{run['seed']}",
        "config": {k: run["config"].get(k) for k in ("rule", "eval_interval", "window", "probe_size", "fixed_probe", "reference_precision")},
        "total_steps": run["total_steps"],
        "guided_at": guided,
        "unfreezes": unfreezes,
        "final_metric": run["final"]["metric"],
        "modules": modules,
    }


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[len(values) // 2]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(" ".join([".venv/bin/python", "benchmarks/rule_study.py", *sys.argv[1:]]))
    results = [study(json.loads(Path(p).read_text())) for p in args.runs]
    for r in results:
        print(f"\n{r['run']} {r['config']}: guided at step {r['guided_at']}, unfreezes at {r['unfreezes']}, "
              f"final {r['final_metric']:.4f} ({r['total_steps']} steps)")
        print("  module                 from  readings first  T         first 3 slopes                    |late slope| stale froze")
        for m in r["modules"]:
            for e in (e for e in m["episodes"] if e["readings"]):
                slopes = ", ".join(_fmt(x) for x in e["first_slopes"])
                print(f"  {m['module']:<22} {e['from_step']:>5} {e['readings']:>8} {str(e['first_reading']):>5}  "
                      f"{_fmt(e['tolerance']):<9} {slopes:<33} {_fmt(e['late_slope_median']):<11} {e['most_stale']:>5} "
                      f"{e['froze_at'] if e['froze_at'] is not None else '-'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
