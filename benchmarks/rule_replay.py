"""Replays Egeria's freezing rule on the plasticity readings a run recorded, under other
settings of the rule: when would each module have frozen?

The readings of a run do not depend on the rule until its first freeze (the rule only
reads), so up to that step a replay gives exactly what a run with other rule settings
would have read and decided. After it the recorded readings come from a model whose front
was frozen, so the replay stops there: a module that would not have frozen by then is
reported as such ("not by step N"). The run must have read every module
it replays at each evaluation (``rule="egeria"``; ``watch_span`` None reads them all).

It runs the library's own rule (:class:`egeria.rule.FrontRule`), front first as the
controller does: a module freezes at the first evaluation where it and every module
before it have settled. The learning rate of each reading is the one the run recorded,
or, for runs made before readings carried it, the task's own schedule.

    .venv/bin/python benchmarks/rule_replay.py \\
        benchmarks/results/tta-full/variants/regimes-max-frozen-5/accel/resnet-fmnist/egeria-cache-seed0.json

Prints the command, the run, and for each setting the step each module would freeze at;
writes ``benchmarks/results/rule_replay/<run stem>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks/results/rule_replay"


def schedule(run: dict) -> dict[int, float]:
    """Step -> the learning rate that step trained at, from the task's own scheduler."""
    from egeria.bench.tasks import task_of_run

    task = task_of_run(run)
    rates = {}
    for step in range(1, run["total_steps"] + 1):
        rates[step] = task.optimizer.param_groups[0]["lr"]
        task.optimizer.step()  # no gradients: nothing moves; keeps the scheduler's order check quiet
        task.scheduler.step()
    return rates


def replay(run: dict, rates: dict[int, float], *, window: int, settle_ratio: float | None, regimes: bool,
           max_frozen: int | None, until: int | None) -> dict[str, int | None]:
    """Module -> the step of the evaluation at which it would freeze (None: not by step
    ``until``, the last step replayed; None: to the end)."""
    from egeria.rule import FrontRule

    modules = run["modules"]
    limit = len(modules) - 1 if max_frozen is None else min(max_frozen, len(modules) - 1)
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for row in run["plasticity"]:
        by_step[row["step"]][row["module"]] = row["plasticity"]
    rule = FrontRule(window, run["config"]["tolerance_ratio"], settle_ratio=settle_ratio, regimes=regimes)
    frozen_at: dict[str, int | None] = {m: None for m in modules[:limit]}
    front = 0
    for step in sorted(by_step):
        if until is not None and step > until:
            break
        readings = by_step[step]
        watched = [i for i in range(front, limit) if modules[i] in readings]
        if not watched or watched[0] != front:
            continue  # the run did not read the front module here
        for i in watched:
            rule.read(i, readings[modules[i]], rates.get(step))
        count = rule.settled_front(watched)
        for i in watched[:count]:
            frozen_at[modules[i]] = step
        if count:
            front += count
            rule.forget_before(front)
    return frozen_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run JSON whose readings cover every module replayed")
    parser.add_argument("--windows", default="10,7,5,3", help="W values to replay (default 10,7,5,3)")
    parser.add_argument("--settle", default=None, help="settle_ratio values to replay (default: the run's own)")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "benchmarks/rule_replay.py", *sys.argv[1:]])
    print(command)
    run = json.loads(args.run.read_text())
    config = run["config"]
    if config.get("rule") != "egeria":
        raise SystemExit(f"{args.run}: rule {config.get('rule')!r}: the replay needs a run that read every module (rule='egeria')")
    rows = run["plasticity"]
    rates = {r["step"]: r["lr"] for r in rows if r.get("lr") is not None} or schedule(run)
    first = next((e for e in run["events"] if e["action"] == "freeze"), None)
    print(f"run: {args.run} ({len(rows)} readings; its own first freeze: "
          f"{'none' if first is None else str(first['modules']) + ' at step ' + str(first['step'])})")
    until = None if first is None else first["step"]
    never = "never" if until is None else f"not by {until}"
    settles = [config["settle_ratio"]] if args.settle is None else [float(v) for v in args.settle.split(",")]
    results = []
    for settle in settles:
        for window in (int(w) for w in args.windows.split(",")):
            for regimes in (False, True):
                frozen = replay(run, rates, window=window, settle_ratio=settle, regimes=regimes,
                                max_frozen=config["max_frozen"], until=until)
                results.append({"window": window, "settle_ratio": settle, "regimes": regimes, "frozen_at": frozen})
                steps = ", ".join(f"{m} {never if v is None else v}" for m, v in frozen.items())
                averaging = "new regime at an LR change" if regimes else "one average throughout"
                print(f"settle {settle}  W={window:<3} {averaging:27} {steps}")
    OUT.mkdir(parents=True, exist_ok=True)
    target = OUT / f"{args.run.parent.parent.parent.name}-{args.run.stem}.json"
    target.write_text(json.dumps({"command": command, "run": str(args.run), "max_frozen": config["max_frozen"],
                                  "replayed_until": until, "results": results}, indent=1))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
