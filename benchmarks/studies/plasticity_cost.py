"""What does one plasticity reading cost against one training step, per precision?

Cost of one plasticity evaluation against one training step, per reference precision.

One plasticity evaluation (paper 4.2.1) is a forward pass of the CPU reference model up to
the watched layer module plus the SP loss between that activation and the training
model's. With the default ``EgeriaConfig.activation_mode="eval"`` the controller computes
the training activation with one more forward of the model's front (its own fp32 CPU copy,
loaded with the step's weights), up to the watched module's output block, in eval mode
under ``torch.no_grad()`` (``run_until``), so a whole reading is front forward + reference
forward + SP loss + refresh. (When this script was written that front forward ran in the
training process on its threads; the timing here is of the same computation.) This script times these with the library's own pieces (``run_until``,
``ReferenceModel``, ``sp_loss``, the partition ``egeria.partition_model`` finds) for the int8, bf16 and
fp32 references, side by side in one run, and sets them against one full training step
(forward, backward, optimizer step on 2 threads), for two models:

- ResNet-20 on Fashion-MNIST (batch 128 of real images, SGD with momentum);
- the 6-layer Transformer LM on Penn Treebank windows of 35 tokens (batch 32, AdamW).

For each model it reports, for layer modules 0, the middle one and the last freezable one:
the training model's eval-mode front forward (2 threads), the reference forward, the SP
loss, their sum, the fp32 reference forward to the same module, fp32 time / precision
time (the paper's Table 2 "CPU inference speed"), the training step, evaluation / training
step and a whole reading / training step; with 1 reference thread (the library's default)
and with 2. It also times ``ReferenceModel.refresh`` (building the reference's blocks) per
precision, and gives each precision's error floor: the SP loss of the reference's
activation against the training model's fp32 activation in train mode (as the engine
captured it before ``activation_mode="eval"``) and in eval mode (what the engine compares
against now), and against the fp32 reference (the quantization error alone), all on the
same weights.

Timings are medians of repeated ``time.perf_counter`` readings after warm-up; the three
precisions are timed round-robin, so drift of the machine hits them alike.

Run from the repository root::

    .venv/bin/python benchmarks/studies/plasticity_cost.py            # full run, a few minutes
    .venv/bin/python benchmarks/studies/plasticity_cost.py --quick    # smoke run, under a minute
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

# torch.ao.quantization is deprecated in recent PyTorch; its warnings are noise here.
warnings.filterwarnings("ignore", message=r".*torch\.ao\.quantization.*")
warnings.filterwarnings("ignore", module=r"torch\.ao(\..*)?")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import egeria  # noqa: E402
from egeria.data import LMWindows, load_fashion_mnist, load_ptb  # noqa: E402
from egeria.bench.harness import LossFn, classification_loss, forward_backward  # noqa: E402
from egeria.bench.machine import describe_machine  # noqa: E402
from egeria.models import TransformerLM, next_token_loss, resnet  # noqa: E402
from egeria.partition import Partition, first_tensor  # noqa: E402
from egeria.knowledge.reference import Batch, ReferenceModel  # noqa: E402
from egeria.knowledge.similarity import sp_loss  # noqa: E402
from egeria.knowledge.truncated import run_until  # noqa: E402

PRECISIONS = ("fp32", "bf16", "int8")
REF_THREADS = (1, 2)
TRAIN_THREADS = 2
RESULTS = Path(__file__).resolve().parents[1] / "results" / "plasticity_cost.json"


# -- timing --------------------------------------------------------------------------


def median_s(fn: Callable[[], Any], reps: int, warmup: int) -> float:
    """Median wall time of ``fn`` in seconds over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def round_robin_s(fns: dict[str, Callable[[], Any]], reps: int, warmup: int) -> dict[str, float]:
    """Median wall time of each function, calling them in turn so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in samples.items()}


class threads:
    """Sets torch's intra-op thread count inside a ``with`` block."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.previous)


# -- workloads -----------------------------------------------------------------------


