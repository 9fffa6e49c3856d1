"""How far does the demo's plain final move when training changes harmlessly at the freeze step?

How far the demo's plain final accuracy moves when plain training changes harmlessly at the
step where Egeria's demo freezes: the noise floor for the demo's "same accuracy".

Egeria's arm and plain's arm are bit-identical until Egeria's first freeze (step 640 of 800
on the default config); after it they differ, and so would any two plain runs that differed
there. A *twin* is plain training, with the demo's data, model, schedule and seeded batch
order, whose examples from step ``AT`` on come in another random order (the rest of that
epoch's examples reshuffled, later epochs drawn afresh): plain SGD with other noise from the
same point. The twins' distance from the committed plain arm is how much accuracy a
divergence at ``AT`` moves without costing anything.

    .venv/bin/python benchmarks/studies/demo_noise.py run SEED TWIN [AT]   # prints one JSON line
    .venv/bin/python benchmarks/studies/demo_noise.py table FILE.jsonl      # per seed, against Egeria

``run`` checks that the twin's losses match the committed plain arm's
(``benchmarks/results/demo/seedS/demo.json``) through step ``AT`` (they do on the machine
and thread count that made it) and prints the twin's per-epoch accuracy. ``table`` sets
the twins beside the committed plain and Egeria arms of each seed.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FREEZE_STEP = 640  # Egeria's first freeze on every seed of the committed demo


def twin_order(epoch_order: list[int], epoch: int, steps_per_epoch: int, batch: int, at: int, other: Any) -> list[int]:
    """One epoch's example order (``epoch`` counts from 0): the demo's order for the steps up
    to ``at``, the remaining examples permuted with the generator ``other``."""
    import torch

    keep = max(0, min(len(epoch_order), (at - epoch * steps_per_epoch) * batch))
    rest = epoch_order[keep:]
    shuffled = [rest[i] for i in torch.randperm(len(rest), generator=other).tolist()]
    return epoch_order[:keep] + shuffled


def run(seed: int, twin: int, at: int) -> dict:
    import torch

    import egeria.bench.demo as demo
    from egeria.bench.harness import classification_loss, train

    # Read first: a missing committed demo stops the run before its minutes of training.
    committed = json.loads((ROOT / f"benchmarks/results/demo/seed{seed}/demo.json").read_text())["runs"]
    s = demo.FULL
    shared = demo.prepare(s, seed)
    model, optimizer, scheduler = demo._setup(shared.initial, s, shared.milestones)
    # The demo's loader (shuffled by a generator with the seed) over the examples' indices:
    # it draws from its generator as the demo's does, so the order up to ``at`` is the demo's.
    x, y = shared.train
    indices = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(len(y))), batch_size=s.batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    other = torch.Generator().manual_seed(1_000_003 * (twin + 1) + seed)
    epoch = -1

    def batches() -> Any:
        nonlocal epoch
        epoch += 1
        demo_order = torch.cat([b for (b,) in indices]).tolist()
        order = twin_order(demo_order, epoch, shared.steps_per_epoch, s.batch_size, at, other)
        for start in range(0, len(order), s.batch_size):
            index = torch.tensor(order[start : start + s.batch_size])
            yield x[index], y[index]

    accuracy: list[float] = []
    steps = train(
        model, optimizer, batches, classification_loss, epochs=s.epochs, scheduler=scheduler,
        evaluate=lambda _: accuracy.append(round(100 * demo._accuracy(model, shared.test), 2)),
    )
    return {
        "seed": seed, "twin": twin, "at": at, "accuracy": accuracy,
        "matches_committed_plain_through": demo.identical_through([r.loss for r in steps], committed["plain"]["losses"]),
        "threads": torch.get_num_threads(),
    }


def table(path: Path) -> str:
    twins: dict[int, list[float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["matches_committed_plain_through"] < row["at"]:
            raise SystemExit(f"{path}: seed {row['seed']} twin {row['twin']} left the demo's plain run before step {row['at']}")
        twins.setdefault(row["seed"], []).append(row["accuracy"][-1])
    lines = [
        "| seed | plain final | twins' finals | twins minus plain | Egeria final | Egeria minus plain |",
        "|---:|---:|---|---|---:|---:|",
    ]
    distances, deficits = [], []
    for seed in sorted(twins):
        runs = json.loads((ROOT / f"benchmarks/results/demo/seed{seed}/demo.json").read_text())["runs"]
        plain, egeria = (round(100 * runs[arm]["final_accuracy"], 2) for arm in ("plain", "egeria"))
        moved = [round(t - plain, 2) for t in twins[seed]]
        distances += [abs(m) for m in moved]
        deficits.append(round(egeria - plain, 2))
        lines.append(
            f"| {seed} | {plain:.2f} | {', '.join(f'{t:.2f}' for t in twins[seed])} | "
            f"{', '.join(f'{m:+.2f}' for m in moved)} | {egeria:.2f} | {egeria - plain:+.2f} |"
        )
    lines += [
        "",
        f"Twins: {len(distances)}; distance from their plain arm: mean {statistics.mean(distances):.3f}, "
        f"largest {max(distances):.2f} points.",
        f"Egeria minus plain: mean {statistics.mean(deficits):+.3f}, largest shortfall {-min(deficits):.2f} points.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[0] == "run":
        at = int(argv[3]) if len(argv) > 3 else FREEZE_STEP
        print(json.dumps(run(int(argv[1]), int(argv[2]), at)))
    elif len(argv) == 2 and argv[0] == "table":
        print(table(Path(argv[1])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
