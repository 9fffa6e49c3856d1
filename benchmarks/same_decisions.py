"""Does Egeria decide the same on the demo's task however fast the machine runs it?

Two uses.

1. Whether a change of code changed Egeria's decisions: the demo's Egeria arm at whichever
   egeria ``PYTHONPATH`` holds, written as JSON to compare with another commit's::

       PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/same_decisions.py OUT.json [SEED]

   Egeria's default configuration except ``eval_interval=20`` (the n the recorded seed-2
   run chose), the demo's data, model, schedule and seeded batch order (seed 2 by default).

2. Whether the machine's pace moves the decisions (record 038,
   docs/decisions/038-steps-not-readings.md)::

       .venv/bin/python benchmarks/same_decisions.py --matrix benchmarks/results/same-decisions/<machine> [SEED]

   The demo's Egeria arm (seed 0 by default) nine times: three runs in PyTorch's default memory
   layout and three with the model's weights channels-last (a step about 1.3x faster on a CPU
   with AVX-512), each with Egeria's defaults (the cost budget free to space the readings), and
   three with ``eval_interval`` pinned at 10, 20 and 40. Each run is written as it finishes and
   skipped when its file exists (runs of tens of minutes, across sessions); then
   ``summary.json`` and ``freeze-steps.png``: each run's n and the step each module froze at,
   and the largest spread of a module's freeze step against the coarsest interval.

Writes the per-step training losses, the per-epoch test accuracy, the decisions and every
plasticity reading of each run.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

#: The matrix of use 2: run name -> (channels-last weights, EgeriaConfig overrides).
MATRIX = {  # in the order they run: one of each kind first
    "default-1": (False, {}), "channels-last-1": (True, {}), "n40": (False, {"eval_interval": 40}),
    "n10": (False, {"eval_interval": 10}), "default-2": (False, {}), "channels-last-2": (True, {}),
    "n20": (False, {"eval_interval": 20}), "default-3": (False, {}), "channels-last-3": (True, {}),
}


def run_arm(seed: int, overrides: dict, channels_last: bool = False) -> dict:
    """The demo's Egeria arm with ``EgeriaConfig(**overrides)``: its record."""
    try:
        import egeria.bench.demo as demo  # after the reshape
    except ImportError:
        import egeria.demo as demo  # before it
    import torch

    from egeria import EgeriaConfig

    if not hasattr(demo, "_Alone"):  # before the reshape the demo insisted on turns: none to take alone
        idle = SimpleNamespace(join=lambda: None, step=lambda: None, leave=lambda: None)
        demo.current_turns = lambda: idle  # type: ignore[attr-defined]
    setup = demo._setup

    def setup_channels_last(*args):
        model, optimizer, scheduler = setup(*args)
        return model.to(memory_format=torch.channels_last), optimizer, scheduler

    demo._setup = setup_channels_last if channels_last else setup
    try:
        s = demo.FULL
        shared = demo.prepare(s, seed)
        record, extra = demo._train(
            "egeria", shared.initial, shared.train, shared.test, s, seed, shared.milestones, EgeriaConfig(**overrides),
            shared.total_steps, False,
        )
    finally:  # the next run of the matrix, in this process, gets the demo's own layout back
        demo._setup = setup
    return {
        "machine": f"{platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "demo_module": demo.__name__, "seed": seed, "channels_last": channels_last, "config": overrides,
        "eval_interval": extra.get("eval_interval"), "train_s": record.get("train_time_s"),
        "losses": record["losses"], "test_accuracy": [e["test_accuracy"] for e in record["epochs"]],
        "events": extra["events"], "history": extra["history"],
    }


