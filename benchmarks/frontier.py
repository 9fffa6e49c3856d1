"""What does each freezing setting trade, speed for accuracy, on the demo's task, and how does
the trade move as the run gets longer?

Every policy's setting is a point: its whole-run speedup over plain training timed in the same
session (the arms take turns every 10 steps, each in its own process: egeria.bench.turns), and
its final test accuracy minus the worst plain seed's at that run length. A session is one seed
at one run length; its arms are given on the command line:

    plain                       plain PyTorch (every session has one: speedups are against it)
    egeria:SPEED                Egeria, EgeriaConfig(speed=SPEED): safe, balanced, fast or a share
                                of the peak learning rate (0.01, 0.03, 0.1, 1 for no bound)
    egeria:SPEED:FIELD=VALUE    the same with other EgeriaConfig fields changed; unfreeze=F unfreezes
                                every module at a learning-rate drop of F x since the first freeze,
                                to refreeze once settled again (the paper's, Egeria(unfreeze_rule=
                                LRDropRule(F))); average=auto freezes each module to the average
                                of its recent weights (Egeria(average=WeightAverage()); average=N:
                                over N steps)
    paper                       the paper's rule (EgeriaConfig(rule="paper"))
    POLICY:OPT=VALUE[:...]      a baseline with its options (freezeout:t0=0.5,
                                autofreeze:percentile=25, linear:start=0.75,
                                static:count=5:at_step=450)

The task is the demo's (ResNet-20 on 12,800 Fashion-MNIST images, SGD 0.1, lr /10 at 50% and
75% of the steps, accuracy on all 10,000 test images at each epoch's end), with ``--scale K``
epochs times K (8 K epochs, 800 K steps): the same schedule shape, K times longer, as the
paper's 200-epoch CIFAR runs are long.

    .venv/bin/python benchmarks/frontier.py run --seed 0 --scale 1 plain egeria:safe egeria:fast \\
        paper freezeout:t0=0.5
    .venv/bin/python benchmarks/frontier.py report

``--device cuda`` trains every arm on the GPU (the data stays on the host, each batch is
moved, each step's time waits for its last kernel); give such sessions their own ``--out``, as
speedups and accuracies are compared within one machine only.

``run`` writes one session file (``benchmarks/results/frontier/x{K}/seed{S}-{label}.json``: the
command, the machine, each arm's config, per-epoch accuracy and training time, freezes) and
skips a session whose file is there. ``report`` reads every session, prints one row per arm
and run length (mean and each seed's speedup and accuracy against the worst plain seed), and
writes ``frontier.json`` and the plots ``frontier-x{K}.png`` (the frontier at each length) and
``run-length.png`` (cost and speedup of the Egeria settings against run length).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from egeria.bench.plots import policy_colour
from egeria.bench.report import at_least_as_good

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "frontier"
BASELINES = ("freezeout", "autofreeze", "linear", "static", "smartfrz")


def parse_arm(text: str) -> tuple[str, dict]:
    """An arm's name and the EgeriaConfig fields it sets (None for plain).

    Raises:
        ValueError: naming the arm that is none of the forms in the module's docstring.
    """
    head, *rest = text.split(":")
    try:
        if head == "plain" and not rest:
            return text, {}
        if head == "paper":
            return text, {"rule": "paper", **_options(rest)}
        if head == "egeria" and rest:
            speed = rest[0] if rest[0] in ("safe", "balanced", "fast") else float(rest[0])
            return text, {"speed": speed, **_options(rest[1:])}
        if head in BASELINES:
            return text, {"policy": head, "policy_options": _options(rest)}
    except ValueError:
        pass
    raise ValueError(f"arm {text!r}: write plain, egeria:SPEED[:FIELD=VALUE...], paper or POLICY:OPT=VALUE[:...]")


def _options(items: list[str]) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(item)
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def _arm(name: str, fields: dict, prepared: Any, settings: Any, seed: int) -> dict:
    """One arm, in its own process and turns (egeria.bench.demo's training loop)."""
    from egeria import EgeriaConfig
    from egeria.bench import demo

    from egeria import LRDropRule, WeightAverage

    fields = dict(fields)
    unfreeze = fields.pop("unfreeze", None)
    average = fields.pop("average", None)
    config = EgeriaConfig(**fields) if name != "plain" else None
    record, extra = demo._train(name, prepared.initial, prepared.train, prepared.test, settings, seed,
                                prepared.milestones, config, prepared.total_steps, False,
                                unfreeze_rule=None if unfreeze is None else LRDropRule(float(unfreeze)),
                                average=None if average is None else WeightAverage(None if average == "auto" else average))
    record.pop("step_times_s")
    out = {"arm": name, "config": None if config is None else config.to_dict(), **record}
    if extra:
        out.update({k: extra[k] for k in ("modules", "module_params", "eval_interval", "events", "frozen_at_end")})
        # what held each module back: its stale count, drift still to come and rate at each reading
        keep = ("step", "module", "stale", "outlook_share", "lr_share", "counted")
        out["readings"] = [{k: row.get(k) for k in keep} for row in extra.get("history", [])]
    return out


def run(seed: int, scale: int, arms: list[str], out: Path, label: str | None, command: str,
        device: str = "cpu") -> Path:
    from dataclasses import asdict, replace

    from egeria.bench import demo
    from egeria.bench.machine import describe_machine
    from egeria.bench.turns import run_in_turns

    parsed = [parse_arm(a) for a in arms]
    if parsed[0][0] != "plain":
        parsed.insert(0, ("plain", {}))
    label = label or "-".join(a.replace(":", "_").replace("=", "") for a, _ in parsed[1:])[:80] or "plain"
    path = out / f"x{scale}" / f"seed{seed}-{label}.json"
    if path.is_file():
        print(f"{path} is there: skipped")
        return path
    settings = replace(demo.FULL, epochs=demo.FULL.epochs * scale, device=device)
    prepared = demo.prepare(settings, seed)
    machine = describe_machine(device)
    print(f"command: {command}")
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    print(f"seed {seed}, x{scale}: {prepared.total_steps} steps, lr /10 at {prepared.milestones}; arms: "
          + ", ".join(a for a, _ in parsed), flush=True)
    calls = [(name, fields, prepared, settings, seed) for name, fields in parsed]
    answers = run_in_turns(_arm, calls, settings.turn_steps, initializer=demo._start_child,
                           initargs=demo._child_settings(settings))
    plain = answers[0]
    for arm in answers:
        first = next((e["step"] for e in arm.get("events", []) if e["action"] == "freeze"), None)
        print(f"  {arm['arm']:<32} {100 * arm['final_accuracy']:6.2f}%  {arm['train_time_s']:8.1f} s  "
              f"{plain['train_time_s'] / arm['train_time_s']:5.2f}x  first freeze {first}", flush=True)
    from egeria.bench.run import _code_commit

    result = {"command": command, "machine": machine, "code": _code_commit(), "seed": seed, "scale": scale,
              "settings": asdict(settings),
              "total_steps": prepared.total_steps, "milestones": prepared.milestones, "arms": answers}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, allow_nan=False))
    tmp.replace(path)
    print(f"wrote {path}")
    return path


