"""Did a change of code change Egeria's decisions on the demo?

Whether a change of code changed Egeria's decisions: the demo's Egeria arm at whichever
egeria ``PYTHONPATH`` holds, written as JSON to compare with another commit's (issue 30 item 6,
the reshape: "the same decisions, bit for bit, on the recorded demo seed").

    PYTHONPATH=<checkout>/src .venv/bin/python benchmarks/same_decisions.py OUT.json [SEED]

The demo's data, model, schedule and seeded batch order (seed 2 by default, the one whose
run the README shows), Egeria's default configuration except ``eval_interval=20``, the n the
recorded seed-2 run chose: left to the cost budget, n follows the machine's wall-clock
figures (two runs of one commit beside each other chose 49 and 31), and decisions with it.
Writes the per-step training losses, the per-epoch test accuracy, the decisions and every
plasticity reading. It imports the demo from before the reshape (``egeria.demo``) or after it
(``egeria.bench.demo``), so one copy of this script runs against both.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from types import SimpleNamespace


def main(argv: list[str]) -> None:
    if not argv or len(argv) > 2:
        raise SystemExit(__doc__)
    try:
        import egeria.bench.demo as demo  # after the reshape
    except ImportError:
        import egeria.demo as demo  # before it
    import torch

    from egeria import EgeriaConfig

    out, seed = argv[0], int(argv[1]) if len(argv) > 1 else 2
    if not hasattr(demo, "_Alone"):  # before the reshape the demo insisted on turns: none to take alone
        idle = SimpleNamespace(join=lambda: None, step=lambda: None, leave=lambda: None)
        demo.current_turns = lambda: idle  # type: ignore[attr-defined]
    s = demo.FULL
    shared = demo.prepare(s, seed)
    record, extra = demo._train(
        "egeria", shared.initial, shared.train, shared.test, s, seed, shared.milestones, EgeriaConfig(eval_interval=20),
        shared.total_steps, False,
    )
    result = {
        "command": " ".join(["benchmarks/same_decisions.py", *argv]),
        "machine": f"{platform.platform()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "demo_module": demo.__name__, "seed": seed,
        "losses": record["losses"], "test_accuracy": [e["test_accuracy"] for e in record["epochs"]],
        "events": extra["events"], "history": extra["history"],
    }
    with open(out, "w") as f:
        json.dump(result, f)
    print(out, demo.__name__, [(e["step"], e["action"], e["modules"]) for e in extra["events"]])


if __name__ == "__main__":
    main(sys.argv[1:])
