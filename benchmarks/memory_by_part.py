"""What a frozen front frees: memory by part for plain fine-tuning and for Egeria with the
front frozen, side by side in one run (issue 75; egeria.memory, egeria.optimizer_state).

The task is (f), ``minilm-ptb-order``: the pretrained all-MiniLM-L6-v2 fine-tuned through
the HF Trainer (AdamW, batch 32, 48 ids; :mod:`egeria.bench.trainer_run`), on a shorter
configuration: the first ``--steps`` x 32 training sentences, one epoch, 200 held-out
sentences for the one evaluation. Two runs from the same seed:

- plain: ``policy="none"``;
- Egeria freezing the front one module at a time: FreezeOut's schedule (linear, from a
  quarter of the run; the last freeze at 85% of it with five modules), capped where Egeria's
  default cap stops (``max_frozen_flops`` 0.75, record 011): every depth of front Egeria's
  rule may freeze on (f), the deepest included.

Memory is measured every :data:`SAMPLE` steps and around each freeze (``egeria.memory``,
``SAMPLE_EVERY`` set to it here). Printed: for each frozen depth, gradients plus optimizer
state against plain's at the same step, and each part in MiB, plain and Egeria side by side,
at the deepest front; and the goal of issue 75: gradients plus optimizer state at least 60%
smaller once the front is frozen. Memory figures count bytes, not time: they hold under
CPU contention. On a CPU run the released optimizer state stays in the same host memory
(its own row); on an accelerator it is the device memory handed back.

Run from the repository root::

    .venv/bin/python benchmarks/memory_by_part.py            # about 15 min on a busy 2-core VM
    .venv/bin/python benchmarks/memory_by_part.py --quick    # smoke run
    .venv/bin/python benchmarks/memory_by_part.py --from-runs  # the tables again from the run files

Writes ``benchmarks/results/memory/memory_by_part.json``, ``memory_by_part.png`` and the
two run files under ``benchmarks/results/memory/runs/`` (``egeria report`` reads them).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", module=r"torch\.ao(\..*)?")

import egeria.memory  # noqa: E402
from egeria.bench.machine import describe_machine  # noqa: E402
from egeria.bench.plots import plot_memory  # noqa: E402
from egeria.bench.trainer_run import run_trainer_bench  # noqa: E402

TASK = "minilm-ptb-order"
SAMPLE = 10
GOAL = 0.60  # gradients plus optimizer state at least this much smaller


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def after_freeze(run: dict, step: int) -> dict:
    """The first memory row measured after ``step`` (the freeze's)."""
    return next(row for row in run["memory"] if row["step"] > step)


def plain_at(run: dict, step: int) -> dict:
    """The plain run's latest memory row at or before ``step`` (nothing changes between its
    rows but the activations' batch)."""
    return [row for row in run["memory"] if row["step"] <= step][-1]


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:8.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
    parser.add_argument("--out", default="benchmarks/results/memory")
    parser.add_argument("--quick", action="store_true", help="12 steps (a smoke run)")
    parser.add_argument("--from-runs", action="store_true",
                        help="train nothing: summarise the two run files already under OUT/runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 12
    if args.steps < 8:
        raise SystemExit(f"--steps {args.steps}: at least 8, so that the schedule freezes")
    logging.basicConfig(level=logging.WARNING)
    command = "python benchmarks/memory_by_part.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"command: {command}")
    print(f"machine: {cpu_model()}")
    egeria.memory.SAMPLE_EVERY = SAMPLE
    out = Path(args.out)
    runs = {}
    for label, policy, overrides in (
        ("plain", "none", None),
        ("egeria", "freezeout", {"policy_options": {"t0": 0.25, "scaling": "linear"}, "max_frozen_flops": 0.75}),
    ):
        if args.from_runs:
            runs[label] = json.loads((out / "runs" / "cpu" / TASK / f"{policy}-seed0.json").read_text())
            print(f"{label}: {runs[label]['command']} (code {runs[label]['code']})")
            continue
        runs[label] = run_trainer_bench(
            TASK, policy, seed=0, epochs=1, limit=args.steps * 32, eval_limit=200, out_dir=out / "runs",
            records_per_epoch=1, overrides=overrides, command=command,
        )
    events = [e for e in runs["egeria"]["events"] if e["action"] == "freeze"]
    print(f"\ngradients + optimizer state (MiB) at the first step measured after each freeze, against plain's:")
    print(f"{'step':>5s} {'frozen':>6s} {'plain':>8s} {'egeria':>8s} {'smaller':>8s}  front")
    depths = []
    for event in events:
        row = after_freeze(runs["egeria"], event["step"])
        plain = plain_at(runs["plain"], row["step"])
        before = plain["gradients"] + plain["optimizer_state"]
        after = row["gradients"] + row["optimizer_state"]
        front = runs["egeria"]["modules"][: row["frozen"]]
        depths.append({"step": row["step"], "frozen": row["frozen"], "front": front, "plain": before, "egeria": after,
                       "smaller": 1 - after / before, "plain_row": plain, "egeria_row": row})
        print(f"{row['step']:5d} {row['frozen']:6d} {mib(before)} {mib(after)} {100 * (1 - after / before):7.1f}%  "
              f"{front[-1]}")
    deepest = depths[-1]
    print(f"\nmemory by part (MiB) at step {deepest['step']}, {deepest['frozen']} modules frozen "
          f"({', '.join(deepest['front'])}):")
    print(f"{'part':28s} {'plain':>8s} {'egeria':>8s}")
    for part in egeria.memory.PARTS:
        print(f"{part:28s} {mib(deepest['plain_row'][part])} {mib(deepest['egeria_row'][part])}")
    first_met = next((d for d in depths if d["smaller"] >= GOAL), None)
    met = deepest["smaller"] >= GOAL
    print(f"\ngoal: gradients + optimizer state >= {100 * GOAL:.0f}% smaller once the front is frozen: "
          f"{'met' if met else 'NOT met'} at the deepest front ({100 * deepest['smaller']:.1f}%); "
          + (f"first met with {first_met['frozen']} modules frozen ({100 * first_met['smaller']:.1f}%)"
             if first_met else "met at no depth"))
    print("(on this CPU run the released state, "
          f"{deepest['egeria_row']['optimizer_state_released'] / 2**20:.2f} MiB at the deepest front, stays in the "
          "same host memory; on an accelerator it leaves the device)")
    result = {
        "command": command,
        "machine": {"cpu_model": cpu_model(), **describe_machine("cpu")},
        "task": TASK,
        "steps": args.steps,
        "sample_every": SAMPLE,
        "depths": [{k: v for k, v in d.items() if not k.endswith("_row")} for d in depths],
        "deepest": {"plain": deepest["plain_row"], "egeria": deepest["egeria_row"]},
        "goal": {"smaller_at_least": GOAL, "met_at_deepest": met,
                 "first_met_frozen": None if first_met is None else first_met["frozen"]},
        "runs": {label: {"command": run["command"], "code": run["code"], "memory": run["memory"],
                         "events": run["events"], "final": run["final"]}
                 for label, run in runs.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_by_part.json").write_text(json.dumps(result, indent=1))
    name = plot_memory(TASK, [runs["plain"], runs["egeria"]], out, "memory_by_part.png")
    print(f"wrote {out / 'memory_by_part.json'} and {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
