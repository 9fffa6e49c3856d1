"""What did the activation cache's copies in the run's last epoch cost (record 036)?

Reads the six committed runs of ``benchmarks/results/cache-last-epoch/``: the cut (b)
(``egeria bench vgg-fmnist --epochs 2 --records-per-epoch 4 --layout cpu --no-progress
--policy egeria --seed 0 --set speed=V``, V = 0.5 and fast), each run three ways back to back
on one VM: with the cache before record 036 (``c-``: every computed batch copied, none ever
served), without the cache (``n-``), and with it after (``a-``: nothing copied in the last
epoch). Prints, per setting and way, the milliseconds a step of each stretch between two
records took, the whole run's time and FLOPs, and the frozen stretches' time against the run
without the cache; writes ``cache_last_epoch.json`` and ``cache_last_epoch.png`` (ms a step
over the run, one panel per setting) beside the runs.

    .venv/bin/python benchmarks/cache_last_epoch.py

No training: it reads committed runs (seconds).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "cache-last-epoch"
WAYS = {"c": "cache, before 036", "n": "no cache", "a": "cache, after 036"}
SETTINGS = ("sp05", "fast")


def stretches(run: dict) -> list[dict]:
    """Each stretch between two records: its first and last step, ms a step, the modules frozen at its end."""
    records = run["records"]
    return [{"start": a["step"], "step": b["step"], "ms_per_step": 1000 * (b["wall_time_s"] - a["wall_time_s"]) / (b["step"] - a["step"]),
             "frozen": len(b["frozen"])} for a, b in zip(records, records[1:])]


def first_freeze(run: dict) -> int:
    return min(e["step"] for e in run["events"] if e["action"] == "freeze")


def main() -> int:
    from egeria.bench.machine import describe_machine

    print("command:", shlex.join([".venv/bin/python", "benchmarks/cache_last_epoch.py", *sys.argv[1:]]))
    print("machine (this one; the runs record theirs):", describe_machine()["cpu"])
    result = {"runs": str(RUNS.relative_to(ROOT)), "settings": {}}
    for setting in SETTINGS:
        ways = {}
        for way in WAYS:
            [path] = sorted((RUNS / f"{way}-{setting}-s0").glob("*.json"))
            run = json.loads(path.read_text())
            ways[way] = {"wall_time_s": run["final"]["wall_time_s"], "total_flops": run["final"]["total_flops"],
                         "first_freeze": first_freeze(run), "stretches": stretches(run),
                         "cache_stats": {k: (run.get("cache_stats") or {}).get(k) for k in ("computed", "served", "unrecorded")},
                         "machine": run["machine"].get("cpu"), "code": run.get("code")}
        # the stretches that end after every way's first freeze: where the cache works
        start = max(w["first_freeze"] for w in ways.values())
        for way in ways.values():
            frozen = [s for s in way["stretches"] if s["start"] >= start]
            way["frozen_from"] = frozen[0]["start"]
            way["frozen_s"] = sum(s["ms_per_step"] * (s["step"] - s["start"]) for s in frozen) / 1000
        base = ways["n"]["frozen_s"]
        print(f"\n{setting}: the stretches from the first record after every way's first freeze (step {start}) on")
        for key, way in ways.items():
            way["frozen_vs_no_cache"] = way["frozen_s"] / base
            cells = " ".join(f"{s['ms_per_step']:6.1f}" for s in way["stretches"])
            print(f"  {WAYS[key]:18} whole {way['wall_time_s']:6.1f} s, {way['total_flops'] / 1e12:5.2f}e12 FLOPs; "
                  f"from step {way['frozen_from']} {way['frozen_s']:5.1f} s ({way['frozen_vs_no_cache']:.3f}x no cache); "
                  f"cache {way['cache_stats']}\n    ms a step by stretch: {cells}")
        result["settings"][setting] = ways
    (RUNS / "cache_last_epoch.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result)
    print(f"\nwrote {RUNS.relative_to(ROOT)}/cache_last_epoch.json and cache_last_epoch.png")
    return 0


def _plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETTINGS), figsize=(11, 4), sharey=True)
    for ax, setting in zip(axes, SETTINGS):
        for key, way in result["settings"][setting].items():
            steps = [s["step"] for s in way["stretches"]]
            ax.step(steps, [s["ms_per_step"] for s in way["stretches"]], where="pre", label=WAYS[key])
            ax.axvline(way["first_freeze"], color="grey", linewidth=0.5)
        ax.set_title(f"cut (b), speed={'0.5' if setting == 'sp05' else 'fast'}, seed 0")
        ax.set_xlabel("step (grey: first freeze)")
    axes[0].set_ylabel("ms a step, each stretch between records")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(RUNS / "cache_last_epoch.png", dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
