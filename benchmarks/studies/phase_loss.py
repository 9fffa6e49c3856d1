"""In which learning-rate phase does a freeze cost training loss?

Where a freeze costs: each learning-rate phase's mean training loss, Egeria against plain
training on the same batches (issue 10, item 4).

Both arms of a demo (``demo.json``) and a plain and an Egeria run of one seed (``egeria
bench`` run files) train on the same batches in the same order, and are identical until
Egeria's first freeze; after it, the gap in training loss shows in which phase the frozen
modules' missing updates cost. The phases are cut at the learning-rate drops.

    .venv/bin/python benchmarks/studies/phase_loss.py benchmarks/results/demo/seed*/demo.json
    .venv/bin/python benchmarks/studies/phase_loss.py --pair PLAIN.json EGERIA.json

Prints the command, then one line per pair: the first freeze and, per phase, plain's mean
loss, Egeria's, and Egeria's minus plain's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _phases(drops: list[int], total: int) -> list[tuple[int, int]]:
    cuts = [0, *drops, total]
    return list(zip(cuts, cuts[1:]))


def _mean(pairs: list[tuple[int, float]], lo: int, hi: int) -> float | None:
    """Mean of the values whose step lies in (lo, hi]."""
    inside = [v for step, v in pairs if lo < step <= hi and v is not None]
    return sum(inside) / len(inside) if inside else None


def from_demo(path: Path) -> dict:
    demo = json.loads(path.read_text())
    egeria = demo["runs"]["egeria"]
    freezes = [e["step"] for e in egeria["events"] if e["action"] == "freeze"]

    def steps(losses: list[float]) -> list[tuple[int, float]]:
        return list(enumerate(losses, start=1))

    return {
        "name": str(path), "drops": demo["lr_drop_steps"], "total": demo["total_steps"],
        "first_freeze": min(freezes, default=None),
        "plain": steps(demo["runs"]["plain"]["losses"]), "egeria": steps(egeria["losses"]),
    }


def from_runs(plain_path: Path, egeria_path: Path) -> dict:
    from egeria.bench.tasks import task_of_run

    plain, egeria = (json.loads(p.read_text()) for p in (plain_path, egeria_path))
    for key in ("task", "seed", "epochs", "limit"):
        if plain.get(key) != egeria.get(key):
            raise SystemExit(f"{plain_path} and {egeria_path} differ in {key}: {plain.get(key)!r} against {egeria.get(key)!r}")
    task = task_of_run(plain)
    if not hasattr(task.scheduler, "milestones"):
        raise SystemExit(f"{plain_path}: task {plain['task']!r} has no step decays ({type(task.scheduler).__name__}) to cut phases at")
    freezes = [e["step"] for e in egeria["events"] if e["action"] == "freeze"]
    records = lambda run: [(r["step"], r["loss"]) for r in run["records"]]  # noqa: E731 - each record: mean loss since the previous one
    return {
        "name": f"{egeria_path.name} against {plain_path.name}", "drops": sorted(task.scheduler.milestones),
        "total": plain["total_steps"], "first_freeze": min(freezes, default=None),
        "plain": records(plain), "egeria": records(egeria),
    }


def report(pair: dict) -> dict:
    rows = []
    for lo, hi in _phases(pair["drops"], pair["total"]):
        p, e = _mean(pair["plain"], lo, hi), _mean(pair["egeria"], lo, hi)
        rows.append({"steps": [lo + 1, hi], "plain": p, "egeria": e,
                     "gap": None if p is None or e is None else e - p})
    return {"name": pair["name"], "first_freeze": pair["first_freeze"], "phases": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demos", type=Path, nargs="*", help="demo.json files")
    parser.add_argument("--pair", type=Path, nargs=2, action="append", default=[], metavar=("PLAIN", "EGERIA"),
                        help="a plain and an Egeria run file of the same task and seed")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    if not args.demos and not args.pair:
        parser.error("give demo.json files or --pair PLAIN EGERIA")
    print(" ".join([".venv/bin/python", "benchmarks/studies/phase_loss.py", *sys.argv[1:]]))
    pairs = [from_demo(p) for p in args.demos] + [from_runs(p, e) for p, e in args.pair]
    results = [report(pair) for pair in pairs]
    for r in results:
        cells = "  ".join(
            f"steps {row['steps'][0]}-{row['steps'][1]}: {row['plain']:.4f} / {row['egeria']:.4f} ({row['gap']:+.4f})"
            for row in r["phases"] if row["gap"] is not None
        )
        print(f"{r['name']}: first freeze {r['first_freeze']}\n  plain / Egeria training loss: {cells}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