def points(out: Path) -> list[dict]:
    """One point per arm per session: speedup against its session's plain arm, final
    accuracy against the worst plain seed of its run length (points of accuracy)."""
    sessions = [json.loads(p.read_text()) for p in sorted(out.glob("x*/seed*.json"))]
    worst: dict[int, float] = {}
    plains: dict[int, dict[int, float]] = {}
    for s in sessions:
        plains.setdefault(s["scale"], {})[s["seed"]] = s["arms"][0]["final_accuracy"]
    for scale, by_seed in plains.items():
        worst[scale] = min(by_seed.values())
    rows = []
    for s in sessions:
        plain = s["arms"][0]
        for arm in s["arms"]:
            first = next((e["step"] for e in arm.get("events", []) if e["action"] == "freeze"), None)
            rows.append({
                "scale": s["scale"], "steps": s["total_steps"], "seed": s["seed"], "arm": arm_label(arm),
                "final": 100 * arm["final_accuracy"],
                "vs_worst_plain": 100 * (arm["final_accuracy"] - worst[s["scale"]]),
                "vs_own_plain": 100 * (arm["final_accuracy"] - plain["final_accuracy"]),
                "speedup": plain["train_time_s"] / arm["train_time_s"],
                "train_time_s": arm["train_time_s"], "first_freeze": first,
                "frozen_at_end": len(arm.get("frozen_at_end", [])),
                "cpu": s["machine"].get("cpu"), "accelerator": s["machine"].get("accelerator"),
            })
    return rows


