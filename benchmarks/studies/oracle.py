"""How far is each module from where plain training ends, against when Egeria froze it?

The post-hoc oracle: how far each layer module is from where plain training ends, over
training, against when Egeria froze it (issue 10, item 4; the paper's Figure 1 does the
same with PWCCA).

A plain ``resnet-fmnist`` run saved its weights at every record (``egeria bench ...
--snapshots``). For each snapshot and each of Egeria's layer modules, the oracle distance
is the SP loss (the measure plasticity uses) between the module's output under the
snapshot and under the final weights, on a fixed probe of test images, in eval mode. A
module whose distance has stopped falling has reached where it will end; a module frozen
while its distance still falls is cut off from its last changes. Egeria runs given with
``--egeria`` add their freeze steps and plasticity readings.

    .venv/bin/python benchmarks/studies/oracle.py \\
        benchmarks/results/tta-full/accel/resnet-fmnist/none-seed0.json \\
        --egeria benchmarks/results/tta-full/variants/regimes-max-frozen-5/accel/resnet-fmnist/egeria-cache-seed0.json

Writes ``benchmarks/results/oracle/oracle.json`` and ``oracle.png``; prints the command,
the machine and, per module, its distance at a few landmarks relative to its largest.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks/results/oracle"


def snapshots_of(run_path: Path) -> dict[int, Path]:
    """Step -> snapshot file of the run saved with ``--snapshots``."""
    folder = run_path.with_name(run_path.stem + "-snapshots")
    if not folder.is_dir():
        raise SystemExit(f"{folder} does not exist: run the plain benchmark with --snapshots")
    found = {}
    for path in folder.glob("step*.pt"):
        match = re.fullmatch(r"step(\d+)\.pt", path.name)
        if match:
            found[int(match.group(1))] = path
    if len(found) < 2:
        raise SystemExit(f"{folder} holds {len(found)} snapshots; the study needs at least 2")
    return dict(sorted(found.items()))


@torch.no_grad()
def distances(model: torch.nn.Module, run_path: Path, probe_size: int) -> tuple[list[str], list[int], list[list[float]]]:
    """(module names, steps, distance[step][module]) of the run's snapshots to its final
    weights, loaded in turn into ``model`` (the task's)."""
    import egeria
    from egeria.data import load_fashion_mnist
    from egeria.knowledge.similarity import sp_loss
    from egeria.knowledge.truncated import outputs_until

    probe = load_fashion_mnist(split="test", limit=probe_size).tensors[0]
    model.eval()
    partition = egeria.partition_model(model, (probe[:4],))
    blocks = [m.output_block for m in partition.modules[: partition.freezable]]
    names = partition.names[: partition.freezable]

    def outputs(path: Path) -> list[torch.Tensor]:
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return outputs_until(model, blocks, (probe,), {})

    final = outputs(run_path.with_suffix(".pt"))
    steps, table = [], []
    for step, path in snapshots_of(run_path).items():
        steps.append(step)
        table.append([float(sp_loss(a, b)) for a, b in zip(outputs(path), final)])
    return names, steps, table


def settled_step(steps: list[int], values: list[float], share: float) -> int | None:
    """The first step from which the distance stays at or below ``share`` of its largest."""
    limit = share * max(values)
    for i in range(len(values)):
        if all(v <= limit for v in values[i:]):
            return steps[i]
    return None


def egeria_run(path: Path) -> dict:
    run = json.loads(path.read_text())
    return {
        "path": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "final": run["final"]["metric"],
        "freezes": [{"step": e["step"], "modules": e["modules"]} for e in run["events"] if e["action"] == "freeze"],
        "unfreezes": [e["step"] for e in run["events"] if e["action"] == "unfreeze"],
        "plasticity": [(r["step"], r["module"], r["smoothed"]) for r in run["plasticity"]],
    }


def main() -> None:
    from egeria.bench.machine import describe_machine

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plain", type=Path, help="a plain resnet-fmnist run JSON saved with --snapshots")
    parser.add_argument("--egeria", type=Path, action="append", default=[], help="an Egeria run JSON to set beside it")
    parser.add_argument("--probe", type=int, default=512, help="test images in the probe (default 512)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder for oracle.json and oracle.png (default {OUT.relative_to(ROOT)})")
    args = parser.parse_args()
    command = " ".join([".venv/bin/python", "benchmarks/studies/oracle.py", *sys.argv[1:]])
    print(command)
    machine = describe_machine()
    print(machine)
    from egeria.bench.tasks import task_of_run

    plain = json.loads(args.plain.read_text())
    if plain["task"] != "resnet-fmnist":
        raise SystemExit(f"{args.plain}: task {plain['task']!r}; the oracle study reads resnet-fmnist runs")
    task = task_of_run(plain)  # the run's own model and schedule
    drops = sorted(task.scheduler.milestones)
    names, steps, table = distances(task.model, args.plain.resolve(), args.probe)
    eg_runs = [egeria_run(p.resolve()) for p in args.egeria]
    landmarks = {"first LR drop": drops[0], "second LR drop": drops[1]}
    for i, run in enumerate(eg_runs):
        if run["freezes"]:
            landmarks[f"egeria run {i + 1}'s first freeze"] = run["freezes"][0]["step"]
    modules = []
    for m, name in enumerate(names):
        curve = [row[m] for row in table]
        at = {label: curve[min(range(len(steps)), key=lambda i: abs(steps[i] - step))] / max(curve)
              for label, step in landmarks.items()}
        modules.append({
            "module": name,
            "distance": curve,
            "relative_at": at,
            "settled_10pct": settled_step(steps, curve, 0.1),
            "settled_1pct": settled_step(steps, curve, 0.01),
        })
    print(f"distance to the final weights, relative to each module's largest; probe {args.probe} test images")
    header = f"{'module':22} " + " ".join(f"{label[:22]:>22}" for label in landmarks) + f" {'<=10% from':>11} {'<=1% from':>10}"
    print(header)
    for row in modules:
        cells = " ".join(f"{row['relative_at'][label]:>22.3g}" for label in landmarks)
        print(f"{row['module']:22} {cells} {str(row['settled_10pct']):>11} {str(row['settled_1pct']):>10}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": command, "machine": machine, "plain": str(args.plain), "probe": args.probe,
        "lr_drops": drops, "steps": steps, "modules": modules, "egeria": eg_runs, "landmarks": landmarks,
    }
    (args.out / "oracle.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "oracle.png")
    print(f"wrote {args.out / 'oracle.json'} and oracle.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + len(result["egeria"])
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3.6 * panels), sharex=True, squeeze=False)
    colours = plt.get_cmap("viridis")
    count = len(result["modules"])
    ax = axes[0][0]
    for m, row in enumerate(result["modules"]):
        top = max(row["distance"])
        points = [(s, v / top) for s, v in zip(result["steps"], row["distance"]) if v > 0]  # the final step is 0
        ax.plot(*zip(*points), color=colours(m / max(1, count - 1)), label=row["module"])
    ax.set_yscale("log")
    ax.set_ylabel("SP distance to final\n(relative to its largest)")
    ax.set_title("plain training: each module's distance to where it ends")
    ax.legend(fontsize=7, ncol=2)
    for i, run in enumerate(result["egeria"]):
        ax = axes[i + 1][0]
        for m, row in enumerate(result["modules"]):
            points = [(s, v) for s, name, v in run["plasticity"] if name == row["module"] and v > 0]
            if points:
                ax.plot(*zip(*points), color=colours(m / max(1, count - 1)), lw=0.8)
        for f in run["freezes"]:
            ax.axvline(f["step"], color="black", ls=":", lw=1)
        ax.set_yscale("log")
        ax.set_ylabel("smoothed plasticity")
        ax.set_title(f"Egeria run {i + 1} (final {100 * run['final']:.2f}%): readings; dotted: freezes", fontsize=9)
    for row in axes:
        for drop in result["lr_drops"]:
            row[0].axvline(drop, color="grey", ls="--", lw=1)
    axes[-1][0].set_xlabel("step (dashed: LR /10)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
