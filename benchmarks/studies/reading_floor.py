"""How far above its floor does each module's plasticity read, per learning-rate band?

How far above its *floor* each module's plasticity reads, per learning-rate band.

A module's floor is what a reading reads when the module has not moved: the SP loss
between a freshly refreshed reference and the training model's own eval-mode activation,
same weights, same batch (the reference's bf16 or int8 error). Egeria's rule freezes a
module whose smoothed readings stay within ``floor_ratio`` (8) x its smoothed floor for W
readings (``EgeriaConfig.floor_ratio``).

For each ``egeria bench`` Egeria run given (or readings written by ``benchmarks/studies/demo_arm.py
SEED egeria --history FILE``), per watched module and learning-rate half-decade (named by
its upper end): the number of readings, their median, the median floor, the median and the
lowest smoothed reading / floor (what the rule compares), the share of smoothed
readings within the default ``floor_ratio`` x the floor, and the median of each reading over the
next watched module's at the same step (*behind*: how much less a module moves than the one
after it; a pretrained front being adapted reads far below the layers behind it). Runs whose rows carry floors (code
from 5ccddc9 on) use each reading's own smoothed floor; for older runs the floor is measured
here on the run's final weights (the ``.pt`` beside its JSON), in the precision the run's
reference had on this machine, as the median over 4 random probes of the run's probe size.

    .venv/bin/python benchmarks/studies/reading_floor.py RUN.json [RUN.json ...] [--out FILE]

Prints the command, the machine and one table per run; writes the rows as JSON
(default ``benchmarks/results/reading_floor/floors.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBES = 4


def _model_and_data(task: str):
    """The task's model (untrained) and training set."""
    from egeria.models import TransformerLM, resnet

    if task in ("resnet-fmnist", "finetune-mnist"):
        from egeria.data import load_fashion_mnist, load_mnist5k

        data = load_fashion_mnist(split="train") if task == "resnet-fmnist" else load_mnist5k(split="train")
        return resnet(depth=20, in_channels=1, num_classes=10), data
    if task == "transformer-ptb":
        from egeria.data import LMWindows, load_ptb

        corpus = load_ptb()
        model = TransformerLM(corpus.vocab_size, d_model=128, n_heads=4, n_layers=6, d_ff=512, max_len=64, dropout=0.1)
        return model, LMWindows(corpus.train, 35)
    raise SystemExit(f"reading_floor.py: task {task!r} is not one of resnet-fmnist, finetune-mnist, transformer-ptb")


def measured_floors(run: dict, weights: Path) -> dict[str, float]:
    """Each watched module's floor on the run's final weights: median over random probes."""
    import torch

    from egeria.partition import partition_model
    from egeria.knowledge.placement import resolve_precision
    from egeria.knowledge.reference import ReferenceModel
    from egeria.knowledge.similarity import sp_loss
    from egeria.knowledge.truncated import outputs_until

    torch.manual_seed(0)
    model, data = _model_and_data(run["task"])
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    model.eval()
    size = run["config"].get("probe_size") or 32
    precision = resolve_precision(run["config"]["reference_precision"])
    partition = partition_model(model, (data[0][0].unsqueeze(0),))
    indices = list(range(partition.freezable))
    floors: dict[str, list[float]] = {}
    for _ in range(PROBES):
        picks = torch.randperm(len(data))[:size]
        inputs = torch.stack([data[int(i)][0] for i in picks])
        probe = ((inputs,), {})
        reference = ReferenceModel(model, partition, precision)
        reference.refresh(model.state_dict(), 0, indices[-1], probe)
        with torch.no_grad():
            ours = outputs_until(model, [partition.modules[i].output_block for i in indices], (inputs,), {})
        for index, a, b in zip(indices, ours, reference.activations(probe, indices)):
            floors.setdefault(partition.modules[index].name, []).append(float(sp_loss(a.float(), b)))
    return {name: statistics.median(values) for name, values in floors.items()}