class Workload:
    """A model, its optimizer, its loss and a few real batches."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: LossFn,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        description: str,
    ) -> None:
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.batches = batches
        self.description = description
        self._next = 0

    def train_step(self) -> None:
        batch = self.batches[self._next % len(self.batches)]
        self._next += 1
        self.model.train()
        forward_backward(self.model, self.optimizer, batch, self.loss)
        self.optimizer.step()


def resnet_workload(batch_size: int, num_batches: int) -> Workload:
    data = load_fashion_mnist(limit=batch_size * num_batches)
    images, labels = data.tensors
    batches = [
        (images[i * batch_size : (i + 1) * batch_size], labels[i * batch_size : (i + 1) * batch_size])
        for i in range(num_batches)
    ]
    torch.manual_seed(0)
    model = resnet(depth=20, in_channels=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return Workload(
        "resnet20-fmnist", model, opt, classification_loss, batches,
        f"ResNet-20, Fashion-MNIST 1x28x28, batch {batch_size}, SGD momentum 0.9",
    )


def lm_workload(batch_size: int, num_batches: int, seq_len: int = 35) -> Workload:
    corpus = load_ptb()
    windows = LMWindows(corpus.train, seq_len)
    batches = []
    for b in range(num_batches):
        pairs = [windows[b * batch_size + i] for i in range(batch_size)]
        batches.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=corpus.vocab_size, d_model=128, n_layers=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    return Workload(
        "transformer-lm-ptb", model, opt, lambda m, b: next_token_loss(m(b[0]), b[1]), batches,
        f"TransformerLM d_model 128, 6 layers, vocab {corpus.vocab_size}, PTB windows of {seq_len}, "
        f"batch {batch_size}, AdamW",
    )


def partition_of(work: Workload) -> Partition:
    """The layer modules Egeria finds for the model (its own tracing and grouping)."""
    return egeria.partition_model(work.model, (work.batches[0][0],))


@torch.no_grad()
def train_activations(model: nn.Module, partition: Partition, x: torch.Tensor, indices: list[int]) -> dict[int, torch.Tensor]:
    """The training model's activations (train mode, as the engine captures them) at the
    output of each layer module in ``indices``, from one forward pass."""
    named = dict(model.named_modules())
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for j in indices:
        def hook(module: nn.Module, inputs: tuple, output: Any, j: int = j) -> None:
            seen.setdefault(j, first_tensor(output).detach().float().clone())

        handles.append(named[partition.modules[j].output_block].register_forward_hook(hook))
    model.train()
    try:
        torch.manual_seed(1)
        model(x)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def front_forward(model: nn.Module, block: str, x: torch.Tensor) -> torch.Tensor:
    """The training model's output of ``block`` for ``x`` as a reading takes it with
    ``activation_mode="eval"`` (``Controller._front`` does the same): eval mode, no gradients,
    the forward stopped at ``block``, a CPU copy; every module's mode restored after."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            tensor = first_tensor(run_until(model, block, (x,), {}))
    finally:
        for m, flag in flags:
            m.training = flag
    return tensor.detach().to("cpu", copy=True)


# -- the measurement -----------------------------------------------------------------


