"""When would the rule freeze each module with and without its idle and spent tests, replayed on the suite's readings?

(The spent test was retired by docs/decisions/038-steps-not-readings.md; the committed
``replay.json`` was made before, with it.) The idle test (docs/decisions/032-idle-modules.md): a module whose smoothed plasticity stays
at most ``IDLE_SHARE`` (1/100) of the most active watched module's for W evaluations freezes,
however much learning rate is ahead. The spent test (docs/decisions/034-spent-modules.md): a
settled module whose pace has fallen to at most ``SPENT_SHARE`` (1/100) of its fastest times
the learning rate's share of its peak freezes above the learning-rate bound. This replays the
library's own rule (:class:`egeria.knowledge.rule.FrontRule`, the settings ``EgeriaConfig()``
gives) on the readings each committed Egeria run of the suite recorded, with the spent test
(part of ``speed="fast"`` only), as the default is (without it), without either, and at
the speed knob's other points ``"balanced"`` and ``"fast"`` (each its bound, horizon and tests),
front first as the controller does (every watched module read,
then compared, then the settled front frozen).

A run's readings do not depend on the rule until its first freeze; past it they come from a
model whose front the run froze, so the replay goes on only while it has frozen what the run
had at each step, and stops after the first evaluation where the two part (a module that
would not have frozen by then reads "not by step N"). Each reading's
learning rate, the mass of its interval and the mass still ahead are the run's own (its rows
record them); the peak is the reading's rate over its recorded share of the peak; floors are
the raw ones recovered from the smoothed ones the rows carry.

    .venv/bin/python benchmarks/studies/idle_replay.py [RUN.json ...]

Prints the command, the machine and, per run, the steps each module would freeze at (with the
share of the run there and the learning rate as a share of its peak) beside the run's own
freezes; writes ``benchmarks/results/idle_replay/replay.json``. No training: seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks/results/idle_replay/replay.json"
TTA = "benchmarks/results/tta-full"
#: The suite's Egeria runs whose readings carry floors: (a)-(f) and the inverse-square-root LM.
SUITE = [
    f"{TTA}/intel-avx512/cpu/resnet-fmnist/egeria-cache-seed0.json",
    f"{TTA}/intel-avx512/cpu/resnet-fmnist/egeria-cache-seed1.json",
    f"{TTA}/cpu/vgg-fmnist/egeria-cache-seed0.json",
    f"{TTA}/cpu/vgg-fmnist/egeria-cache-seed1.json",
    f"{TTA}/cpu/transformer-ptb-cosine/egeria-cache-seed0.json",
    f"{TTA}/cpu/transformer-ptb-cosine/egeria-cache-seed1.json",
    f"{TTA}/cpu/gpt-ptb-order/egeria-seed0.json",
    f"{TTA}/cpu/gpt-ptb-order/egeria-seed1.json",
    f"{TTA}/cpu/finetune-mnist/egeria-cache-seed0.json",
    f"{TTA}/cpu/finetune-mnist/egeria-cache-seed1.json",
    f"{TTA}/cpu/transformer-ptb/egeria-cache-seed0.json",
    f"{TTA}/superseded/before-032/cpu/minilm-ptb-order/egeria-seed0.json",  # read with no idle freeze
    f"{TTA}/cpu/minilm-ptb-order/egeria-seed0.json",  # read with the idle test, before the spent one
    f"{TTA}/cpu/minilm-ptb-order/egeria-seed1.json",
]


def raw_floors(rows: list[dict], window: int, lag: int | None = None,
               regime: dict[int, int | None] | None = None) -> list[float | None]:
    """Each row's raw floor, from the smoothed ones (the mean of a module's last W floors
    since its watch last restarted, or with ``lag`` those of the readings within its span of
    W x ``lag`` steps, as the rule on steps keeps them): that many times the smoothed floor
    less the raw ones before it; a row without a floor restarts the module's, and so does,
    with ``regime`` (step -> the schedule's latest jump), a row of a new regime. A row that
    recorded its raw floor (``raw_floor``: runs made since record 043, whose smoothed floor is
    a median, not a mean) gives it as it is."""
    raws: dict[str, list[tuple[int, float]]] = defaultdict(list)
    regimes: dict[str, int | None] = {}
    out: list[float | None] = []
    for row in rows:
        if "raw_floor" in row:
            out.append(row["raw_floor"] if row.get("counted", True) else None)
            continue
        smoothed = row.get("floor")
        if regime is not None:
            previous = regimes.get(row["module"], regime[row["step"]])
            regimes[row["module"]] = regime[row["step"]]
            if regime[row["step"]] != previous:
                raws[row["module"]] = []
        if smoothed is None or not row.get("counted", True):
            raws[row["module"]] = []
            out.append(None)
            continue
        if lag is None:
            before = raws[row["module"]][-(window - 1):]
        else:
            before = [(s, v) for s, v in raws[row["module"]] if s >= row["step"] - window * lag + lag]
        value = max((len(before) + 1) * smoothed - sum(v for _, v in before), 0.0)
        raws[row["module"]].append((row["step"], value))
        out.append(value)
    return out


def replay(run: dict, settings, own: dict[str, int]) -> tuple[dict[str, int | None], int | None]:
    """Module -> the step of the evaluation at which the rule would freeze it (None: not by
    the step where the replay parted from the run's own freezes ``own``, or never), each
    reading with the inputs the run recorded; and that step (None: replayed to the end)."""
    from egeria.knowledge.rule import FrontRule

    from rule_replay import replay_front

    floors = dict(zip(map(id, run["plasticity"]), raw_floors(run["plasticity"], settings.window)))

    def inputs_at(step: int, readings: dict[str, dict]):
        def inputs(module: str) -> dict:
            row = readings[module]
            lr, share = row.get("lr"), row.get("lr_share")
            return {"lr": lr, "floor": floors[id(row)], "mass": row.get("mass"), "ahead": row.get("mass_ahead"),
                    "peak": lr / share if lr and share else None}
        return inputs

    frozen = replay_front(run, FrontRule(settings), None, inputs_at, own=own)
    parted = frozen.pop(None, None)
    return frozen, parted


def main(argv: list[str] | None = None) -> int:
    from egeria import EgeriaConfig
    from egeria.knowledge.policy import rule_settings

    from rule_replay import announce, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=SUITE)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    command = announce("idle_replay.py", sys.argv[1:] if argv is None else argv)
    settings = rule_settings(EgeriaConfig())
    # the spent test was retired by record 038; its committed replays were made before
    variants = {"the default": settings,
                "without either": dataclasses.replace(settings, idle_share=None),
                # the knob's other points, each with everything it changes (bound, horizon, spent test)
                "speed balanced": rule_settings(EgeriaConfig(speed="balanced")),
                "speed fast": rule_settings(EgeriaConfig(speed="fast")),
                # the knob's top: no learning-rate bound, the knowledge alone decides
                "speed 1": rule_settings(EgeriaConfig(speed=1.0))}
    results = []
    for path in args.runs:
        run = json.loads((ROOT / path).read_text())
        total = run["total_steps"]
        own = {m: e["step"] for e in run.get("events", []) if e.get("action") == "freeze" for m in e["modules"]}
        print(f"\n{path} ({run['task']}, seed {run['seed']}, {total} steps): its own freezes "
              + (", ".join(f"{m} {s}" for m, s in own.items()) or "none"))
        entry = {"run": path, "task": run["task"], "seed": run["seed"], "total_steps": total,
                 "own_freezes": own, "replays": {}, "parted_at": {}}
        lr_share = {r["step"]: r.get("lr_share") for r in run["plasticity"]}
        for name, variant in variants.items():
            frozen, parted = replay(run, variant, own)
            cells = []
            for module, step in frozen.items():
                if step is None:
                    cells.append(f"{module} {'never' if parted is None else 'not by ' + str(parted)}")
                else:
                    share = lr_share.get(step)
                    cells.append(f"{module} {step} ({step / total:.0%} of the run"
                                 + (f", lr {share:.2g} of its peak)" if share is not None else ")"))
            entry["replays"][name] = frozen
            entry["parted_at"][name] = parted
            print(f"  {name:<16}" + "; ".join(cells)
                  + ("" if parted is None else f" [parted from the run at step {parted}]"))
        results.append(entry)
    write_results(args.out, command, idle_share=settings.idle_share, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