def band(lr: float) -> float:
    """The learning rate's half-decade, named by its upper end (0.1, 0.0316, 0.01, ...): a
    step schedule's phases fall into one band each, a continuous schedule's into a few."""
    return round(10 ** (math.ceil(math.log10(lr) * 2 - 1e-9) / 2), 12)


def phases(run: dict, floors: dict[str, float] | None, ratio: float) -> list[dict]:
    """One row per watched module and learning-rate band (readings that straddled a change left out)."""
    rows = []
    readings = [r for r in run["plasticity"] if r.get("counted", True) and r.get("lr")]
    order = list(dict.fromkeys(r["module"] for r in readings))
    at = {(r["step"], r["module"]): r["plasticity"] for r in readings}
    for position, module in enumerate(order):
        mine = [r for r in readings if r["module"] == module]
        after = order[position + 1] if position + 1 < len(order) else None
        for lr in sorted({band(r["lr"]) for r in mine}, reverse=True):
            here = [r for r in mine if band(r["lr"]) == lr]
            if floors is None:
                pairs = [(r["plasticity"], r["smoothed"], r["floor"]) for r in here if r.get("floor")]
            else:
                pairs = [(r["plasticity"], r["smoothed"], floors[module]) for r in here]
            if not pairs:
                continue
            smoothed = [s / f for _, s, f in pairs]
            behind = [r["plasticity"] / at[(r["step"], after)] for r in here if at.get((r["step"], after), 0) > 0]
            rows.append({
                "module": module,
                "lr": lr,
                "readings": len(pairs),
                "median_reading": statistics.median(p for p, _, _ in pairs),
                "floor": statistics.median(f for _, _, f in pairs),
                "median_ratio": statistics.median(smoothed),
                "lowest_ratio": min(smoothed),
                "within_ratio": sum(r <= ratio for r in smoothed) / len(pairs),
                "behind": statistics.median(behind) if behind else None,
            })
    return rows


def main(argv: list[str]) -> None:
    from egeria import EgeriaConfig
    from egeria.bench.machine import describe_machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/reading_floor/floors.json")
    args = parser.parse_args(argv)
    print(" ".join([".venv/bin/python", "benchmarks/studies/reading_floor.py", *argv]))
    print(describe_machine())
    ratio = EgeriaConfig().floor_ratio
    results = []
    for path in args.runs:
        run = json.loads(path.read_text())
        if not run.get("plasticity"):
            raise SystemExit(f"{path}: no plasticity readings (not an Egeria run?)")
        recorded = any(r.get("floor") for r in run["plasticity"])
        if not recorded and not path.with_suffix(".pt").is_file():
            raise SystemExit(f"{path}: its readings carry no floors and no {path.with_suffix('.pt').name} lies beside it")
        floors = None if recorded else measured_floors(run, path.with_suffix(".pt"))
        rows = phases(run, floors, ratio)
        source = "recorded with each reading" if recorded else f"measured on the final weights ({path.with_suffix('.pt').name})"
        print(f"\n{path} ({run['task']}, seed {run['seed']}): floors {source}")
        print(f"{'module':<22}{'lr <=':>9}{'n':>5}{'reading':>11}{'floor':>11}{'sm/floor':>10}{'lowest':>9}"
              f"{f'<={ratio:g}x':>7}{'behind':>9}")
        for row in rows:
            print(f"{row['module']:<22}{row['lr']:>9.3g}{row['readings']:>5}{row['median_reading']:>11.2e}"
                  f"{row['floor']:>11.2e}{row['median_ratio']:>10.1f}{row['lowest_ratio']:>9.1f}{row['within_ratio']:>7.0%}"
                  + (f"{row['behind']:>9.3f}" if row["behind"] is not None else f"{'-':>9}"))
        results.append({"run": str(path), "task": run["task"], "seed": run["seed"], "floors": source, "rows": rows})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(["benchmarks/studies/reading_floor.py", *argv]),
                                    "machine": describe_machine(), "runs": results}, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
