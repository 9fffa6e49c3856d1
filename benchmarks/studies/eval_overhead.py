"""What does evaluating cost before anything freezes, arms run one after the other (older)?

Evaluation-only overhead: Egeria evaluating plasticity but never freezing, against plain
training, in one layout (issue 10's goal: at most 2% CPU-only, at most 1% accel).

Both arms train one task's model (ResNet-20 by default; ``--task vgg-fmnist`` the suite's
VGG-style net under warm-up + cosine) on the same Fashion-MNIST slice from the same seed, alternating
plain, Egeria, plain, Egeria... so that the machine's drift within the session falls on
both. Egeria runs its default configuration with ``horizon`` set so low (and ``floor_ratio`` off) that no
module ever freezes (its readings, controller and cost budget all run as usual).

    .venv/bin/python benchmarks/studies/eval_overhead.py --layout accel [--task T] [--steps 400] [--repeats 2] [--cache]

With ``--cache`` the Egeria arm also trains through ``Egeria.cache_loader`` (nothing
freezes, so nothing is recorded: this measures the loader wrapper with the readings).
Writes ``benchmarks/results/eval_overhead/[<task>-]<layout>[-cache].json`` (the task named
when it is not ``resnet-fmnist``); prints the command, the
machine and each pair's training times (evaluation of the metric excluded) and ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from egeria.bench import run_bench
    from egeria.bench.machine import describe_machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["cpu", "accel"], required=True)
    parser.add_argument("--task", choices=["resnet-fmnist", "vgg-fmnist"], default="resnet-fmnist")
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (batch 128)")
    parser.add_argument("--repeats", type=int, default=2, help="plain/Egeria pairs")
    parser.add_argument("--cache", action="store_true", help="the Egeria arm trains through the cache loader")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "benchmarks/studies/eval_overhead.py", *sys.argv[1:]])
    print(command)
    print(describe_machine())
    limit = 128 * args.steps // 2  # two epochs of steps/2 batches: n is 20 either way
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            times = {}
            for policy in ("none", "egeria"):
                overrides = {"horizon": 1e-12, "floor_ratio": 0} if policy == "egeria" else None
                run = run_bench(
                    args.task, policy, seed=0, epochs=2, out_dir=f"{tmp}/{repeat}", layout=args.layout,
                    limit=limit, eval_limit=1000, overrides=overrides, cache=args.cache and policy == "egeria",
                )
                assert not [e for e in run["events"] if e["action"] == "freeze"], "a module froze"
                times[policy] = run["final"]["wall_time_s"]
                if policy == "egeria":
                    times["readings"] = run["controller"]["sent"]
                    times["overhead_share"] = run["controller"].get("overhead", {}).get("share")
            if not times["readings"]:
                print("warning: no readings in this pair (bootstrapping did not end): raise --steps")
            times["ratio"] = times["egeria"] / times["none"]
            pairs.append(times)
            print(f"pair {repeat}: plain {times['none']:.1f} s, Egeria {times['egeria']:.1f} s "
                  f"({times['readings']} readings): {times['ratio'] - 1:+.1%}")
    overhead = statistics.median(p["ratio"] for p in pairs) - 1
    print(f"median overhead of evaluating without freezing ({args.layout}): {overhead:+.1%}")
    task = "" if args.task == "resnet-fmnist" else f"{args.task}-"
    out = ROOT / "benchmarks/results/eval_overhead" / f"{task}{args.layout}{'-cache' if args.cache else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "machine": describe_machine(), "task": args.task, "steps": args.steps, "cache": args.cache,
                               "pairs": pairs, "median_overhead": overhead}, indent=1))


if __name__ == "__main__":
    main()
