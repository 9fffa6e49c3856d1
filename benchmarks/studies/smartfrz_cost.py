"""What does SmartFRZ cost at run time on the benchmark's models?

What SmartFRZ costs at run time on the benchmark's models: the weights it records and
the time of a sampling step and of a freezing stage (issue 29).

    .venv/bin/python benchmarks/studies/smartfrz_cost.py

For ResNet-20 (``resnet-fmnist``, ``finetune-mnist``) and the 6-block Transformer LM of
``transformer-ptb`` (vocabulary 10,000), the policy is bound with the shipped predictor and
its default window and sample size; its windows are filled by calling
:meth:`~egeria.policies.SmartFRZ.target` at 30 sampling steps (no training: the cost does
not depend on the weights' values), then a stage (one more sample, the predictor over every
full window, the front-run decision) is timed; ``--repeats`` times from empty windows,
medians, on one thread. Writes
``benchmarks/results/smartfrz/cost.json`` and prints the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks/results/smartfrz"


def measure(name: str, model: torch.nn.Module, example: torch.Tensor, repeats: int) -> dict:
    import egeria
    from egeria.policies import Binding, SmartFRZ, StepInfo

    partition = egeria.partition_model(model, (example,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    binding = Binding(model, partition, optimizer, frozen=lambda: 0, step=lambda: 0, own_pass=lambda: False,
                      event=lambda decision: None)
    modules = partition.freezable
    sample_every = 1

    def info(step: int) -> StepInfo:
        return StepInfo(step=step, total_steps=None, frozen=0, freezable=modules, lr=0.1)

    sampling, stage = [], []
    for _ in range(repeats):
        policy = SmartFRZ()
        policy.bind(binding)  # fresh, empty windows
        policy.stage_every = 2 * policy.window - 1  # a sample every step, no stage in the first window
        for step in range(1, policy.window + 1):
            started = time.perf_counter()
            policy.target(info(step))
            sampling.append(time.perf_counter() - started)
        state = policy.state_dict()  # the windows a checkpoint holds, before the stage
        policy.stage_every = policy.window + 1  # the next call is a stage: a sample, the predictor, the decision
        started = time.perf_counter()
        policy.target(info(policy.window + 1))
        stage.append(time.perf_counter() - started)
    recorded = modules * policy.window * policy.size * 4
    return {
        "model": name,
        "layer_modules": partition.names,
        "watched_modules": modules,
        "parameters": sum(p.numel() for p in model.parameters()),
        "window": policy.window,
        "size": policy.size,
        "sample_every": sample_every,
        "recorded_bytes": recorded,
        "recorded_share_of_model": recorded / (4 * sum(p.numel() for p in model.parameters())),
        "state_windows": sum(1 for w in state["windows"] if w is not None),
        "state_json_bytes": len(json.dumps(state)),
        "sampling_step_ms": 1000 * statistics.median(sampling),
        "stage_ms": 1000 * statistics.median(stage),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from egeria.bench.machine import describe_machine
    from egeria.models import TransformerLM, resnet

    results = [
        measure("ResNet-20 (resnet-fmnist, finetune-mnist)", resnet(depth=20, in_channels=1, num_classes=10),
                torch.randn(2, 1, 28, 28), args.repeats),
        measure("Transformer LM, 6 blocks (transformer-ptb)",
                TransformerLM(10_000, d_model=128, n_heads=4, n_layers=6, d_ff=512, max_len=64, dropout=0.1),
                torch.randint(0, 10_000, (2, 35)), args.repeats),
    ]
    record = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "machine": describe_machine(), "results": results}
    print(record["command"])
    print(json.dumps(record["machine"]))
    for r in results:
        print(f"{r['model']}: {r['watched_modules']} modules watched, {r['recorded_bytes'] / 1e6:.2f} MB of samples "
              f"({100 * r['recorded_share_of_model']:.1f}% of the weights' bytes), a sampling step "
              f"{r['sampling_step_ms']:.3f} ms, a stage {r['stage_ms']:.1f} ms, "
              f"{r['state_json_bytes'] / 1e6:.2f} MB of checkpoint state (base64 in the JSON state)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cost.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
