"""Under DDP, do frozen parameters leave the all-reduce, and what does a step cost?

Bytes all-reduced per step and step time, plain DDP against Egeria under DDP: 2 ranks
over gloo on this machine's CPU, ResNet-20 on Fashion-MNIST (batch 64 per rank).

Egeria's freezing policy here is the static one (the first K layer modules freeze at a
fixed step) so that both arms freeze the same modules at the same step whatever the
machine: the point is what a freeze does to DDP's communication, not when Egeria's rule
freezes. Each arm trains the same batches from the same weights; a DDP communication hook
counts the bytes of every bucket all-reduced.

    .venv/bin/python benchmarks/ddp_allreduce.py [--steps 60] [--freeze-at 20] [--frozen 6]

Writes ``benchmarks/results/ddp/allreduce.json`` and prints the command, the machine and
the figures side by side. On one 2-core machine the two ranks share the cores, so the
step times say little about a GPU cluster; the bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[1]


def _worker(rank: int, world: int, init: str, arm: str, args: dict, out: str) -> None:
    import egeria
    from egeria.data import load_fashion_mnist
    from egeria.models import resnet

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = resnet(depth=20, in_channels=1, num_classes=10)
    ddp = DistributedDataParallel(model)
    sent: list[int] = []

    def counting(state, bucket):
        buffer = bucket.buffer()
        sent.append(buffer.numel() * buffer.element_size())
        work = dist.all_reduce(buffer.div_(world), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eg = None
    if arm == "egeria":
        config = egeria.EgeriaConfig(policy="static", policy_options={"count": args["frozen"], "at_step": args["freeze_at"]})
        eg = egeria.Egeria(ddp, opt, config=config)
    data = load_fashion_mnist(split="train", limit=64 * world * args["steps"])
    x_all, y_all = data.tensors
    rows = []
    for step in range(args["steps"]):
        lo = (step * world + rank) * 64
        x, y = x_all[lo : lo + 64], y_all[lo : lo + 64]
        before = len(sent)
        started = time.perf_counter()
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if eg is not None:
            eg.step(loss)
        rows.append({"step": step + 1, "bytes": sum(sent[before:]), "time_s": time.perf_counter() - started})
    frozen = list(eg.frozen) if eg is not None else []
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if eg is not None:
        eg.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "frozen": frozen, "trainable_after": trainable}))
    dist.destroy_process_group()


def _arm(arm: str, args: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank0.json"
        mp.spawn(_worker, args=(2, f"{tmp}/init", arm, args, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--freeze-at", type=int, default=20)
    parser.add_argument("--frozen", type=int, default=6, help="leading layer modules the static policy freezes")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/ddp/allreduce.json"))
    args = parser.parse_args()
    from egeria.bench.machine import describe_machine

    command = " ".join([".venv/bin/python", "benchmarks/ddp_allreduce.py", *sys.argv[1:]])
    machine = describe_machine()
    print(command)
    print(machine)
    settings = {"steps": args.steps, "freeze_at": args.freeze_at, "frozen": args.frozen}
    arms = {arm: _arm(arm, settings) for arm in ("plain", "egeria")}
    after = lambda rows: [r for r in rows if r["step"] > args.freeze_at + 1]  # noqa: E731 - warm steps after the freeze
    summary = {}
    for arm, result in arms.items():
        rows = after(result["rows"])
        summary[arm] = {
            "bytes_per_step_after_freeze": statistics.mean(r["bytes"] for r in rows),
            "median_step_s_after_freeze": statistics.median(r["time_s"] for r in rows),
            "frozen": result["frozen"],
        }
    ratio = summary["egeria"]["bytes_per_step_after_freeze"] / summary["plain"]["bytes_per_step_after_freeze"]
    speed = summary["plain"]["median_step_s_after_freeze"] / summary["egeria"]["median_step_s_after_freeze"]
    print(f"{'arm':8} {'bytes/step':>12} {'median step (s)':>16}  frozen")
    for arm, s in summary.items():
        print(f"{arm:8} {s['bytes_per_step_after_freeze']:>12.0f} {s['median_step_s_after_freeze']:>16.3f}  {s['frozen']}")
    print(f"after the freeze: Egeria all-reduces {ratio:.1%} of plain DDP's bytes; step time ratio plain/Egeria {speed:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"command": command, "machine": machine, "settings": settings, "summary": summary,
                    "bytes_ratio": ratio, "step_speedup": speed, "arms": arms}, indent=1)
    )


if __name__ == "__main__":
    main()
