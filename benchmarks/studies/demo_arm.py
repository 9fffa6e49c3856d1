"""What does the demo end at under other Egeria settings (one arm, not timed)?

One arm of the demo, for accuracy studies of Egeria's settings (not timed against plain):
the demo's data, model, schedule and seeded batch order, Egeria under ``EgeriaConfig`` with
the fields given changed, or plain training.

    .venv/bin/python benchmarks/studies/demo_arm.py SEED egeria horizon=0.001 [FIELD=VALUE ...]
    .venv/bin/python benchmarks/studies/demo_arm.py SEED plain
    .venv/bin/python benchmarks/studies/demo_arm.py SEED egeria --history FILE [FIELD=VALUE ...]

Prints one JSON line: the seed, the arm, the changed fields, the per-epoch test accuracy,
the training time, the mean training loss over the last LR phase, Egeria's decisions, and
how many steps its losses matched those of the committed demo's plain arm of that seed
(``benchmarks/results/demo/seedS/demo.json``; the two arms match until the first freeze when
the machine and thread count are the same), with that arm's last-phase loss beside it. ``--history FILE`` also writes the Egeria arm's readings
(``eg.history``, with the seed and the config) as JSON, for ``benchmarks/studies/reading_floor.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> None:
    import egeria.bench.demo as demo
    from egeria import EgeriaConfig

    if len(argv) < 2 or argv[1] not in ("plain", "egeria"):
        raise SystemExit(__doc__)
    seed, arm = int(argv[0]), argv[1]
    rest = list(argv[2:])
    history = None
    if "--history" in rest:
        at = rest.index("--history")
        if at + 1 >= len(rest):
            raise SystemExit("--history needs a file name")
        history = Path(rest.pop(at + 1))
        rest.pop(at)
        if arm != "egeria":
            raise SystemExit("--history writes the Egeria arm's readings; the plain arm has none")
    changed = {}
    for item in rest:
        field, _, text = item.partition("=")
        try:
            changed[field] = json.loads(text)
        except json.JSONDecodeError:
            changed[field] = text
    s = demo.FULL
    shared = demo.prepare(s, seed)
    config = EgeriaConfig(**changed) if arm == "egeria" else None
    record, extra = demo._train(
        arm, shared.initial, shared.train, shared.test, s, seed, shared.milestones, config, shared.total_steps, False
    )
    losses = record["losses"]
    last = shared.milestones[-1]
    result = {
        "seed": seed, "arm": arm, "changed": changed,
        "accuracy": [round(100 * e["test_accuracy"], 2) for e in record["epochs"]],
        "train_time_s": round(record["train_time_s"], 1),
        "last_phase_loss": round(sum(losses[last:]) / len(losses[last:]), 4),
        "events": [(e["step"], e["action"], e["modules"]) for e in extra.get("events", [])],
    }
    committed = ROOT / f"benchmarks/results/demo/seed{seed}/demo.json"
    if committed.exists():
        plain = json.loads(committed.read_text())["runs"]["plain"]["losses"]
        result["matches_committed_plain_through"] = demo.identical_through(losses, plain)
        result["committed_plain_last_phase_loss"] = round(sum(plain[last:]) / len(plain[last:]), 4)
    print(json.dumps(result))
    if history is not None:
        readings = {"task": "demo", "seed": seed, "config": config.to_dict(), "plasticity": extra.get("history", [])}
        history.parent.mkdir(parents=True, exist_ok=True)
        history.write_text(json.dumps(readings) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