def arm_label(arm: dict) -> str:
    """The arm's name, with the horizon it ran under where that is not the one its name gives
    today (sessions made before the speed moved the horizon: speed_horizon)."""
    from egeria import EgeriaConfig

    name, fields = parse_arm(arm["arm"])
    recorded = (arm.get("config") or {}).get("horizon")
    if "speed" not in fields or recorded is None:
        return name
    fields.pop("unfreeze", None)
    fields.pop("average", None)
    if recorded == EgeriaConfig(**fields).horizon:
        return name
    return f"{name} (horizon {recorded:g})"


def summarise(rows: list[dict]) -> list[dict]:
    """Per run length and arm: the seeds' mean speedup and accuracy against the worst plain seed.
    A seed run in several sessions (plain is in every one) counts once, as the mean of its
    sessions, so that no seed weighs more for having been run more often."""
    groups: dict[tuple[int, str], dict[int, list[dict]]] = {}
    for r in rows:
        groups.setdefault((r["scale"], r["arm"]), {}).setdefault(r["seed"], []).append(r)
    out = []
    for (scale, arm), by_seed in sorted(groups.items()):
        def mean_over_seeds(key: str) -> float:
            return statistics.mean(statistics.mean(r[key] for r in rs) for rs in by_seed.values())

        out.append({
            "scale": scale, "arm": arm, "seeds": sorted(by_seed),
            "speedup": mean_over_seeds("speedup"),
            "vs_worst_plain": mean_over_seeds("vs_worst_plain"),
            "vs_own_plain": mean_over_seeds("vs_own_plain"),
            "each": [(r["seed"], round(r["speedup"], 3), round(r["vs_worst_plain"], 2))
                     for seed in sorted(by_seed) for r in by_seed[seed]],
        })
    return out


def dominated(summary: list[dict]) -> list[dict]:
    """For each baseline point, the Egeria settings at least as fast and at least as accurate
    (means over seeds, at the same run length): the frontier goal, one row per baseline."""
    out = []
    for b in summary:
        if b["arm"].split(":")[0] not in BASELINES:
            continue
        better = [e["arm"] for e in summary if e["scale"] == b["scale"] and e["arm"].startswith(("egeria", "paper"))
                  and at_least_as_good(e, b)]
        out.append({"scale": b["scale"], "baseline": b["arm"], "dominated_by": better})
    return out


def report(out: Path) -> None:
    rows = points(out)
    summary = summarise(rows)
    print(f"{'length':>6}  {'arm':<34} {'seeds':<8} {'speedup':>8} {'vs worst plain':>15}  each (seed, x, points)")
    for s in summary:
        print(f"{'x' + str(s['scale']):>6}  {s['arm']:<34} {','.join(map(str, s['seeds'])):<8} {s['speedup']:7.2f}x "
              f"{s['vs_worst_plain']:+14.2f}  {s['each']}")
    goal = dominated(summary)
    for g in goal:
        print(f"x{g['scale']} {g['baseline']}: dominated by {', '.join(g['dominated_by']) or 'no Egeria setting'}")
    (out / "frontier.json").write_text(json.dumps({"points": rows, "summary": summary, "dominance": goal},
                                                  indent=1, allow_nan=False))
    _plot(summary, out)


def egeria_front(summary: list[dict]) -> list[dict]:
    """The Egeria settings no other Egeria setting of the same run length beats (at least as
    fast and as accurate, better on one), slowest first: the frontier the knob walks along."""
    mine = [s for s in summary if s["arm"].startswith(("egeria", "paper"))]

    def beats(o: dict, s: dict) -> bool:
        return (o["scale"] == s["scale"] and at_least_as_good(o, s)
                and (o["speedup"], o["vs_worst_plain"]) != (s["speedup"], s["vs_worst_plain"]))

    return sorted((s for s in mine if not any(beats(o, s) for o in mine)), key=lambda s: (s["scale"], s["speedup"]))


def _variant(arm: str) -> bool:
    """An Egeria arm beyond the knob's own values (a field changed, or an old horizon)."""
    return arm.startswith("egeria") and (arm.count(":") > 1 or "(" in arm)