def summarize(folder: Path) -> dict:
    """Each run's n and freeze steps, and per module the spread of its freeze step."""
    runs = {}
    for name in MATRIX:
        path = folder / f"{name}.json"
        if path.exists():
            run = json.loads(path.read_text())
            frozen = {m: e["step"] for e in run["events"] if e["action"] == "freeze" for m in e["modules"]}
            runs[name] = {"eval_interval": run["eval_interval"], "train_s": run.get("train_s"), "frozen": frozen,
                          "final_accuracy": run["test_accuracy"][-1]}
    coarsest = max((r["eval_interval"] or 0 for r in runs.values()), default=0)
    spread = _spread(runs)
    from egeria.config import MIN_EVAL_INTERVAL as lag  # D at Egeria's defaults

    # An explicit n below D shortens the drift a reading covers, and with it the spans
    # (record 038): the runs read at D or sparser, apart.
    at_lag = _spread({k: r for k, r in runs.items() if (r["eval_interval"] or lag) >= lag})
    return {"runs": runs, "spread": spread, "coarsest_interval": coarsest,
            "within_one_interval": all(s is not None and s <= coarsest for s in spread.values()) and bool(spread),
            "spread_n_at_least_lag": at_lag,
            "within_one_interval_n_at_least_lag":
                all(s is not None and s <= coarsest for s in at_lag.values()) and bool(at_lag)}


def _spread(runs: dict) -> dict:
    """Per module, the largest difference between two runs' freeze steps (None: a run did not freeze it)."""
    spread = {}
    for module in sorted({m for r in runs.values() for m in r["frozen"]}):
        steps = [r["frozen"].get(module) for r in runs.values()]
        spread[module] = None if None in steps else max(steps) - min(steps)
    return spread


def plot(summary: dict, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(runs) + 1.5), constrained_layout=True)
    for row, (name, run) in enumerate(runs.items()):
        steps = sorted(set(run["frozen"].values()))
        ax.scatter(steps, [row] * len(steps), marker="|", s=300)
        words = f"n={run['eval_interval']}" + ("" if steps else ": nothing froze")
        ax.annotate(words, (0, row), xytext=(4, 0), textcoords="offset points", va="center")
    ax.set_yticks(range(len(runs)), list(runs))
    ax.set_xlim(0, 800)
    ax.set_xlabel("optimizer step of each freeze (the demo's 800 steps)")
    ax.set_title("Egeria's freezes on the demo's task, by run:\nn left to the budget, channels-last weights, n pinned")
    fig.savefig(target, dpi=110)


def main(argv: list[str]) -> None:
    from egeria.bench.machine import describe_machine

    if argv and argv[0] == "--matrix":
        if len(argv) not in (2, 3):
            raise SystemExit(__doc__)
        folder, seed = Path(argv[1]), int(argv[2]) if len(argv) > 2 else 0
        folder.mkdir(parents=True, exist_ok=True)
        command = shlex.join([".venv/bin/python", "benchmarks/same_decisions.py", *argv])
        print("command:", command)
        print("machine:", describe_machine())
        for name, (channels_last, overrides) in MATRIX.items():
            path = folder / f"{name}.json"
            if path.exists():
                print(name, "done before: skipped")
                continue
            result = run_arm(seed, overrides, channels_last)
            result["command"] = command
            path.write_text(json.dumps(result))
            print(name, f"n={result['eval_interval']}", [(e["step"], e["modules"]) for e in result["events"]
                                                         if e["action"] == "freeze"], flush=True)
        summary = {"command": command, "machine": describe_machine(), **summarize(folder)}
        (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        plot(summary, folder / "freeze-steps.png")
        print(json.dumps({k: summary[k] for k in ("spread", "coarsest_interval", "within_one_interval", "spread_n_at_least_lag",
                                                 "within_one_interval_n_at_least_lag")}, indent=1))
        return
    if not argv or len(argv) > 2:
        raise SystemExit(__doc__)
    out, seed = argv[0], int(argv[1]) if len(argv) > 1 else 2
    result = run_arm(seed, {"eval_interval": 20})
    result["command"] = " ".join(["benchmarks/same_decisions.py", *argv])
    with open(out, "w") as f:
        json.dump(result, f)
    print(out, result["demo_module"], [(e["step"], e["action"], e["modules"]) for e in result["events"]])


if __name__ == "__main__":
    main(sys.argv[1:])
