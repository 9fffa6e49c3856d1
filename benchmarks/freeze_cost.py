"""What does freezing the front cost in fine-tuning? The final held-out accuracy of a fine-tuning
task (``gpt-ptb-order``, the suite's (d), by default; ``--task minilm-ptb-order``, (f), the
genuinely pretrained all-MiniLM-L6-v2) when the first ``count`` modules of its partition freeze
at step ``at`` (the ``static`` policy), against plain runs of the same seeds.

It answers whether a rule *should* freeze a fine-tuned Transformer's front early, before asking
why Egeria's does not: AutoFreeze reports 2x on BERT fine-tuning with 4 of 6 layers frozen
early, and a 2.0x goal on (d) and (f) assumes the same is free there.

(d) is cut down so that an arm takes minutes on 2 cores: the first ``--limit`` training
sentences (6,400: 200 steps an epoch), 3 epochs (600 steps), the Trainer's linear decay from
1e-4 to 0, judged on all 7,000 held-out sentences at the end of each epoch. (f) runs at its
suite length unless ``--limit`` or ``--epochs`` say otherwise, judged twice an epoch as the
suite's plain seeds are: an evaluation moves the Trainer's random path (record 033), so an arm
evaluated at another cadence than its plain run is marked in the table (``*``, and
``cadence_as_plain`` false in its row), not compared silently. An arm is ``policy:seed``,
``policy:seed:key=value,...`` (a baseline's options over the task's own, ``freezeout:0:t0=0.5``;
Egeria's config fields, ``egeria:0:speed=fast``; every arm's checked before any runs) or
``static:seed:count:at``, ``at`` a step or a share of the run's steps (``25%``); each writes
its run file under ``--runs`` (``<tag>/cpu/<task>/<policy>-seed<seed>.json``, the format of
``egeria bench``), and an arm whose file is there is read, not run again. ``--average``
freezes every arm but plain to the average of its recent weights
(``Egeria(average=WeightAverage())``; tags end in ``-average``).

    .venv/bin/python benchmarks/freeze_cost.py none:0 none:1 static:0:4:150 static:1:4:150 \\
        static:0:2:150 static:1:2:150 --runs /tmp/freeze-cost --init ~/.cache/egeria/ptb-gpt
    .venv/bin/python benchmarks/freeze_cost.py --task minilm-ptb-order none:0 static:0:2:10% \\
        static:0:3:25% static:0:5:50% --runs /tmp/freeze-cost-f

Prints the command, the machine and one row per arm (its final accuracy, the difference from the
plain run of its seed, the training time and its ratio to that plain run's, raw and at plain's
pace, the arm's time scaled by how fast the machine ran the steps before its freeze against
plain's run of them, for arms run in another session than their plain) and, given two plain
seeds or more, the frontier goal: each baseline setting against the Egeria settings at least as
fast and at least as far over the worst plain seed (means over seeds); writes them as JSON
(default ``benchmarks/results/freeze_cost/<task>.json``), a plot of the finals beside it and one
of the frontier (``<task>-frontier.png``). Times are
from one machine but not taken in turns: read them as a rough size, the accuracies as the
finding.
"""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("gpt-ptb-order", "minilm-ptb-order")


class Cut(NamedTuple):
    """A task's cut: training sentences and epochs (None: the suite's own), and evaluations an
    epoch (the cadence of the plain runs its arms are set against)."""

    limit: int | None
    epochs: int | None
    records_per_epoch: int


CUTS = {"gpt-ptb-order": Cut(6400, 3, 1), "minilm-ptb-order": Cut(None, None, 2)}


