"""What did each full-length Egeria run's freezes cost, against the learning rate at them?

Issue 28's criterion freezes a settled module once the drift still to come is small
(docs/decisions/008-horizon.md). The suite's runs say that this is free on a step schedule
after its last decay and for a fine-tuned front, and not free under a continuous decay of a
model trained from scratch (docs/decisions/028-finetune-freeze-cost.md,
029-cosine-late-freeze-cost.md). This study puts every freeze of every committed
full-length Egeria run beside (a run that froze nothing is listed, with no freeze):

- where it came: its step, as a share of the run, and the share of the run's learning-rate
  mass still ahead there (the schedule rebuilt from the run's task, or from the Trainer's
  linear schedule for a Trainer run);
- the learning rate there over the run's peak;
- whether the module froze at its floor (a quiet module: its readings could not be told
  from no drift) or by the slope and the drift still to come;
- what the run ended at against the plain run of the same seed and the worst plain seed
  (points of accuracy, or perplexity with the sign turned, so that below 0 is a loss);
- which rule made it: the one before the learning-rate bound of
  docs/decisions/030-freeze-at-low-lr.md or the one with it (the run's commit against the
  bound's), and, for a freeze made without the bound by the drift still to come, the first
  step at or after it where the bound would have let it happen.

Runs that a run of the same task and seed under the bound replaced are read from
``benchmarks/results/tta-full/superseded/before-030`` (their plain runs are the live ones).

    .venv/bin/python benchmarks/freeze_lr.py

Prints the command, the machine and the table; writes
``benchmarks/results/freeze_lr/freeze_lr.json`` and ``freeze_lr.png`` (each run's cost
against the learning rate of its first freeze). No training: it reads committed results
and rebuilds each task's schedule (tens of seconds, loading each task's data).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks/results/tta-full"
SUPERSEDED = RUNS / "superseded/before-030"
OUT = ROOT / "benchmarks/results/freeze_lr"
BOUND_COMMIT = "790f31f"  # the rule's learning-rate bound landed here


def _with_bound(code: str | None) -> bool | None:
    """Whether the run's code has the learning-rate bound (None: cannot tell)."""
    import subprocess

    if not code:
        return None
    done = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", BOUND_COMMIT, code],
                          capture_output=True)
    return {0: True, 1: False}.get(done.returncode)


def _lrs(run: dict) -> list[float]:
    """The learning rate of each of the run's optimizer steps."""
    total = run["total_steps"]
    trainer = run.get("trainer")
    if trainer is not None:
        if trainer["lr_scheduler_type"] != "linear":
            raise ValueError(f"{run['task']}: a Trainer schedule this study does not rebuild: {trainer['lr_scheduler_type']}")
        peak, warm = trainer["learning_rate"], trainer["warmup_steps"]
        # transformers' get_linear_schedule_with_warmup: the rate of optimizer step s (0-based)
        return [peak * (s / max(1, warm) if s < warm else max(0.0, (total - s) / max(1, total - warm))) for s in range(total)]
    import tempfile

    import torch

    from egeria.bench.tasks import build_task
    from egeria.lr_schedule import read_schedule
    from egeria.models import resnet

    with tempfile.TemporaryDirectory() as folder:
        init = None
        if run.get("init") is not None or run["task"] == "finetune-mnist":
            # A task that starts from a checkpoint builds the same schedule from any
            # weights of its model: a stand-in ResNet-20 (finetune-mnist's model).
            init = Path(folder) / "stand-in.pt"
            torch.save(resnet(depth=20, in_channels=1, num_classes=10).state_dict(), init)
        task, _ = build_task(run["task"], seed=run["seed"], epochs=run["epochs"], limit=run.get("limit"), eval_limit=1,
                             init=init)
    return read_schedule(task.scheduler, task.optimizer, total).lrs.tolist()


def _plain(folder: Path) -> dict[int, float]:
    """The plain runs' final metric by seed."""
    finals = {}
    for path in sorted(folder.glob("none-seed*.json")):
        run = json.loads(path.read_text())
        finals[run["seed"]] = run["final"]["metric"]
    return finals


def _gain(metric: float, against: float, higher_is_better: bool) -> float:
    """``metric`` over ``against`` in the task's units, below 0 a loss: points of accuracy, or
    perplexity with the sign turned."""
    return (metric - against) * 100 if higher_is_better else against - metric


