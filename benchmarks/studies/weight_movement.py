"""How far did fine-tuning move each module of the pretrained encoder, relative to its own weights?

One candidate signal for telling a pretrained layer being adapted from one being learned
(issue 50, item 2) is its movement relative to its own weights. This reads it where it can
be read whole: the final weights of a ``minilm-ptb-order`` run (the ``.pt`` that
``egeria.bench.trainer_run`` writes beside its JSON; not committed) against the packaged
all-MiniLM-L6-v2 it started from, per module of the run's partition (embeddings, layers 0-5,
the pooler with the classifier): ``||W_final - W_start|| / ||W_start||`` over the module's
floating tensors. The classifier is new, initialised from the run's seed (``--seed``, 0 by
default), so the last figure is mostly movement from a random start.

    .venv/bin/python benchmarks/studies/weight_movement.py RUN.pt [RUN.pt ...] [--out FILE]

Prints the command, the machine and one row per run; writes them as JSON (default
``benchmarks/results/weight_movement/minilm-ptb-order.json``). No training: seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks/results/weight_movement/minilm-ptb-order.json"


def module_of(key: str) -> str:
    """The partition module a state-dict key belongs to."""
    if ".embeddings." in f".{key}":
        return "embeddings"
    if ".encoder.layer." in key:
        return "layer." + key.split(".encoder.layer.")[1].split(".")[0]
    return "pooler+classifier"


def movement(start: dict, final: dict) -> dict[str, float]:
    """Module -> the norm of its weights' change over the norm of its starting weights."""
    sums: dict[str, list[float]] = {}
    for key, value in final.items():
        before = start.get(key)
        if before is None or not value.is_floating_point() or before.shape != value.shape:
            continue
        moved, size = sums.setdefault(module_of(key), [0.0, 0.0])
        sums[module_of(key)] = [moved + float((value.double() - before.double()).pow(2).sum()),
                                size + float(before.double().pow(2).sum())]
    return {module: (moved / size) ** 0.5 for module, (moved, size) in sums.items() if size > 0}


def main(argv: list[str] | None = None) -> int:
    import torch

    from egeria.bench.machine import describe_machine
    from egeria.bench.trainer_run import build_trainer_task

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("weights", nargs="+", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (the classifier's start)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/studies/weight_movement.py",
                          *(sys.argv[1:] if argv is None else argv)])
    print("command:", command)
    print("machine:", describe_machine()["cpu"], "(no training)")
    task = build_trainer_task("minilm-ptb-order", seed=args.seed, limit=64, eval_limit=1)
    start = {k: v.detach().clone() for k, v in task.model.state_dict().items()}
    rows = []
    for path in args.weights:
        final = torch.load(path, map_location="cpu", weights_only=True)
        moved = movement(start, final)
        rows.append({"weights": str(path), "movement": moved})
        print(f"{path}: " + ", ".join(f"{m} {v:.4f}" for m, v in moved.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "machine": describe_machine(), "runs": rows}, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
