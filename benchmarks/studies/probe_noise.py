"""How much of a reading's drift is the batch it is read on, not the weights' motion?

Egeria reads a module's plasticity as the SP distance between the activations of the weights
of D steps ago and of the current weights on a probe: the first ``probe_size`` images of the
batch of the reading's step (``_probe_copy``), so each reading is taken on other images. On
the demo's task (ResNet-20, Fashion-MNIST, learning rate /10 at steps 400 and 600), the
default's freeze step moved by the sampling of the readings (record 038): the stem's drift
per unit of learning-rate mass varied up to tenfold from one reading to the next in the last
regime. This trains the demo's model once, plainly (its data, model, schedule, seed and
batch order, through :func:`egeria.bench.harness.train`), snapshots the weights every D = 20
steps and reads each module's drift over every D steps three times: on the batch of the
reading's step (as Egeria does); on one fixed probe (the first 32 training images); and on
that probe with the current weights but the old batch-norm running statistics (buffers), so
that the drift is the weights' alone. Every module's activation is taken from each model's
own forward pass in eval mode.

    .venv/bin/python benchmarks/studies/probe_noise.py [SEED]

Prints the command, the machine and, per module and learning-rate regime, the median drift
and its spread between consecutive readings (the median of |log10(d_i / d_{i-1})|: 0.3 is a
twofold step) for the three readings; writes ``benchmarks/results/probe_noise/seedS.json``
and ``seedS.png`` (each module's three drifts over the run). One plain run of the demo:
about 3 minutes on a quiet 2-core VM; ``--plot SEED`` redraws the figure from the JSON.
"""

from __future__ import annotations

import copy
import json
import math
import shlex
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks/results/probe_noise"
LAG, PROBE = 20, 32
#: The demo's watched modules, each read at the output of its last block.
MODULES = {"conv1..layer1.0": "layer1.0", "layer1.1..layer1.2": "layer1.2", "layer2.0": "layer2.0",
           "layer2.1": "layer2.1", "layer2.2": "layer2.2", "layer3.0": "layer3.0"}


def activations(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each watched module's output on ``x`` (eval mode, no gradients)."""
    out: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(path).register_forward_hook(
        lambda _m, _i, o, name=name: out.__setitem__(name, o.detach())) for name, path in MODULES.items()]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return out


def drifts(old: torch.nn.Module, new: torch.nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Each module's SP distance between ``old`` and ``new`` on ``x``."""
    from egeria.knowledge.similarity import sp_loss

    a, b = activations(old, x), activations(new, x)
    return {name: float(sp_loss(a[name], b[name])) for name in MODULES}


def with_buffers_of(model: torch.nn.Module, other: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with ``other``'s buffers (batch norm's running statistics): its
    drift from ``other`` is its weights' alone."""
    out = copy.deepcopy(model)
    for mine, theirs in zip(out.buffers(), other.buffers()):
        mine.copy_(theirs)
    return out


def spread(values: list[float]) -> float | None:
    """The median of |log10| of the ratios of consecutive values (None: fewer than two)."""
    steps = [abs(math.log10(b / a)) for a, b in zip(values, values[1:]) if a > 0 and b > 0]
    return statistics.median(steps) if steps else None


def plot(record: dict, target: Path) -> None:
    """Each module's three drifts per reading over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["readings"]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), sharex=True, constrained_layout=True)
    for ax, name in zip(axes.flat, MODULES):
        steps = [r["step"] for r in rows]
        ax.plot(steps, [r["batch"][name] for r in rows], marker=".", label="on the step's batch (Egeria)")
        ax.plot(steps, [r["fixed"][name] for r in rows], marker=".", label="on one fixed probe")
        ax.plot(steps, [r["weights"][name] for r in rows], marker=".",
                label="on the fixed probe, batch norm's running statistics held")
        ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        for drop in (400, 600):
            ax.axvline(drop, color="tab:red", linestyle="--", linewidth=0.8)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes[0][0].set_ylabel(f"SP drift over {record['lag']} steps")
    axes[1][0].set_ylabel(f"SP drift over {record['lag']} steps")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=9)
    fig.suptitle("The demo's task, one plain run: a reading's drift on each step's batch, on a fixed probe, "
                 "and on it with batch norm's running statistics held")
    fig.savefig(target, dpi=100)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--plot"]:
        seed = int(argv[1]) if len(argv) > 1 else 0
        plot(json.loads((OUT / f"seed{seed}.json").read_text()), OUT / f"seed{seed}.png")
        return
    import egeria.bench.demo as demo
    from egeria.bench.harness import StepResult, classification_loss, train
    from egeria.bench.machine import describe_machine

    seed = int(argv[0]) if argv else 0
    command = shlex.join([".venv/bin/python", "benchmarks/studies/probe_noise.py", *argv])
    print("command:", command)
    print("machine:", describe_machine())
    s = demo.FULL
    shared = demo.prepare(s, seed)
    model, optimizer, scheduler = demo._setup(shared.initial, s, shared.milestones)
    fixed = shared.train[0][:PROBE]
    # The demo's batches in the demo's order (``egeria.bench.demo._train``'s loader).
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*shared.train), batch_size=s.batch_size,
                                         shuffle=True, generator=torch.Generator().manual_seed(seed))
    current: dict = {}  # the batch being trained on and its learning rate

    def batches():
        for batch in loader:
            current.update(x=batch[0], lr=optimizer.param_groups[0]["lr"])
            yield batch

    rows: list[dict] = []
    previous = copy.deepcopy(model)

    def read(result: StepResult) -> None:
        nonlocal previous
        if result.step % LAG == 0:
            rows.append({"step": result.step, "lr": current["lr"],
                         "batch": drifts(previous, model, current["x"][:PROBE]),
                         "fixed": drifts(previous, model, fixed),
                         "weights": drifts(previous, with_buffers_of(model, previous), fixed)})
            previous = copy.deepcopy(model)

    train(model, optimizer, batches, classification_loss, epochs=s.epochs, scheduler=scheduler, on_step=read)
    regimes = sorted({r["lr"] for r in rows}, reverse=True)
    summary = {}
    print(f"{'module':<20} {'lr':>6}  {'median drift (batch / fixed / weights only)':>44}  "
          f"{'reading-to-reading spread (batch / fixed / weights only)':>56}")
    for name in MODULES:
        for lr in regimes:
            kept = [r for r in rows if r["lr"] == lr and r["step"] > LAG]
            batch = [r["batch"][name] for r in kept]
            fixed_ = [r["fixed"][name] for r in kept]
            weights = [r["weights"][name] for r in kept]
            entry = {"readings": len(kept), "median_batch": statistics.median(batch),
                     "median_fixed": statistics.median(fixed_), "median_weights": statistics.median(weights),
                     "spread_batch": spread(batch), "spread_fixed": spread(fixed_), "spread_weights": spread(weights)}
            summary.setdefault(name, {})[str(lr)] = entry
            print(f"{name:<20} {lr:>6g}  {entry['median_batch']:>14.3g} / {entry['median_fixed']:<10.3g} / "
                  f"{entry['median_weights']:<13.3g}  {entry['spread_batch']:>20.2f} / {entry['spread_fixed']:<6.2f} / "
                  f"{entry['spread_weights']:<20.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "machine": describe_machine(), "lag": LAG, "probe": PROBE, "summary": summary,
              "readings": rows}
    (OUT / f"seed{seed}.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, OUT / f"seed{seed}.png")


if __name__ == "__main__":
    main(sys.argv[1:])