def parse_arm(text: str, total_steps: int) -> tuple[str, int, dict]:
    """``none:0`` -> ("none", 0, {}); ``static:0:4:150`` -> ("static", 0, {count: 4, at_step: 150});
    ``static:0:4:25%`` freezes at a quarter of ``total_steps`` (rounded, at least step 1);
    ``freezeout:0:t0=0.5`` -> ("freezeout", 0, {t0: 0.5}): a baseline's options over the task's own
    (``egeria.bench.tasks``), or for ``egeria`` its config fields (``egeria:0:speed=fast``).

    Raises:
        ValueError: naming the arm that is none of these forms, or whose step is not in the run.
    """
    parts = text.split(":")
    try:
        if parts[0] == "static" and len(parts) == 4:
            at = parts[3]
            step = max(1, round(float(at[:-1]) / 100 * total_steps)) if at.endswith("%") else int(at)
            if not 0 < step <= total_steps:
                raise ValueError(text)
            return "static", int(parts[1]), {"count": int(parts[2]), "at_step": step}
        if parts[0] not in ("static", "none") and len(parts) == 3:
            return parts[0], int(parts[1]), _fields(parts[2])
        if parts[0] != "static" and len(parts) == 2:
            return parts[0], int(parts[1]), {}
    except ValueError:
        pass
    raise ValueError(f"arm {text!r}: write policy:seed (none:0), policy:seed:key=value,... (freezeout:0:t0=0.5, "
                     f"egeria:0:speed=fast) or static:seed:count:at (static:0:4:150, static:0:4:25%; a step of the "
                     f"run's {total_steps})")


def _fields(text: str) -> dict:
    """``t0=0.5,scaling=cubic`` -> {"t0": 0.5, "scaling": "cubic"} (a value Python cannot read is a string)."""
    out = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(item)
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def arm_overrides(policy: str, options: dict, defaults: dict) -> dict:
    """The config overrides an arm runs with: Egeria's fields as given; a baseline's options over
    ``defaults`` (the task's, :func:`egeria.bench.tasks.baseline_options`); nothing for plain.

    Raises:
        ValueError: an option the policy or the config does not take, or a bad value (before any arm runs).
    """
    from egeria import EgeriaConfig
    from egeria.policies import make_policy

    if policy == "egeria":
        EgeriaConfig().replace(**options)
        return dict(options)
    if policy == "none" or not (options or policy == "static"):
        return {}
    merged = options if policy == "static" else {**defaults.get(policy, {}), **options}
    make_policy(policy, **merged)
    return {"policy_options": merged}


def tag_of(policy: str, options: dict, average: bool = False, cache: bool = False) -> str:
    if policy == "static":
        tag = f"static{options['count']}at{options['at_step']}"
    else:
        tag = "-".join([policy] + [f"{k}={v}" for k, v in sorted(options.items())])
    if policy == "none":
        return tag
    return tag + ("-average" if average else "") + ("-cache" if cache else "")


def run_arm(task: str, policy: str, seed: int, options: dict, *, runs: Path, init: str | None, limit: int | None,
            epochs: int | None, overrides: dict, average: bool = False, cache: bool = False) -> dict:
    """The arm's run file, run first if it is not under ``runs``."""
    average = average and policy != "none"
    cache = cache and policy != "none"
    out = runs / tag_of(policy, options, average, cache)
    path = out / "cpu" / task / f"{policy}-seed{seed}.json"
    if path.is_file():
        return json.loads(path.read_text())
    from egeria.bench.trainer_run import run_trainer_bench

    return run_trainer_bench(task, policy, seed=seed, epochs=epochs, out_dir=out, limit=limit,
                             records_per_epoch=CUTS[task].records_per_epoch,
                             init=init, overrides=overrides or None, heap="default", average=average,
                             cache=cache)


def task_shape(task: str, limit: int | None, epochs: int | None, init: str | None) -> tuple[int, int]:
    """The run's optimizer steps an epoch and its epochs (the task built once)."""
    from egeria.bench.trainer_run import build_trainer_task

    built = build_trainer_task(task, epochs=epochs, limit=limit, eval_limit=1, init=init)
    return built.steps_per_epoch, built.epochs


def records_per_epoch(run: dict) -> int:
    """How many times a run file's run was evaluated in its first epoch (its cadence)."""
    return sum(1 for r in run["records"] if 0 < r["step"] <= run["steps_per_epoch"])


