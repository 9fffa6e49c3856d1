"""How much faster is a step when the frozen prefix is served from the activation cache?

Iteration time with the frozen prefix served from the activation cache, against
computing it, side by side in one run (issue 5; paper 4.3 and 6.3 "FP caching benefits").

For ResNet-20 on Fashion-MNIST (batch 128) and the 6-block Transformer LM on Penn
Treebank (batch 32) it freezes the first k layer modules (k = 1, 2, ...) with the
``static`` policy at the first step and trains for ``--epochs`` epochs over a fixed subset:
the first two epochs record the cache (the freeze comes after the first step), the last one is timed, with the cache off and on
(in rounds, alternating). Reported per k: milliseconds per iteration off and on, the
speed-up, what the cache chose (serve, or compute when reading is not cheaper), its tier,
bytes per sample against the raw input's bytes (the model's input tensor), and the
prefetch hit rate (batches whose cached output was read ahead, of those served).

With ``--precision`` it also trains ResNet-20 for a few epochs with two modules frozen
from epoch 1 and the cache storing exact (fp32) or bf16 activations, and reports the test
accuracy of each: the effect of the opt-in lower storage precision.

Run from the repository root, on an otherwise idle machine::

    .venv/bin/python benchmarks/cache_speed.py --precision   # about 15 min
    .venv/bin/python benchmarks/cache_speed.py --quick       # smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", module=r"torch\.ao(\..*)?")

import torch  # noqa: E402

import egeria  # noqa: E402
from egeria.data import LMWindows, load_fashion_mnist, load_ptb  # noqa: E402
from egeria.bench.harness import classification_loss, train  # noqa: E402
from egeria.bench.machine import describe_machine  # noqa: E402
from egeria.models import TransformerLM, next_token_loss, resnet  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cache"


def resnet_setup(samples: int):
    data = load_fashion_mnist(split="train", limit=samples)

    def build():
        torch.manual_seed(0)
        model = resnet(depth=20, in_channels=1, num_classes=10)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    return data, 128, build, classification_loss


def lm_setup(samples: int):
    corpus = load_ptb()
    data = torch.utils.data.Subset(LMWindows(corpus.train, 35), range(samples))

    def build():
        torch.manual_seed(0)
        model = TransformerLM(corpus.vocab_size, d_model=128, n_heads=4, n_layers=6, d_ff=512, max_len=64, dropout=0.1)
        return model, torch.optim.AdamW(model.parameters(), lr=5e-4)

    return data, 32, build, lambda m, b: next_token_loss(m(b[0]), b[1])


def timed_run(setup, k: int, cache: bool, epochs: int) -> dict:
    data, batch, build, loss_fn = setup
    model, opt = build()
    config = egeria.EgeriaConfig(policy="static", policy_options={"count": k, "at_step": 1})
    eg = egeria.Egeria(model, opt, config=config)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))
    if cache:
        loader = eg.cache_loader(loader)
    steps = train(model, opt, lambda: loader, loss_fn, epochs=epochs, egeria=eg)
    # Epochs 1 and 2 record (the freeze comes after step 1); the last is timed, loading included.
    times = [r.data_s + r.time_s for r in steps if r.epoch == epochs]
    stats = eg.cache_stats
    frozen = list(eg.frozen)
    eg.close()
    x = data[0][0]
    return {"ms_per_iter": 1e3 * statistics.median(times), "frozen": frozen, "stats": stats, "input_bytes": x.numel() * x.element_size(), "samples": len(data)}


def precision_run(storage, epochs: int, samples: int) -> dict:
    data = load_fashion_mnist(split="train", limit=samples)
    test = load_fashion_mnist(split="test", limit=2000)
    torch.manual_seed(0)
    model = resnet(depth=20, in_channels=1, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    steps = len(data) // 128 + (len(data) % 128 > 0)
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="static", policy_options={"count": 2, "at_step": steps}))
    loader = eg.cache_loader(
        torch.utils.data.DataLoader(data, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(1)),
        storage_dtype=storage,
    )
    train(model, opt, lambda: loader, classification_loss, epochs=epochs, egeria=eg)
    stats = eg.cache_stats
    eg.close()
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return {"storage": "exact" if storage is None else str(storage).removeprefix("torch."), "accuracy": accuracy, "served": stats["served"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run, at least 3 (the last one is timed)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--precision", action="store_true", help="also the storage-precision accuracy runs")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    command = " ".join([".venv/bin/python", "benchmarks/cache_speed.py", *sys.argv[1:]])
    print(f"$ {command}")
    machine = describe_machine()
    print(f"machine: {machine['cpu']}, {machine['usable_cores']} usable cores, torch {machine['torch']}")
    sizes = {"resnet20-fmnist": (resnet_setup, 1280 if args.quick else 2560), "transformer-ptb": (lm_setup, 320 if args.quick else 640)}
    epochs = max(3, args.epochs)
    out = {"command": command, "machine": machine, "epochs": epochs, "tasks": {}, "precision": []}
    for name, (make, samples) in sizes.items():
        setup = make(samples)
        model, _ = setup[2]()
        x = setup[0][0][0]
        partition = egeria.partition_model(model, (x.unsqueeze(0) if x.dim() in (1, 3) else x,))
        freezable, names = partition.freezable, partition.names
        ks = [1, 2] if args.quick else list(range(1, freezable + 1))
        rows = []
        print(f"\n{name}: {samples} samples, modules {names}")
        print(f"{'k':>2} {'boundary':>22} {'off ms':>8} {'on ms':>8} {'speed-up':>8} {'choice':>8} {'tier':>6} {'B/sample':>9} {'x input':>7} {'prefetch':>8}")
        for k in ks:
            offs, ons = [], []
            for _ in range(args.rounds):
                offs.append(timed_run(setup, k, False, epochs))
                ons.append(timed_run(setup, k, True, epochs))
            off = statistics.median(r["ms_per_iter"] for r in offs)
            on = statistics.median(r["ms_per_iter"] for r in ons)
            stats = ons[-1]["stats"]
            level = next(iter(stats["levels"].values()), {})
            per_sample = level.get("bytes", 0) / ons[-1]["samples"]
            choice = "serve" if level.get("serving") else ("compute" if level.get("serving") is False else (level.get("off") or "none")[:8])
            row = {
                "k": k, "boundary": names[k - 1], "off_ms": off, "on_ms": on, "speedup": off / on, "choice": choice,
                "tier": level.get("tier"), "bytes_per_sample": per_sample, "input_bytes": ons[-1]["input_bytes"],
                "prefetch_hit_rate": stats.get("prefetch_hit_rate"), "stats": stats,
            }
            rows.append(row)
            hit = "-" if row["prefetch_hit_rate"] is None else f"{row['prefetch_hit_rate']:.0%}"
            print(
                f"{k:>2} {names[k - 1][-22:]:>22} {off:8.1f} {on:8.1f} {off / on:8.2f} {choice:>8} {str(row['tier']):>6} "
                f"{per_sample:9.0f} {per_sample / row['input_bytes']:7.1f} {hit:>8}"
            )
        out["tasks"][name] = {"samples": samples, "modules": names, "rows": rows}
    if args.precision and not args.quick:
        print("\nstorage precision: ResNet-20, 6,400 images, 6 epochs, 2 modules frozen from epoch 1, 2,000 test images")
        for storage in (None, torch.bfloat16):
            result = precision_run(storage, 6, 6400)
            out["precision"].append(result)
            print(f"  {result['storage']:>8}: accuracy {result['accuracy']:.2%} ({result['served']} batches served)")
    if args.quick:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cache_speed.json").write_text(json.dumps(out, indent=1))
    plot(out, RESULTS / "cache_speed.png")
    print(f"\nwrote {RESULTS}/cache_speed.json and .png")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = out["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4))
    for ax, (name, task) in zip(axes, tasks.items()):
        ks = [r["k"] for r in task["rows"]]
        ax.plot(ks, [r["off_ms"] for r in task["rows"]], "o-", label="cache off (prefix computed)")
        ax.plot(ks, [r["on_ms"] for r in task["rows"]], "s-", label="cache on")
        ax.set_xlabel("frozen layer modules k")
        ax.set_ylabel("ms per iteration")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
