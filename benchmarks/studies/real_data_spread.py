"""How far apart do seeds end on the real-data test's setup?

The seed-to-seed spread of the real-data test's setup (tests/bench/test_real_data.py):
ResNet-8 on 4,000 Fashion-MNIST images for 5 epochs, plain and with Egeria, over seeds.

The test compares one Egeria run with one plain run; its margin must cover how much
such short runs move when only the seed (initial weights and batch order) changes, which
is also roughly how much they move between CPUs whose float kernels differ.

    .venv/bin/python benchmarks/studies/real_data_spread.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "bench"), str(ROOT / "tests" / "helpers")]  # the test and its helpers

from egeria.data import load_fashion_mnist  # noqa: E402
from egeria.bench.machine import describe_machine  # noqa: E402
from test_real_data import run  # noqa: E402  the test's own setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/real_data_spread/spread.json"))
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "benchmarks/studies/real_data_spread.py", *sys.argv[1:]])
    print(command)
    machine = describe_machine()
    print(machine)
    train_ds = load_fashion_mnist(split="train", limit=4000)
    test_ds = load_fashion_mnist(split="test", limit=2000)
    rows = []
    for seed in range(args.seeds):
        started = time.perf_counter()
        plain, _ = run(train_ds, test_ds, use_egeria=False, seed=seed)
        with_egeria, eg = run(train_ds, test_ds, use_egeria=True, seed=seed)
        frozen = [d.to_dict() for d in eg.events if d.action != "guided"]
        rows.append({"seed": seed, "plain": plain, "egeria": with_egeria, "events": frozen})
        print(f"seed {seed}: plain {plain:.4f}, egeria {with_egeria:.4f}, difference {with_egeria - plain:+.4f} "
              f"({time.perf_counter() - started:.0f} s)")
    plain = [r["plain"] for r in rows]
    diffs = [r["egeria"] - r["plain"] for r in rows]
    summary = {
        "plain_range": max(plain) - min(plain),
        "plain_stdev": statistics.stdev(plain),
        "difference_mean": statistics.mean(diffs),
        "difference_min": min(diffs),
        "difference_stdev": statistics.stdev(diffs),
    }
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": command, "machine": machine, "runs": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