def row(policy: str, seed: int, options: dict, run: dict, plain: dict | None) -> dict:
    final = run["final"]
    out = {"arm": tag_of(policy, options, bool(run.get("average")), bool(run.get("cache"))), "policy": policy,
           "seed": seed, "options": options, "final": final["metric"],
           "wall_time_s": final["wall_time_s"], "frozen": run["records"][-1]["frozen"],
           "curve": [[r["step"], r["metric"]] for r in run["records"]], "code": run.get("code"),
           "records_per_epoch": records_per_epoch(run)}
    if plain is not None:
        from egeria.bench.report import pace_matched_speedup

        out["points_vs_plain"] = 100 * (final["metric"] - plain["final"]["metric"])
        out["speedup_vs_plain"] = plain["final"]["wall_time_s"] / final["wall_time_s"]
        # the same, the arm's time scaled by the machine's pace over the steps before its freeze
        # against plain's over them: arms run in another session than their plain (None for
        # plain itself and where the arm has no record before its freeze)
        out["speedup_at_plains_pace"] = pace_matched_speedup(run, [plain])
        out["cadence_as_plain"] = out["records_per_epoch"] == records_per_epoch(plain)
    return out


def frontier(rows: list[dict]) -> list[dict]:
    """Each row's final past the worst plain seed's (points; ``vs_worst_plain``), and the
    frontier goal: each baseline setting against the Egeria settings at least as fast (against
    the plain run of its seed) and at least as accurate, means over seeds
    (:func:`egeria.bench.report.dominance`). Needs two or more plain seeds; else no goal."""
    from egeria.bench.report import dominance

    plain = [r["final"] for r in rows if r["policy"] == "none"]
    if len(plain) < 2:
        return []
    for r in rows:
        r["vs_worst_plain"] = 100 * (r["final"] - min(plain))
    return dominance([{"plain": r["policy"] == "none", "policy": r["arm"], "policy_name": r["policy"], "seed": r["seed"],
                       "frontier_speedup": r.get("speedup_vs_plain"), "vs_worst_plain": r["vs_worst_plain"]}
                      for r in rows])


