"""Egeria under ``torchrun`` with ``DistributedDataParallel``, on its defaults: a small ResNet
on Fashion-MNIST, each rank on its share of the data, SGD with a linear warm-up then a
cosine decay; rank 0 decides, every rank freezes the same modules at the same step, and the
DDP wrapper is rebuilt so that frozen parameters leave the all-reduce.

Run (CPU, 2 processes over gloo; from the clone after ``pip install -e .``)::

    torchrun --nproc_per_node 2 examples/ddp.py            # 12,800 images, 8 epochs: minutes
    torchrun --nproc_per_node 2 examples/ddp.py --quick    # seconds (what CI runs)
    python examples/ddp.py --quick                         # starts the 2 CPU ranks itself

On GPUs, use the ``nccl`` backend and move the model to ``cuda:LOCAL_RANK``; Egeria's own
collectives use a CPU gloo group of their own either way. The Fashion-MNIST files are read
from ``/usr/share/datasets/fashion-mnist`` or ``--data``; without them the example trains on
random images and says so. Whether and when a module freezes rests on the run's readings: at
the defaults a module still learning freezes late in the schedule, and a short run may end
with nothing frozen. At the end every rank checks that its weights equal rank 0's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import egeria
from egeria.data.fashion_mnist import FASHION_MNIST_ROOT
from egeria.models import resnet


def dataset(root: str, size: int) -> tuple[TensorDataset, bool]:
    """(training data, real): Fashion-MNIST where its files are, else random images."""
    if any((Path(root) / f"train-labels-idx1-ubyte{ext}").exists() for ext in (".gz", "")):
        from egeria.data import load_fashion_mnist

        return load_fashion_mnist(root, "train", limit=size), True
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)), False


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    size, epochs = (2_048, 3) if args.quick else (12_800, 8)
    data, real = dataset(args.data, size)
    if rank == 0 and not real:
        print(f"no Fashion-MNIST in {args.data}: training on random images (nothing to learn)", flush=True)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=64, sampler=sampler)  # 64 per rank, 128 a step

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(resnet(depth=8, in_channels=1, num_classes=10, width=16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    total_steps = len(loader) * epochs
    warmup = max(1, total_steps // 10)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - warmup),
    ], milestones=[warmup])

    # On every rank, over the DDP model, on the defaults.
    eg = egeria.Egeria(model, optimizer, lr_scheduler=scheduler, total_steps=total_steps)
    if rank == 0:
        print(f"{world} ranks, {len(data)} images, {epochs} epochs, {total_steps} optimizer steps, "
              f"warm-up then cosine", flush=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            for decision in eg.step(loss):  # the same decisions on every rank
                if rank == 0:
                    print(f"  step {decision.step}: {decision.action} {', '.join(decision.modules)} "
                          f"({decision.reason})", flush=True)
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.3f}, {len(eg.frozen)} of {len(eg.modules)} "
                  f"layer modules frozen", flush=True)

    # The replicas stayed identical: each rank's weights against rank 0's.
    flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    same = torch.tensor(int(torch.equal(flat, reference)))
    dist.all_reduce(same)
    if rank == 0:
        print(f"Egeria counted {eg.steps} optimizer steps of {total_steps}; frozen at the end: "
              f"{eg.frozen or 'none'}; weights identical on {int(same)} of {world} ranks", flush=True)
    eg.close()


def _spawned(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        train(args)
        dist.barrier()  # no rank tears down its connections while another still uses them
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a run of seconds (what CI runs)")
    parser.add_argument("--data", default=str(FASHION_MNIST_ROOT), help="folder of the Fashion-MNIST IDX files")
    arguments = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            train(arguments)
            dist.barrier()  # no rank tears down its connections while another still uses them
        finally:
            dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(2, f"{tmp}/init", arguments), nprocs=2, join=True)
