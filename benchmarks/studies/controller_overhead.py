"""What does a controller process cost training on a CPU-only machine?

Overhead of the asynchronous controller: training with Egeria evaluating but never
freezing, against plain PyTorch, side by side in one run (issue 4; paper 4.1.2 reports up
to 1.5%).

For ResNet-20 on Fashion-MNIST (batch 128, SGD) and the 6-block Transformer LM on Penn
Treebank (batch 32, AdamW) it trains the same model from the same seed for ``--steps``
steps under each configuration, in rounds (plain, then each Egeria configuration, then
again), and compares training wall time (the steps after ten warm-up ones, as
``egeria.bench.harness.train`` times them). Egeria runs with ``executor="process"``,
bootstrapping over at the first interval, and a window W of a million readings, so every
n-th step is a full plasticity evaluation (request, readout with the weights, reference
forward, eval-mode front forward, SP loss, int8 refresh) and nothing ever freezes. The
configurations vary n and the controller's threads (one per core of ``controller_cpus``).

Reported per configuration: median wall time over the rounds, overhead against the plain
median, evaluations sent / dropped / answered, controller seconds, and the lag in steps
between an evaluation and the step at which its answer was applied (its distribution).

Run from the repository root, on an otherwise idle machine::

    .venv/bin/python benchmarks/studies/controller_overhead.py            # full run, about 25 min
    .venv/bin/python benchmarks/studies/controller_overhead.py --quick    # smoke run, about 1 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", module=r"torch\.ao(\..*)?")

import torch  # noqa: E402

import egeria  # noqa: E402
from egeria.knowledge import policy as knowledge  # noqa: E402
from egeria.data import LMWindows, load_fashion_mnist, load_ptb  # noqa: E402
from egeria.bench.harness import classification_loss, train  # noqa: E402
from egeria.bench.machine import describe_machine  # noqa: E402
from egeria.models import TransformerLM, next_token_loss, resnet  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "controller_overhead"
WARMUP = 10


def resnet_task(steps: int):
    data = load_fashion_mnist(split="train", limit=128 * (steps + WARMUP))
    x, y = data.tensors
    batches = list(zip(x.split(128), y.split(128)))

    def build():
        torch.manual_seed(0)
        model = resnet(depth=20, in_channels=1, num_classes=10)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    return build, batches, classification_loss


def lm_task(steps: int):
    corpus = load_ptb()
    windows = LMWindows(corpus.train, 35)
    loader = torch.utils.data.DataLoader(windows, batch_size=32)
    batches = [b for _, b in zip(range(steps + WARMUP), loader)]

    def build():
        torch.manual_seed(0)
        model = TransformerLM(corpus.vocab_size, d_model=128, n_heads=4, n_layers=6, d_ff=512, max_len=64, dropout=0.1)
        return model, torch.optim.AdamW(model.parameters(), lr=5e-4)

    return build, batches, lambda model, b: next_token_loss(model(b[0]), b[1])


def run_once(task, config: egeria.EgeriaConfig | None) -> dict:
    build, batches, loss_fn = task
    model, opt = build()
    eg = None if config is None else egeria.Egeria(model, opt, config=config)
    steps = train(model, opt, lambda: batches, loss_fn, egeria=eg)
    wall = sum(r.time_s for r in steps[WARMUP:])
    stats = {} if eg is None else eg.controller_stats
    if eg is not None:
        assert eg.frozen == [], "nothing may freeze in this benchmark"
        eg.close()
    return {"wall_s": wall, "steps": len(batches) - WARMUP, "controller": stats}


def egeria_config(n: int, threads: int) -> egeria.EgeriaConfig:
    """Readings every n steps from the first check of the loss on (bootstrapping ends at
    once), none of which ever freezes anything (W = 10**6)."""
    knowledge.BOOTSTRAP_CHANGE_RATE = 1e9
    return egeria.EgeriaConfig(
        eval_interval=n, window=10**6,
        executor="process", controller_cpus=list(range(threads)),  # one controller thread per core named
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps, rounds = (20, 1) if args.quick else (args.steps, args.rounds)
    torch.set_num_threads(2)
    command = " ".join([".venv/bin/python", "benchmarks/studies/controller_overhead.py", *sys.argv[1:]])
    print(f"$ {command}")
    machine = describe_machine()
    print(f"machine: {machine['cpu']}, {machine['usable_cores']} usable cores, torch {machine['torch']}")
    plan = {
        "resnet20-fmnist": (resnet_task, [(10, 1), (50, 1), (10, 2)]),
        "transformer-ptb": (lm_task, [(10, 1), (50, 1)]),
    }
    out = {"command": command, "machine": machine, "steps": steps, "rounds": rounds, "tasks": {}}
    for name, (make, configs) in plan.items():
        task = make(steps)
        runs: dict[str, list[dict]] = {"plain": []}
        runs.update({f"n={n} threads={t}": [] for n, t in configs})
        for r in range(rounds):
            runs["plain"].append(run_once(task, None))
            for n, t in configs:
                runs[f"n={n} threads={t}"].append(run_once(task, egeria_config(n, t)))
            print(f"{name} round {r + 1}: " + ", ".join(f"{k} {v[-1]['wall_s']:.1f}s" for k, v in runs.items()))
        plain = statistics.median(r["wall_s"] for r in runs["plain"])
        summary = {}
        for key, rs in runs.items():
            wall = statistics.median(r["wall_s"] for r in rs)
            entry = {"median_wall_s": wall, "walls_s": [r["wall_s"] for r in rs], "overhead": wall / plain - 1}
            if key != "plain":
                stats = [r["controller"] for r in rs]
                lags = [lag for s in stats for lag in s["lags"]]
                entry.update(
                    {
                        "sent": sum(s["sent"] for s in stats),
                        "dropped": sum(s["dropped"] for s in stats),
                        "answered": sum(s["answered"] for s in stats),
                        "controller_s_per_eval": sum(s["controller_seconds"] for s in stats) / max(1, sum(s["answered"] for s in stats)),
                        "lags": lags,
                    }
                )
            summary[key] = entry
        spread = (max(r["wall_s"] for r in runs["plain"]) - min(r["wall_s"] for r in runs["plain"])) / plain
        out["tasks"][name] = {"runs": summary, "plain_spread": spread}
        print(f"\n{name}: {steps} steps, median of {rounds} rounds; plain run-to-run spread {spread:.1%}")
        print(f"{'config':>18} {'wall s':>8} {'overhead':>9} {'sent':>5} {'drop':>5} {'ctl s/eval':>10} {'lag p50/max':>12}")
        for key, e in summary.items():
            if key == "plain":
                print(f"{key:>18} {e['median_wall_s']:8.1f} {'':>9}")
                continue
            lags = sorted(e["lags"]) or [0]
            print(
                f"{key:>18} {e['median_wall_s']:8.1f} {e['overhead']:+9.1%} {e['sent']:5d} {e['dropped']:5d} "
                f"{e['controller_s_per_eval']:10.3f} {lags[len(lags) // 2]:>5}/{lags[-1]:<6}"
            )
    if args.quick:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "controller_overhead.json").write_text(json.dumps(out, indent=1))
    plot(out, RESULTS / "controller_overhead.png")
    print(f"\nwrote {RESULTS}/controller_overhead.json and .png")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = out["tasks"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, task in tasks.items():
        keys = [k for k in task["runs"] if k != "plain"]
        axes[0].bar([f"{name}\n{k}" for k in keys], [100 * task["runs"][k]["overhead"] for k in keys])
        lags = [lag for k in keys for lag in task["runs"][k]["lags"]]
        if lags:
            axes[1].hist(lags, bins=range(0, max(lags) + 2), alpha=0.6, label=name)
    axes[0].axhline(1.5, color="k", ls="--", lw=1, label="1.5% target")
    axes[0].set_ylabel("wall-time overhead vs plain (%)")
    axes[0].tick_params(axis="x", labelsize=7)
    axes[0].legend()
    axes[1].set_xlabel("steps from evaluation to its answer being applied")
    axes[1].set_ylabel("evaluations")
    axes[1].legend()
    fig.suptitle("Egeria controller in its own process, evaluating but never freezing")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