def measure(work: Workload, reps: int, warmup: int, refresh_reps: int) -> dict:
    print(f"\n== {work.description}", flush=True)
    partition = partition_of(work)
    last = len(partition) - 2
    indices = sorted({0, last // 2, last})
    print(f"   {len(partition)} layer modules: {', '.join(partition.names)}; timing modules {indices}", flush=True)

    # One training step on 2 threads; its warm-up also moves BatchNorm statistics off
    # their initial values, so the error floors below are not a train/eval artefact of init.
    with threads(TRAIN_THREADS):
        train_s = median_s(work.train_step, reps, max(warmup, 5))
    print(f"   training step ({TRAIN_THREADS} threads): {train_s * 1e3:.1f} ms", flush=True)

    calibration: Batch = ((work.batches[0][0],), {})
    batch: Batch = ((work.batches[1][0],), {})
    with threads(TRAIN_THREADS):
        trained = train_activations(work.model, partition, work.batches[1][0], indices)

    refresh: list[dict] = []
    refs: dict[tuple[str, int], ReferenceModel] = {}
    for t in REF_THREADS:
        for precision in PRECISIONS:
            start = time.perf_counter()
            ref = ReferenceModel(work.model, partition, precision, threads=t)
            init_s = time.perf_counter() - start
            samples = []
            for _ in range(refresh_reps):
                start = time.perf_counter()
                ref.refresh(work.model.state_dict(), 0, last, calibration)
                samples.append(time.perf_counter() - start)
            kinds: dict[str, int] = {}
            for kind in ref.kinds.values():
                kinds[kind] = kinds.get(kind, 0) + 1
            refs[(precision, t)] = ref
            refresh.append({
                "precision": precision, "ref_threads": t, "init_s": init_s,
                "refresh_s": statistics.median(samples), "refresh_first_s": samples[0],
                "block_kinds": kinds,
            })

    # The refresh the engine runs after every reading (reference_refresh=1): the watched
    # module's blocks only, the modules in front of it being frozen and already converted.
    watched_refresh: dict[tuple[str, int, int], float] = {}
    for t in REF_THREADS:
        for precision in PRECISIONS:
            ref = ReferenceModel(work.model, partition, precision, threads=t)
            for j in indices:
                ref.refresh(work.model.state_dict(), j, j, calibration)  # converts modules up to j once
                watched_refresh[(precision, t, j)] = median_s(
                    lambda: ref.refresh(work.model.state_dict(), j, j, calibration), refresh_reps, 0
                )

    # The training model's eval-mode front forward up to each watched module, on the
    # training threads (the engine runs it in the training process), and its activation:
    # what the engine compares the reference against with activation_mode="eval".
    front_s: dict[int, float] = {}
    evaled: dict[int, torch.Tensor] = {}
    with threads(TRAIN_THREADS):
        for j in indices:
            block = partition.modules[j].output_block
            front_s[j] = median_s(lambda: front_forward(work.model, block, batch[0][0]), reps, warmup)
            evaled[j] = front_forward(work.model, block, batch[0][0]).float()
    assert work.model.training
    print("   front forwards: " + ", ".join(f"module {j} {front_s[j] * 1e3:.2f} ms" for j in indices), flush=True)

    rows: list[dict] = []
    for t in REF_THREADS:
        for j in indices:
            forwards = {p: (lambda p=p: refs[(p, t)].activation(batch, j)) for p in PRECISIONS}
            fwd = round_robin_s(forwards, reps, warmup)
            acts = {p: refs[(p, t)].activation(batch, j) for p in PRECISIONS}
            with threads(t):
                sps = round_robin_s({p: (lambda p=p: sp_loss(evaled[j], acts[p])) for p in PRECISIONS}, reps, warmup)
            for p in PRECISIONS:
                evaluation = fwd[p] + sps[p]
                reading = front_s[j] + evaluation + watched_refresh[(p, t, j)]
                rows.append({
                    "precision": p, "ref_threads": t, "module_index": j,
                    "module": partition.modules[j].name,
                    "activation_shape": list(acts[p].shape),
                    "front_forward_s": front_s[j],
                    "ref_forward_s": fwd[p], "sp_loss_s": sps[p], "evaluation_s": evaluation,
                    "fp32_forward_s": fwd["fp32"], "speed_vs_fp32": fwd["fp32"] / fwd[p],
                    "train_step_s": train_s, "eval_over_train": evaluation / train_s,
                    "refresh_watched_s": watched_refresh[(p, t, j)],
                    "reading_s": reading,
                    "reading_over_train": reading / train_s,
                    "floor_vs_train": float(sp_loss(trained[j], acts[p])),
                    "floor_vs_eval_train": float(sp_loss(evaled[j], acts[p])),
                    "floor_vs_fp32_ref": float(sp_loss(acts["fp32"], acts[p])),
                })
            print(f"   timed threads={t} module {j}", flush=True)
    return {
        "model": work.name, "description": work.description,
        "modules": partition.names, "timed_modules": indices,
        "train_step_s": train_s, "train_threads": TRAIN_THREADS,
        "front_forward_s": {str(j): front_s[j] for j in indices},
        "rows": rows, "refresh": refresh,
    }


class CpuMeter:
    """How busy the machine was with *other* processes while this one ran: contention on
    a small machine slows multi-threaded timings far more than single-threaded ones."""

    def __init__(self) -> None:
        self._start = (time.perf_counter(), self._busy_s(), self._own_s())

    @staticmethod
    def _busy_s() -> float:
        try:
            with open("/proc/stat") as fh:
                fields = [int(v) for v in fh.readline().split()[1:]]
        except OSError:
            return float("nan")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        times = os.times()
        return times.user + times.system

    def others_cores(self) -> float:
        """Average number of cores other processes kept busy since construction."""
        wall, busy, own = self._start
        return ((self._busy_s() - busy) - (self._own_s() - own)) / (time.perf_counter() - wall)


# -- reporting -----------------------------------------------------------------------


def table(result: dict) -> str:
    head = (
        f"{'prec':<5} {'thr':>3} {'module':<18} {'front':>6} {'ref fwd':>7} {'SP':>6} {'eval':>7} {'fp32 fwd':>8} "
        f"{'speed':>6} {'train':>7} {'eval/trn':>8} {'refresh':>7} {'rdg/trn':>7} "
        f"{'flr/trn-tr':>10} {'flr/trn-ev':>10} {'floor/fp32':>10}"
    )
    lines = [
        f"{result['description']}",
        "times in ms; front = training model's eval-mode forward up to the module (no_grad, "
        f"{result['train_threads']} threads); speed = fp32 fwd / ref fwd; eval = ref fwd + SP;",
        "refresh = the watched module's rebuild after each reading; rdg/trn = (front + eval + refresh) "
        "/ train step;",
        "floors = SP loss of the reference vs the fp32 training activation in train mode (flr/trn-tr), "
        "in eval mode (flr/trn-ev, what the engine compares against), and vs the fp32 reference",
        head,
        "-" * len(head),
    ]
    rows = sorted(result["rows"], key=lambda r: (r["ref_threads"], r["module_index"], PRECISIONS.index(r["precision"])))
    for r in rows:
        lines.append(
            f"{r['precision']:<5} {r['ref_threads']:>3} {str(r['module_index']) + ' ' + r['module']:<18.18} "
            f"{r['front_forward_s'] * 1e3:>6.2f} {r['ref_forward_s'] * 1e3:>7.2f} {r['sp_loss_s'] * 1e3:>6.2f} {r['evaluation_s'] * 1e3:>7.2f} "
            f"{r['fp32_forward_s'] * 1e3:>8.2f} {r['speed_vs_fp32']:>5.2f}x {r['train_step_s'] * 1e3:>7.1f} "
            f"{r['eval_over_train']:>8.3f} {r['refresh_watched_s'] * 1e3:>7.1f} {r['reading_over_train']:>7.3f} "
            f"{r['floor_vs_train']:>10.2e} {r['floor_vs_eval_train']:>10.2e} {r['floor_vs_fp32_ref']:>10.2e}"
        )
    lines.append("")
    lines.append(
        f"full refresh, modules 0..{result['timed_modules'][-1]} (first build, or after an unfreeze), "
        "median; first call; ReferenceModel constructor:"
    )
    for r in result["refresh"]:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["block_kinds"].items()))
        lines.append(
            f"  {r['precision']:<5} thr {r['ref_threads']}: refresh {r['refresh_s'] * 1e3:8.1f} ms "
            f"(first {r['refresh_first_s'] * 1e3:8.1f}; init {r['init_s'] * 1e3:6.1f})  blocks: {kinds}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per measurement")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    parser.add_argument("--refresh-reps", type=int, default=3, help="timed refreshes per precision")
    parser.add_argument("--quick", action="store_true", help="few repetitions, a smoke run")
    parser.add_argument("--models", nargs="+", default=["resnet", "lm"], choices=["resnet", "lm"])
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the JSON results")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.warmup, args.refresh_reps = 3, 1, 1

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(TRAIN_THREADS)
    command = " ".join([os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable, *sys.argv])
    info = describe_machine()
    print(f"command: {command}")
    print(
        f"machine: {info['platform']}; CPU {info['cpu']} ({', '.join(info['cpu_flags'])}); "
        f"{info['cores']} cores ({info['usable_cores']} usable); torch {info['torch']}; "
        f"quantized engines {info['quantized_engines']}"
    )
    started = time.perf_counter()
    results = []
    for name in args.models:
        meter = CpuMeter()
        work = resnet_workload(128, 8) if name == "resnet" else lm_workload(32, 8)
        result = measure(work, args.reps, args.warmup, args.refresh_reps)
        result["other_processes_cores"] = meter.others_cores()
        results.append(result)
    elapsed = time.perf_counter() - started
    for result in results:
        print()
        print(table(result))
        busy = result["other_processes_cores"]
        print(f"other processes kept {busy:.2f} of {info['usable_cores']} cores busy during this model's run")
        if info["usable_cores"] and busy > 0.25:
            print("  (contended machine: 2-thread timings are unreliable, 1-thread ones less affected)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "plasticity_cost", "command": command, "machine": info,
        "settings": {"reps": args.reps, "warmup": args.warmup, "refresh_reps": args.refresh_reps,
                     "train_threads": TRAIN_THREADS, "ref_threads": list(REF_THREADS)},
        "elapsed_s": elapsed, "results": results,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.out} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