def study() -> list[dict]:
    from egeria.config import SPEEDS
    from egeria.knowledge.rule import at_most

    rows = []
    paths = [(p, p.parent) for p in sorted(RUNS.glob("*/*/egeria*-seed*.json"))]
    paths += [(p, RUNS / p.parent.relative_to(SUPERSEDED)) for p in sorted(SUPERSEDED.glob("*/*/egeria*-seed*.json"))]
    for path, live in paths:
        run = json.loads(path.read_text())
        plain = _plain(live)
        freezes = [e for e in run["events"] if e["action"] == "freeze"]
        if not plain:
            continue
        higher = run["metric"]["higher_is_better"]
        lrs = _lrs(run)
        peak, mass = max(lrs), sum(lrs)
        worst = (min if higher else max)(plain.values())
        final = run["final"]["metric"]
        low = [s for s, lr in enumerate(lrs) if at_most(lr / peak, SPEEDS["safe"])]

        def bound(step: int) -> int | None:
            return next((s for s in low if s >= step), None)

        rows.append({
            "run": str(path.relative_to(ROOT)),
            "task": run["task"],
            "seed": run["seed"],
            "layout": live.parts[-2],
            "learning_rate_bound": _with_bound(run.get("code")),
            "final": final,
            "against_same_seed": None if run["seed"] not in plain else _gain(final, plain[run["seed"]], higher),
            "against_worst_plain": _gain(final, worst, higher),
            "plain_seeds": sorted(plain),
            "freezes": [_freeze_row(e, run["total_steps"], lrs, peak, mass, bound) for e in freezes],
        })
    return rows


def _freeze_row(event: dict, total_steps: int, lrs: list[float], peak: float, mass: float,
                bound: Callable[[int], int | None]) -> dict:
    """One freeze of a run: where it fell in the run and its schedule, and whether the
    module was at its floor (the rule's words for a quiet module name the reference's own
    error), which the learning-rate bound lets freeze at any rate."""
    step = event["step"]
    at_floor = "reference's own error" in event["reason"]
    return {
        "step": step,
        "modules": event["modules"],
        "share_of_run": step / total_steps,
        "lr_over_peak": lrs[min(step, len(lrs) - 1)] / peak,
        "mass_ahead": sum(lrs[step:]) / mass,
        "at_floor": at_floor,
        # where the bound lets a module not at its floor freeze, at the earliest
        "bound_allows_at": step if at_floor else bound(step),
        "reason": event["reason"],
    }


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    tasks = sorted({row["task"] for row in rows})
    colours = {task: f"C{k}" for k, task in enumerate(tasks)}
    for row in rows:
        if not row["freezes"]:  # a run that froze nothing: no learning rate to put it at
            continue
        first = row["freezes"][0]
        cost = row["against_same_seed"] if row["against_same_seed"] is not None else row["against_worst_plain"]
        colour = colours[row["task"]]
        ax.scatter(first["lr_over_peak"], cost, marker="o" if first["at_floor"] else "s", s=50, alpha=0.8,
                   color=colour if row["learning_rate_bound"] else "none", edgecolors=colour)
    for task in tasks:
        ax.scatter([], [], color=colours[task], label=task)
    ax.legend(fontsize=8, loc="lower left")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate at the first freeze / the run's peak")
    ax.set_ylabel("final against plain of the same seed\n(accuracy points; perplexity, sign turned)")
    ax.axvline(0.01, color="grey", lw=0.8, ls="--")
    ax.set_title("Egeria's full-length runs, one point a run: what its freezes cost\n"
                 "(circle: the first freeze at the module's floor; square: by the drift still to come;\n"
                 "filled: the rule with the learning-rate bound (dashed), record 030; hollow: before it)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    print("$", shlex.join([sys.executable, *sys.argv]))
    from egeria.bench.machine import describe_machine

    print("machine:", describe_machine()["cpu"], "(no training: committed results only)")
    rows = study()
    print(f"{'run':<74} {'bound':>5} {'vs same seed':>12} {'vs worst':>9}  "
          "freezes: step (share of run, LR/peak, mass ahead; where the bound allows it)")
    for row in rows:
        same = "-" if row["against_same_seed"] is None else f"{row['against_same_seed']:+.2f}"
        freezes = "; ".join(
            f"{f['step']} ({f['share_of_run']:.0%}, {f['lr_over_peak']:.3f}, {f['mass_ahead']:.3f}"
            + (", floor" if f["at_floor"] else f"; {f['bound_allows_at']}") + ")"
            for f in row["freezes"]
        ) or "none"
        bound = {True: "yes", False: "no", None: "?"}[row["learning_rate_bound"]]
        name = row["run"].removeprefix("benchmarks/results/").removeprefix("tta-full/")
        print(f"{name:<74} {bound:>5} {same:>12} {row['against_worst_plain']:>+9.2f}  {freezes}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "freeze_lr.json").write_text(json.dumps({"command": shlex.join(["benchmarks/freeze_lr.py"]), "runs": rows}, indent=1))
    _plot(rows, OUT / "freeze_lr.png")
    print("wrote", OUT / "freeze_lr.json", "and freeze_lr.png")


if __name__ == "__main__":
    main()
