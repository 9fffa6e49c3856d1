"""The noise of a plasticity reading: readings on each evaluation's own training batch
against readings on one fixed probe batch (``fixed_probe=True``), same run otherwise.

Both arms train ResNet-20 on the first 12,800 Fashion-MNIST images for 4 epochs (400
steps, LR 0.1, /10 at steps 200 and 300) from the same seed, with Egeria's own rule
reading every freezable module every 5 steps on 64 samples and never freezing (so both
arms train identically and read the same weights). Per module and LR phase (the phase's
steps after its first 50) it reports the readings' median and their spread: the median
absolute change between consecutive readings relative to the median reading. Batch noise
shows as spread that the fixed probe does not have; the drift of the weights shows in both.

    .venv/bin/python benchmarks/reading_noise.py

Writes ``benchmarks/results/reading_noise/noise.json``; prints the command, the machine
and the table.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = {"LR 0.1": (150, 200), "LR 0.01": (250, 300), "LR 0.001": (350, 401)}


def spread(values: list[float]) -> tuple[float, float]:
    """(median, median |consecutive change| / median)."""
    middle = statistics.median(values)
    changes = [abs(b - a) for a, b in zip(values, values[1:])]
    return middle, statistics.median(changes) / middle if middle > 0 and changes else float("nan")


def main() -> None:
    from egeria.bench import run_bench
    from egeria.machine import describe_machine

    command = " ".join([".venv/bin/python", "benchmarks/reading_noise.py", *sys.argv[1:]])
    print(command)
    print(describe_machine())
    arms = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fixed in (False, True):
            overrides = {
                "rule": "egeria", "eval_interval": 5, "probe_size": 64, "horizon": 1e-12, "floor_ratio": 0,
                "fixed_probe": fixed, "executor": "inline", "cost_budget": None,
            }
            run = run_bench("resnet-fmnist", "egeria", seed=0, epochs=4, out_dir=f"{tmp}/{fixed}", layout="cpu",
                            limit=12_800, eval_limit=1000, overrides=overrides)
            assert not [e for e in run["events"] if e["action"] == "freeze"], "a module froze"
            arms["fixed probe" if fixed else "training batch"] = run
    modules = next(iter(arms.values()))["modules"][:-1]
    table = []
    for phase, (start, end) in PHASES.items():
        for module in modules:
            row = {"phase": phase, "module": module}
            for arm, run in arms.items():
                values = [r["plasticity"] for r in run["plasticity"] if r["module"] == module and start <= r["step"] < end]
                row[arm] = {"readings": len(values), "median": None, "spread": None}
                if len(values) >= 3:
                    row[arm]["median"], row[arm]["spread"] = spread(values)
            table.append(row)
    print(f"{'phase':9} {'module':22} {'readings':>8} {'median (batch)':>15} {'spread (batch)':>15} {'median (probe)':>15} {'spread (probe)':>15}")
    for row in table:
        batch, probe = row["training batch"], row["fixed probe"]
        if batch["median"] is None or probe["median"] is None:
            continue
        print(f"{row['phase']:9} {row['module']:22} {batch['readings']:>8} {batch['median']:>15.3e} {batch['spread']:>15.2f} "
              f"{probe['median']:>15.3e} {probe['spread']:>15.2f}")
    out = ROOT / "benchmarks/results/reading_noise/noise.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "machine": describe_machine(), "phases": PHASES, "table": table,
                               "finals": {arm: run["final"] for arm, run in arms.items()}}, indent=1))


if __name__ == "__main__":
    main()
