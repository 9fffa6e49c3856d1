"""When would each module have frozen at each horizon, replayed on recorded readings?

Replays Egeria's freezing rule on the plasticity readings runs recorded: when would each
module have frozen under the criterion of the drift still to come (issue 28), at each
``horizon``, on a step schedule, a linear decay in fine-tuning and a language model's
inverse-square-root schedule?

The readings of a run do not depend on the rule until its first freeze (the rule only
reads), so up to that step a replay gives exactly what a run with other rule settings would
have read and decided. After it the recorded readings come from a model whose front was
frozen, so the replay stops there: a module that would not have frozen by then is reported
as such ("not by step N"). The runs read every module at each evaluation (``rule="egeria"``).

It runs the library's own rule (:class:`egeria.knowledge.rule.FrontRule`), front first as the
controller does: a module freezes at the first evaluation where it and every module before
it have settled. Each reading gets the learning-rate mass of its interval (the sum of the
learning rates since the previous reading) and the mass still ahead, from the run's
schedule (:class:`egeria.lr_schedule.LRSchedule`); the floors it recorded where it recorded
them (``floor_ratio``).

    .venv/bin/python benchmarks/studies/rule_replay.py

Prints the command, the machine and, per run and horizon, the step each module would freeze
at with the share of the run's learning-rate mass still ahead there, beside the step the run
itself froze it; writes ``benchmarks/results/rule_replay/criterion.json``. No training: it
reads committed results (seconds).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks/results/rule_replay"
HORIZONS = (0.01, 0.003, 0.001, 0.0007, 0.0005, 0.0003)
WINDOW, TOLERANCE_RATIO, FLOOR_RATIO = 3, 0.2, 8.0  # the default rule's

# The runs replayed, with how their schedules are known: the task's own scheduler, or
# (for runs whose task cannot be rebuilt without its data or starting weights) the
# schedule written out.
RUNS = {
    "demo seed 0 (MultiStepLR, /10 at 50% and 75%)": (
        "benchmarks/results/reading_floor/demo-seed0-history.json",
        (800, lambda i: 0.1 if i < 400 else 0.01 if i < 600 else 0.001),
    ),
    "resnet-fmnist seed 0 (MultiStepLR, full length)": ("benchmarks/results/tta-full/cpu/resnet-fmnist/egeria-cache-seed0.json", None),
    "resnet-fmnist seed 1 (MultiStepLR, full length)": ("benchmarks/results/tta-full/cpu/resnet-fmnist/egeria-cache-seed1.json", None),
    "finetune-mnist seed 0 (linear decay, pretrained)": (
        "benchmarks/results/tta-full/cpu/finetune-mnist/egeria-cache-seed0.json", (1600, lambda i: 0.01 * (1 - i / 1600)),
    ),
    "finetune-mnist seed 1 (linear decay, pretrained)": (
        "benchmarks/results/tta-full/cpu/finetune-mnist/egeria-cache-seed1.json", (1600, lambda i: 0.01 * (1 - i / 1600)),
    ),
    "transformer-ptb seed 0 (inverse square root)": ("benchmarks/results/tta-full/cpu/transformer-ptb/egeria-cache-seed0.json", None),
}


def schedule_of(run: dict, written):
    from egeria.lr_schedule import read_schedule, schedule_from

    if written is not None:
        steps, lr_at = written
        return schedule_from(lr_at, steps)
    from egeria.bench.tasks import task_of_run

    task = task_of_run(run)
    return read_schedule(task.scheduler, task.optimizer, run["total_steps"])


class RawFloors:
    """The floors a run measured, from the smoothed ones its rows recorded (the mean of the
    last W floors since the learning rate last changed 2x or more, as
    :class:`egeria.knowledge.plasticity.ModuleWatch` keeps them): each raw floor is W times the
    smoothed one less the W - 1 raw floors before it."""

    def __init__(self) -> None:
        self.raws: dict[str, list[float]] = defaultdict(list)
        self.lrs: dict[str, float] = {}

    def raw(self, module: str, smoothed: float | None, lr: float) -> float | None:
        from egeria.knowledge.plasticity import REGIME_CHANGE

        previous = self.lrs.get(module)
        self.lrs[module] = lr
        if previous and lr > 0 and max(lr / previous, previous / lr) >= REGIME_CHANGE:
            self.raws[module] = []
        if smoothed is None:
            return None
        before = self.raws[module][-(WINDOW - 1):]
        value = max((len(before) + 1) * smoothed - sum(before), 0.0)
        self.raws[module].append(value)
        return value


def announce(script: str, argv: list[str]) -> str:
    """The replay's command line (``script`` under ``benchmarks/studies/`` with ``argv``),
    printed with the machine: a replay trains nothing, so the machine only ran the rule."""
    from egeria.bench.machine import describe_machine

    command = shlex.join([".venv/bin/python", f"benchmarks/studies/{script}", *argv])
    print("command:", command)
    print("machine:", describe_machine()["cpu"], "(no training: committed readings only)")
    return command


def write_results(out: Path, command: str, **fields) -> None:
    """Writes the command, the machine and ``fields`` to ``out`` as JSON, and says where."""
    from egeria.bench.machine import describe_machine

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "machine": describe_machine(), **fields}, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def own_freezes(run: dict) -> dict[str, int]:
    """Module -> the step of the reading that decided the run's own freeze of it (the freeze
    applied D steps later; a run from before ``evaluated_at``: the step it applied)."""
    return {m: e.get("evaluated_at") or e["step"] for e in run.get("events", []) if e.get("action") == "freeze"
            for m in e["modules"]}


def print_replay(way: str, width: int, frozen: dict[str, int | None], parted: int | None) -> None:
    """One replay's line: each module's freeze step ("-": not by the end of the replay) and
    where it parted from the run."""
    cells = [f"{m} {s if s is not None else '-'}" for m, s in frozen.items()]
    print(f"  {way:<{width}}" + "; ".join(cells) + ("" if parted is None else f" [parted from the run at {parted}]"))


def replay_front(run: dict, rule, until: int | None, inputs_at, own: dict[str, int] | None = None,
                 cap: int | None = None, wide: bool = False) -> dict[str, int | None]:
    """Module -> the step of the evaluation at which ``rule`` (a
    :class:`egeria.knowledge.rule.FrontRule`) would freeze it on the run's recorded readings
    (None: not by ``until``, or never), front first as the controller does: every watched
    module read, the readings compared, the settled front frozen and forgotten.

    ``inputs_at(step, rows)`` is called at every evaluation with its rows by module and
    returns, for a module, the keyword arguments of :meth:`FrontRule.read` besides the
    plasticity (learning rate, floor, mass, mass ahead, ...); it is asked only for the
    modules read. With ``own`` (the run's own freezes, module -> step) the replay goes on
    past ``until`` for as long as it has frozen what the run had by each step, and stops
    after the first evaluation where the two part (past it the readings come from a model
    the replayed rule would not have trained): that step is returned under the key None.
    ``cap``: the modules from this index on freeze only once quiet and are no yardstick of
    idleness, as in the controller (docs/decisions/041-quiet-modules-pass-the-cap.md), unless
    ``wide`` makes every watched module one."""
    modules = list(dict.fromkeys(row["module"] for row in run["plasticity"]))
    by_step: dict[int, dict[str, dict]] = defaultdict(dict)
    for row in run["plasticity"]:
        by_step[row["step"]][row["module"]] = row
    frozen_at: dict[str | None, int | None] = {m: None for m in modules}
    front = 0
    for step in sorted(by_step):
        if own is None and until is not None and step > until:
            break
        readings = by_step[step]
        inputs = inputs_at(step, readings)
        watched = [i for i in range(front, len(modules)) if modules[i] in readings]
        if not watched or watched[0] != front:
            continue  # the run did not read the front module here
        for i in watched:
            rule.read(i, readings[modules[i]]["plasticity"], **inputs(modules[i]))
        rule.compare(watched if cap is None or wide else [i for i in watched if i < cap])
        count = rule.settled_front(watched, cap=cap)
        for i in watched[:count]:
            frozen_at[modules[i]] = step
        if count:
            front += count
            rule.forget_before(front)
        if own is not None and front != sum(1 for m in modules if own.get(m) is not None and own[m] <= step):
            frozen_at[None] = step  # parted from the run: its readings on come from another model
            break
    return frozen_at


def replay(run: dict, schedule, horizon: float, until: int | None) -> dict[str, int | None]:
    """Module -> the step of the evaluation at which it would freeze (None: not by ``until``)."""
    from egeria.knowledge.rule import FrontRule, RuleSettings

    rule = FrontRule(RuleSettings(WINDOW, TOLERANCE_RATIO, horizon=horizon, regimes=True, floor_ratio=FLOOR_RATIO))
    floors = RawFloors()
    previous = None

    def inputs_at(step: int, readings: dict[str, dict]):
        nonlocal previous
        # Steps count from 1: the reading of step s spans steps previous+1 .. s, whose
        # learning rates are the schedule's entries previous .. s-1.
        mass = None if previous is None else schedule.lr_sum(previous, step)
        previous = step
        lr = schedule.lr(step - 1)
        return lambda module: {"lr": lr, "floor": floors.raw(module, readings[module].get("floor"), lr),
                               "mass": mass, "ahead": schedule.lr_sum(step)}

    return replay_front(run, rule, until, inputs_at)


def main() -> int:
    command = announce("rule_replay.py", sys.argv[1:])
    results = []
    for name, (path, written) in RUNS.items():
        run = json.loads((ROOT / path).read_text())
        schedule = schedule_of(run, written)
        first = next((e for e in run.get("events", []) if e.get("action") == "freeze"), None)
        until = None if first is None else first["step"]
        own = {m: e["step"] for e in run.get("events", []) if e.get("action") == "freeze" for m in e["modules"]}
        print(f"\n{name}: {path}\n  {schedule.total_steps} steps; the run's own freezes (old rule): "
              f"{own or 'none'}; replayed {'to the end' if until is None else 'until step ' + str(until)}")
        entry = {"run": name, "path": path, "total_steps": schedule.total_steps, "replayed_until": until,
                 "own_freezes": own, "horizons": {}}
        for horizon in HORIZONS:
            frozen = replay(run, schedule, horizon, until)
            cells = []
            for module, step in frozen.items():
                if step is None:
                    cells.append(f"{module} {'never' if until is None else 'not by ' + str(until)}")
                else:
                    cells.append(f"{module} {step} ({schedule.mass_ahead(step):.2%} ahead)")
            entry["horizons"][str(horizon)] = {
                m: None if s is None else {"step": s, "mass_share_ahead": schedule.mass_ahead(s)} for m, s in frozen.items()
            }
            print(f"  horizon {horizon:<7g}" + "; ".join(cells))
        results.append(entry)
    OUT.mkdir(parents=True, exist_ok=True)
    target = OUT / "criterion.json"
    target.write_text(json.dumps({"command": command, "window": WINDOW, "floor_ratio": FLOOR_RATIO,
                                  "results": results}, indent=1))
    print(f"\nwrote {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
