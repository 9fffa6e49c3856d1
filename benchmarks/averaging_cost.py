"""What does freezing to the average (``Egeria(average=WeightAverage())``) cost before anything
freezes: the memory of the averages and the time of folding a step's weights into them?

On the demo's ResNet-20 (batch 128 of 1x28x28 images) and suite task (f)'s pretrained
all-MiniLM-L6-v2 classifier (batch 32 of 48 tokens), each under Egeria's cap on what may
freeze (``max_frozen_flops`` 0.75) and a policy that never freezes: the averages' bytes against
the model's parameters', and the median time of one fold (``FreezeToAverage.update``, what
``eg.step()`` adds every step) against the median time of a training step (forward, backward,
AdamW or SGD step) measured in the same process, each over ``--steps`` steps after two warm-up
steps. Random inputs: the cost does not depend on the data.

    .venv/bin/python benchmarks/averaging_cost.py [--steps 20] [--out benchmarks/results/averaging_cost/cost.json]

Prints the command, the machine and one row per model; writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "averaging_cost" / "cost.json"


def _models():
    """(name, model, optimizer, batch, loss) for each model measured."""
    import torch
    import torch.nn.functional as F

    from egeria.models import resnet

    torch.manual_seed(0)
    net = resnet(depth=20, in_channels=1, num_classes=10)
    images = (torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,)))
    yield ("ResNet-20 (demo)", net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), images,
           lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    try:
        from egeria.models.pretrained import minilm_classifier
    except ImportError:
        return
    try:
        encoder = minilm_classifier(2)
    except (FileNotFoundError, OSError, ValueError) as err:
        print(f"MiniLM skipped: {err}")
        return
    tokens = {"input_ids": torch.randint(1000, 2000, (32, 48)), "attention_mask": torch.ones(32, 48, dtype=torch.long),
              "labels": torch.randint(0, 2, (32,))}
    yield ("all-MiniLM-L6-v2 (f)", encoder, torch.optim.AdamW(encoder.parameters(), lr=5e-5), tokens,
           lambda m, b: m(**b).loss)


def measure(name, model, optimizer, batch, loss_fn, steps: int) -> dict:
    import egeria

    config = egeria.EgeriaConfig(policy="none", max_frozen_flops=0.75)
    eg = egeria.Egeria(model, optimizer, config=config, average=egeria.WeightAverage())
    step_times, fold_times = [], []
    model.train()
    for i in range(steps + 2):
        began = time.perf_counter()
        loss = loss_fn(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trained = time.perf_counter()
        eg.step(loss)  # binds at the first call; folds the weights in every call
        average = eg._prefix.average
        folding = time.perf_counter()
        average.update(0)  # one more fold, timed alone
        folded = time.perf_counter()
        if i >= 2:
            step_times.append(trained - began)
            fold_times.append(folded - folding)
    averaged = sum(t.numel() * t.element_size() for t in average.averages.values())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    eg.close()
    row = {
        "model": name,
        "parameters_bytes": params,
        "averages_bytes": averaged,
        "averages_share": averaged / params,
        "freezable_modules": eg.partition.freezable,
        "modules": len(eg.partition),
        "step_ms": 1000 * statistics.median(step_times),
        "fold_ms": 1000 * statistics.median(fold_times),
    }
    row["fold_share_of_step"] = row["fold_ms"] / row["step_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    from egeria.bench.machine import describe_machine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    command = shlex.join([".venv/bin/python", "benchmarks/averaging_cost.py", *(sys.argv[1:] if argv is None else argv)])
    machine = describe_machine()
    print("command:", command)
    print(f"machine: {machine.get('cpu')}, {machine.get('cores')} cores, torch {machine.get('torch')}")
    rows = [measure(*spec, steps=args.steps) for spec in _models()]
    print(f"{'model':<24}{'params MB':>10}{'averages MB':>12}{'share':>7}{'step ms':>9}{'fold ms':>9}{'fold/step':>10}")
    for r in rows:
        print(f"{r['model']:<24}{r['parameters_bytes'] / 2**20:>10.1f}{r['averages_bytes'] / 2**20:>12.1f}"
              f"{r['averages_share']:>7.2f}{r['step_ms']:>9.1f}{r['fold_ms']:>9.2f}{r['fold_share_of_step']:>10.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, "machine": machine, "steps": args.steps, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
