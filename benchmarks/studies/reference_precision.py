"""Does the reference's precision (int8, bf16, fp32) change the final accuracy?

Reference precision against final accuracy, as the paper's Table 2 (section 6.4).

Trains ResNet-20 on a Fashion-MNIST subset with Egeria three times, the reference model
in int8, bf16 and fp32, from the same seed and batch order, and reports each run's final
test accuracy, when modules froze, and the training wall time; the plain run (no
freezing) is the accuracy baseline. The reference forward speed relative to fp32 is in
``plasticity_cost.json`` (the same int8/bf16 kernels) and is repeated here from that file.

The controller runs inline here, so the three runs differ only in the reference's
arithmetic and not in timing; the process executor gives the same decisions for the same
evaluations (tested), a few steps later.

Run from the repository root::

    .venv/bin/python benchmarks/studies/reference_precision.py     # about 10 min on 2 cores
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", module=r"torch\.ao(\..*)?")

import torch  # noqa: E402

import egeria  # noqa: E402
from egeria.data import load_fashion_mnist  # noqa: E402
from egeria.bench.harness import classification_loss, train  # noqa: E402
from egeria.bench.machine import describe_machine  # noqa: E402
from egeria.models import resnet  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "controller"
SAMPLES, EPOCHS, BATCH = 6400, 8, 128


def run(precision: str | None) -> dict:
    data = load_fashion_mnist(split="train", limit=SAMPLES)
    test = load_fashion_mnist(split="test", limit=2000)
    torch.manual_seed(0)
    model = resnet(depth=20, in_channels=1, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    total = len(loader) * EPOCHS
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [total * 3 // 4], gamma=0.1)
    config = egeria.EgeriaConfig(policy="none") if precision is None else egeria.EgeriaConfig(reference_precision=precision, executor="inline")
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=total)
    steps = train(model, opt, lambda: loader, classification_loss, epochs=EPOCHS, scheduler=sched, egeria=eg)
    wall = steps[-1].train_time_s
    events = [d.to_dict() for d in eg.events]
    eg.close()
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return {"precision": precision or "plain", "accuracy": accuracy, "wall_s": wall, "events": events}


def main() -> None:
    torch.set_num_threads(2)
    command = " ".join([".venv/bin/python", "benchmarks/studies/reference_precision.py", *sys.argv[1:]])
    print(f"$ {command}")
    machine = describe_machine()
    print(f"machine: {machine['cpu']}, {machine['usable_cores']} usable cores, torch {machine['torch']}")
    cost_file = Path(__file__).resolve().parents[1] / "results" / "plasticity_cost.json"
    speed = {}
    if cost_file.exists():
        for entry in json.loads(cost_file.read_text())["results"]:
            for row in entry["rows"]:
                if row["ref_threads"] == 1:
                    speed.setdefault(entry["model"], {}).setdefault(row["precision"], []).append(round(row["speed_vs_fp32"], 2))
    runs = [run(p) for p in (None, "int8", "bf16", "fp32")]
    print(f"\nResNet-20, {SAMPLES} Fashion-MNIST images, {EPOCHS} epochs (LR x0.1 at 3/4), accuracy on 2,000 test images")
    print(f"{'reference':>10} {'accuracy':>9} {'wall s':>7}  freezes (step: module)")
    for r in runs:
        freezes = ", ".join(f"{e['step']}: {'+'.join(e['modules'])}" for e in r["events"] if e["action"] == "freeze")
        print(f"{r['precision']:>10} {r['accuracy']:9.2%} {r['wall_s']:7.1f}  {freezes or '-'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"command": command, "machine": machine, "samples": SAMPLES, "epochs": EPOCHS, "runs": runs, "speed_from_plasticity_cost": speed}
    (RESULTS / "reference_precision.json").write_text(json.dumps(out, indent=1))
    for model, by_precision in speed.items():
        print(f"reference forward speed vs fp32 ({model}, modules 0 / mid / last; plasticity_cost.json): "
              + ", ".join(f"{p} {'/'.join(map(str, v))}x" for p, v in by_precision.items()))
    print(f"\nwrote {RESULTS}/reference_precision.json")


if __name__ == "__main__":
    main()