def plot_frontier(rows: list[dict], target: Path, task: str, steps: int) -> None:
    """Each setting's seeds as points (speedup against the plain run of its seed, points past the
    worst plain seed), coloured by policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from egeria.bench.plots import policy_colour

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for r in rows:
        if "speedup_vs_plain" not in r:
            continue
        ax.scatter(r["speedup_vs_plain"], r["vs_worst_plain"], color=policy_colour(r["policy"]), s=22)
        ax.annotate(f"{r['arm']} s{r['seed']}", (r["speedup_vs_plain"], r["vs_worst_plain"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    ax.axhline(0.0, color="tab:gray", linestyle=":", linewidth=1)
    ax.set_xlabel("whole-run speedup against the plain run of its seed")
    ax.set_ylabel("final minus the worst plain seed's (points)")
    ax.set_title(f"{task}, {steps} steps: speed against accuracy, each setting's seeds")
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], target: Path, task: str, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({r["arm"] for r in rows}, key=lambda a: (a != "none", a))
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(arms)), 4.2))
    for i, arm in enumerate(arms):
        finals = [100 * r["final"] for r in rows if r["arm"] == arm]
        ax.scatter([i] * len(finals), finals, color="tab:gray" if arm == "none" else "tab:blue")
    plain = [100 * r["final"] for r in rows if r["arm"] == "none"]
    if len(plain) > 1:
        ax.axhline(min(plain), color="tab:gray", linestyle=":", linewidth=1, label="worst plain seed")
        ax.legend(loc="lower left", fontsize=8)
    ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right", fontsize=8)  # long tags stay apart
    ax.set_ylabel("final held-out accuracy (%)")
    ax.set_title(f"{task}, {steps} steps: freezing the first k modules at step s")
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from egeria.bench.machine import describe_machine
    from egeria.bench.trainer_run import DEFAULT_INIT

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arms", nargs="+", help="none:SEED or static:SEED:COUNT:AT (AT a step or a share, 25%%)")
    p.add_argument("--task", choices=TASKS, default=TASKS[0])
    p.add_argument("--runs", type=Path, required=True, help="where the arms' run files are kept")
    p.add_argument("--init", default=None,
                   help=f"gpt-ptb-order's pretrained model (scripts/pretrain_ptb_lm.py; default {DEFAULT_INIT})")
    p.add_argument("--limit", type=int, default=None, help="training sentences (default: the task's cut)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (default: the task's cut)")
    p.add_argument("--out", type=Path, default=None, help="default benchmarks/results/freeze_cost/<task>.json")
    p.add_argument("--average", action="store_true",
                   help="every arm but plain freezes to the average of its recent weights (Egeria(average=WeightAverage()))")
    p.add_argument("--cache", action="store_true",
                   help="every arm but plain serves its frozen prefix from the activation cache (EgeriaCallback(cache=True))")
    args = p.parse_args(argv)
    task = args.task
    limit = args.limit if args.limit is not None else CUTS[task].limit
    epochs = args.epochs if args.epochs is not None else CUTS[task].epochs
    init = (args.init or str(DEFAULT_INIT)) if task == "gpt-ptb-order" else args.init
    out = args.out or ROOT / "benchmarks" / "results" / "freeze_cost" / f"{task}.json"
    from egeria.bench.tasks import baseline_options

    steps_per_epoch, run_epochs = task_shape(task, limit, epochs, init)
    steps = steps_per_epoch * run_epochs
    arms = [parse_arm(a, steps) for a in args.arms]
    defaults = baseline_options(steps_per_epoch, run_epochs)
    overrides = [arm_overrides(policy, options, defaults) for policy, _, options in arms]  # every arm checked first
    command = "python benchmarks/freeze_cost.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    machine = describe_machine()
    print(command)
    print(f"machine: {machine.get('cpu')}, {machine.get('cores')} cores, torch {machine.get('torch')}; {task}, {steps} steps")
    runs = [run_arm(task, policy, seed, options, runs=args.runs, init=init, limit=limit, epochs=epochs,
                    overrides=extra, average=args.average, cache=args.cache)
            for (policy, seed, options), extra in zip(arms, overrides)]
    plain = {seed: run for (policy, seed, _), run in zip(arms, runs) if policy == "none"}
    rows = [row(policy, seed, options, run, plain.get(seed)) for (policy, seed, options), run in zip(arms, runs)]
    print(f"{'arm':<16}{'seed':>5}{'final':>9}{'points':>9}{'time s':>9}{'speedup':>9}{'at pace':>9}  frozen")
    for r in rows:
        points = f"{r['points_vs_plain']:+.2f}" if "points_vs_plain" in r else "-"
        speed = f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else "-"
        paced = f"{r['speedup_at_plains_pace']:.2f}x" if r.get("speedup_at_plains_pace") is not None else "-"
        mark = "" if r.get("cadence_as_plain", True) else " *"
        print(f"{r['arm']:<16}{r['seed']:>5}{r['final']:>9.4f}{points + mark:>9}{r['wall_time_s']:>9.1f}{speed:>9}"
              f"{paced:>9}  {', '.join(r['frozen']) or '-'}")
    if not all(r.get("cadence_as_plain", True) for r in rows):
        print("* evaluated at another cadence than its plain run (another random path, about a reseed)")
    goal = frontier(rows)
    for d in goal:
        print(f"{d['baseline']} (seeds {','.join(map(str, d['seeds']))}: {d['speedup']:.2f}x, "
              f"{d['vs_worst_plain']:+.2f} vs the worst plain seed): dominated by "
              f"{', '.join(d['dominated_by']) or 'no Egeria setting here'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "machine": machine, "task": task, "limit": limit,
                               "epochs": epochs, "total_steps": steps, "rows": rows, "dominance": goal}, indent=1))
    plot(rows, out.with_suffix(".png"), task, steps)
    if goal:
        plot_frontier(rows, out.with_name(out.stem + "-frontier.png"), task, steps)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
