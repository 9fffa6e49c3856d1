"""Which module is the idle test's yardstick? Replayed on runs that read every freezable module.

Record 041 (docs/decisions/041-quiet-modules-pass-the-cap.md) lets a module past
``max_frozen_flops`` freeze once quiet, so the controller now reads every freezable module. The
idle test (record 032) marks a module idle at readings where its smoothed plasticity is at most
1/100 of the most active module's; the rule takes that yardstick from the modules within the
cap, as record 032 calibrated it (the modules past the cap were not read then). This replays
the library's rule (:class:`egeria.knowledge.rule.FrontRule`, the settings ``EgeriaConfig()``
gives, D = ``egeria.config.MIN_EVAL_INTERVAL``) on runs of record 041's code in two ways:

- ``within the cap``: the rule as it is (it must reproduce each run's own freezes);
- ``every watched module``: the most active of all the modules read is the yardstick;

front first as the controller does, stopping where a replay parts from the run's own freezes
(past that the readings come from a model the replayed rule would not have trained).

    .venv/bin/python benchmarks/studies/yardstick_replay.py [RUN.json ...]

Prints the command, the machine and, per run, each module's freeze step per way ("-": not by
the end of the replay); writes ``benchmarks/results/yardstick_replay/replay.json``. No
training: seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
OUT = ROOT / "benchmarks/results/yardstick_replay/replay.json"
RUNS = "benchmarks/results/tta-full/intel-avx512-quiet/cpu"
SUITE = [
    f"{RUNS}/resnet-fmnist/egeria-cache-seed0.json",
    f"{RUNS}/vgg-fmnist/egeria-cache-seed0.json",
    f"{RUNS}/transformer-ptb-cosine/egeria-cache-seed0.json",
    f"{RUNS}/finetune-mnist/egeria-cache-seed0.json",
    f"{RUNS}/finetune-mnist/egeria-cache-seed1.json",
    f"{RUNS}/minilm-ptb-order/egeria-seed0.json",
]
WAYS = {"within the cap": False, "every watched module": True}


def cap_of(run: dict) -> int | None:
    """The modules within the cap: recorded by the run, or, in a run from before the field,
    the leading modules whose readings carry a share of the most active one."""
    if "cap" in run:
        return run["cap"]
    compared = {r["module"] for r in run["plasticity"] if r.get("active_share") is not None}
    count = 0
    while count < len(run["modules"]) and run["modules"][count] in compared:
        count += 1
    return count


def replay(run: dict, settings, own: dict[str, int], wide: bool) -> tuple[dict[str, int | None], int | None]:
    """Module -> its freeze step on the run's readings with the yardstick ``wide`` or within
    the cap; and the step where the replay parted from the run (None: replayed to the end)."""
    from egeria.config import MIN_EVAL_INTERVAL
    from egeria.knowledge.rule import FrontRule

    from rule_replay import replay_front
    from span_replay import reading_inputs

    inputs_at = reading_inputs(run["plasticity"], settings.window, MIN_EVAL_INTERVAL)
    rule = FrontRule(dataclasses.replace(settings, lag=MIN_EVAL_INTERVAL))
    frozen = replay_front(run, rule, None, inputs_at, own=own, cap=cap_of(run), wide=wide)
    parted = frozen.pop(None, None)
    return frozen, parted


def main(argv: list[str] | None = None) -> int:
    from egeria import EgeriaConfig
    from egeria.knowledge.policy import rule_settings

    from rule_replay import announce, own_freezes, print_replay, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=SUITE)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    command = announce("yardstick_replay.py", sys.argv[1:] if argv is None else argv)
    settings = rule_settings(EgeriaConfig())
    results = []
    for path in args.runs:
        if not (ROOT / path).exists():
            print(f"\n{path}: not run (skipped)")
            continue
        run = json.loads((ROOT / path).read_text())
        own = own_freezes(run)
        cap = cap_of(run)
        print(f"\n{path} ({run['task']}, seed {run['seed']}, {run['total_steps']} steps, {cap} modules within the "
              "cap): its own freezes, at their readings' steps, " + (", ".join(f"{m} {s}" for m, s in own.items()) or "none"))
        entry = {"run": path, "task": run["task"], "seed": run["seed"], "total_steps": run["total_steps"],
                 "cap": cap, "own_freezes": own, "replays": {}, "parted_at": {}}
        for way, wide in WAYS.items():
            frozen, parted = replay(run, settings, own, wide)
            entry["replays"][way], entry["parted_at"][way] = frozen, parted
            print_replay(way, 22, frozen, parted)
        results.append(entry)
    write_results(args.out, command, results=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
