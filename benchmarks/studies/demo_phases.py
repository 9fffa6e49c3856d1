"""Is a demo's whole-run speedup the freeze's or the machine's?

The demo's step times phase by phase: whether a demo's whole-run speedup is the freeze's
or the machine's.

The demo's two arms take turns every 10 steps, so a machine's slow drift falls on both. An
oversubscribed machine (other processes' threads beside the demo's two) is another matter:
its stalls hit a step in proportion to how long the step runs and how many parallel regions
it waits at, so plain's longer steps lose more than Egeria's short frozen-front steps, and the
steps after a freeze read faster than the freeze makes them. This script reads
``demo.json`` files and prints, per run: the median step time of each arm before and after
Egeria's first freeze, their ratios, the whole-run speedup the demo printed, and the whole-run
speedup the arms would have had at the medians of a reference run's post-freeze ratio
(``--post RATIO``, e.g. 2.21, the Intel VM's quiet runs; default: each run's own).

    .venv/bin/python benchmarks/studies/demo_phases.py FILE.json [FILE.json ...] [--post 2.21]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def phases(demo: dict, post: float | None) -> dict:
    freeze = demo["summary"]["first_freeze_step"]
    plain = demo["runs"]["plain"]["step_times_s"]
    egeria = demo["runs"]["egeria"]["step_times_s"]
    steps = len(plain)
    row = {"freeze_step": freeze, "steps": steps, "printed_speedup": demo["summary"]["wall_time_speedup"],
           "final_plain": demo["runs"]["plain"]["final_accuracy"], "final_egeria": demo["runs"]["egeria"]["final_accuracy"]}
    if freeze is None:
        return row
    before = statistics.median(plain[:freeze]), statistics.median(egeria[:freeze])
    after = statistics.median(plain[freeze:]), statistics.median(egeria[freeze:])
    ratio_after = after[0] / after[1] if post is None else post
    row.update({
        "median_ms_before": [1000 * t for t in before], "median_ms_after": [1000 * t for t in after],
        "ratio_before": before[0] / before[1], "ratio_after": after[0] / after[1],
        # both arms at plain's pre-freeze pace, Egeria's post-freeze steps faster by ratio_after
        "speedup_at_ratio": steps / (freeze + (steps - freeze) / ratio_after),
        "ratio_used": ratio_after,
    })
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--post", type=float, help="post-freeze step ratio to apply (default: each run's own)")
    args = parser.parse_args()
    print(" ".join([".venv/bin/python", "benchmarks/studies/demo_phases.py", *sys.argv[1:]]))
    print(f"{'run':60} {'freeze':>6} {'before ms (p/e)':>16} {'after ms (p/e)':>15} {'after x':>7} "
          f"{'printed':>7} {'at ratio':>8} {'finals':>15}")
    for path in args.files:
        with open(path) as f:
            demo = json.load(f)
        row = phases(demo, args.post)
        finals = f"{100 * row['final_plain']:.2f}/{100 * row['final_egeria']:.2f}"
        if "ratio_after" not in row:
            print(f"{path:60} {'never':>6} {'':>16} {'':>15} {'':>7} {row['printed_speedup']:>6.2f}x {'':>8} {finals:>15}")
            continue
        before = "{:.0f}/{:.0f}".format(*row["median_ms_before"])
        after = "{:.0f}/{:.0f}".format(*row["median_ms_after"])
        print(f"{path:60} {row['freeze_step']:>6} {before:>16} {after:>15} {row['ratio_after']:>6.2f}x "
              f"{row['printed_speedup']:>6.2f}x {row['speedup_at_ratio']:>7.3f}x {finals:>15}")
        print(f"  machine: {demo['machine'].get('cpu')}, {demo['machine'].get('cores')} cores; command: {demo.get('command')}")


if __name__ == "__main__":
    main()