def _plot(summary: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    beaten = {(g["scale"], g["baseline"]) for g in dominated(summary) if g["dominated_by"]}
    for scale in sorted({s["scale"] for s in summary}):
        fig, ax = plt.subplots(figsize=(11, 5))
        here = sorted((s for s in summary if s["scale"] == scale), key=lambda s: (s["speedup"], s["vs_worst_plain"]))
        front = [s for s in egeria_front(summary) if s["scale"] == scale]
        ax.plot([s["speedup"] for s in front], [s["vs_worst_plain"] for s in front], color="tab:blue", lw=1,
                label="Egeria's frontier (settings no other Egeria setting beats)")
        labelled = [s for s in here if not _variant(s["arm"])]
        for s in here:
            kind = s["arm"].split(":")[0]
            colour = policy_colour(kind)
            if _variant(s["arm"]):  # drawn, not named: frontier.json names them
                ax.scatter(s["speedup"], s["vs_worst_plain"], marker="*", s=40, color="tab:blue", alpha=0.35)
                continue
            hollow = (scale, s["arm"]) in beaten
            ax.scatter(s["speedup"], s["vs_worst_plain"], marker="*" if kind in ("egeria", "paper") else "o",
                       s=110 if kind in ("egeria", "paper") else 40, edgecolors=colour,
                       facecolors="none" if hollow else colour)
            # each named point gets a number, its name listed beside the plot: close points stay legible
            i = labelled.index(s) + 1
            ax.annotate(str(i), (s["speedup"], s["vs_worst_plain"]), fontsize=7, color=colour,
                        xytext=(3, 3), textcoords="offset points")
        ax.scatter([], [], marker="*", s=40, color="tab:blue", alpha=0.35,
                   label="other Egeria variants (a horizon, an unfreeze, the average: frontier.json)")
        if any(s["arm"].split(":")[0] in BASELINES for s in here):
            ax.scatter([], [], marker="o", edgecolors="grey", facecolors="none",
                       label="a baseline an Egeria setting dominates")
            ax.scatter([], [], marker="o", color="grey", label="a baseline no Egeria setting dominates")
        ax.axhline(0, color="grey", lw=0.8, ls="--")
        ax.legend(fontsize=7, loc="lower left")
        names = "\n".join(f"{i} {s['arm']} ({s['speedup']:.2f}x, {s['vs_worst_plain']:+.2f})"
                          for i, s in enumerate(labelled, start=1))
        fig.text(0.745, 0.5, names, fontsize=7, va="center", family="monospace")
        fig.subplots_adjust(right=0.73)
        ax.set_xlabel("whole-run speedup over plain of the same session (x)")
        ax.set_ylabel("final accuracy minus the worst plain seed (points)")
        ax.set_title(f"Speed against accuracy, demo task at {scale}x its length (mean over seeds)")
        fig.tight_layout(rect=(0, 0, 0.73, 1))
        fig.savefig(out / f"frontier-x{scale}.png", dpi=110)
        plt.close(fig)
    egeria_arms = sorted({s["arm"] for s in summary if s["arm"].startswith("egeria")})
    scales = sorted({s["scale"] for s in summary})
    if len(scales) < 2:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for arm in egeria_arms:
        pts = [(s["scale"], s) for s in summary if s["arm"] == arm]
        if len(pts) < 2:
            continue
        xs = [800 * k for k, _ in pts]
        left.plot(xs, [s["vs_own_plain"] for _, s in pts], marker="o", label=arm)
        right.plot(xs, [s["speedup"] for _, s in pts], marker="o", label=arm)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("training steps (schedule shape fixed)")
        ax.legend(fontsize=8)
    left.axhline(0, color="grey", lw=0.8, ls="--")
    left.set_ylabel("final accuracy minus plain of the same seed (points)")
    right.set_ylabel("whole-run speedup (x)")
    fig.suptitle("Egeria against run length, demo task")
    fig.tight_layout()
    fig.savefig(out / "run-length.png", dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("arms", nargs="+")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--scale", type=int, default=1, help="run length: the demo's epochs times this")
    r.add_argument("--label", default=None, help="the session file's name (default: from the arms)")
    r.add_argument("--out", type=Path, default=OUT)
    r.add_argument("--device", default="cpu", help="where the arms train (cuda for a GPU; the data stays on the host)")
    p = sub.add_parser("report")
    p.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.verb == "run":
        for arm in args.arms:
            parse_arm(arm)  # every arm checked before anything trains
        command = "python benchmarks/frontier.py " + " ".join(shlex.quote(a) for a in argv)
        run(args.seed, args.scale, args.arms, args.out, args.label, command, args.device)
    else:
        report(args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
