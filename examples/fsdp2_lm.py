"""Egeria over FSDP2 in a plain loop, on its defaults: a small Transformer LM sharded with
``fully_shard``, AdamW with a linear warm-up then a cosine decay, Egeria's own rule deciding
what freezes, a checkpoint through ``torch.distributed.checkpoint`` three quarters of the way
and a resume from it.

Run (needs torch >= 2.6; CPU, 2 processes over gloo; from the clone after ``pip install -e .``)::

    torchrun --nproc_per_node 2 examples/fsdp2_lm.py --out /tmp/egeria-fsdp2
    python examples/fsdp2_lm.py --out /tmp/egeria-fsdp2              # starts the 2 CPU ranks itself
    python examples/fsdp2_lm.py --quick --out /tmp/egeria-fsdp2      # seconds (what CI runs)

Egeria's rule reads whole weights: at the step boundaries where rank 0 reads, every rank
gathers them, so the readings and decisions are those of the same run under DDP. AutoFreeze
and SmartFRZ, which read gradients and weights on rank 0 alone, are refused under FSDP2; the
schedules (``linear``, ``static``, ``freezeout``) work too. Frozen parameters leave the
reduce-scatter, the frozen prefix runs without autograd, and ``eg.dcp_state()`` saves the
model, the optimizer and Egeria together (a resume keeps the frozen modules' optimizer
state). The tokens are random, so the loss falls only to the entropy of the vocabulary;
whether a module freezes in a run this short rests on its readings and may not happen.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import egeria
from egeria.models import TransformerLM
from egeria.models.transformer_lm import next_token_loss

VOCAB, LENGTH, BATCH = 200, 32, 8


def build(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, egeria.Egeria]:
    """The model sharded per layer and at the root, its optimizer and schedule, and Egeria
    over them on its defaults (Egeria's own rule)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TransformerLM(VOCAB, d_model=64, n_heads=4, n_layers=4, d_ff=128, max_len=LENGTH, dropout=0.0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - warmup),
    ], milestones=[warmup])
    return model, optimizer, scheduler, egeria.Egeria(model, optimizer, lr_scheduler=scheduler, total_steps=steps)


def train(model, optimizer, scheduler, eg, batches, rank: int) -> None:
    for tokens in batches:
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        for decision in eg.step(loss):
            if rank == 0:
                print(f"step {decision.step}: {decision.action} {', '.join(decision.modules)}", flush=True)


def main(rank: int, world: int, args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    batches = [torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g) for _ in range(args.steps)]
    stop = 3 * args.steps // 4
    model, optimizer, scheduler, eg = build(args.steps)
    train(model, optimizer, scheduler, eg, batches[:stop], rank)
    frozen, saved_schedule = eg.frozen, scheduler.state_dict()  # a scheduler's state is small: keep it beside
    dcp.save({"train": eg.dcp_state()}, checkpoint_id=os.path.join(args.out, "checkpoint"))
    eg.close()
    model, optimizer, scheduler, eg = build(args.steps)  # a new run, as after a restart
    dcp.load({"train": eg.dcp_state()}, checkpoint_id=os.path.join(args.out, "checkpoint"))
    scheduler.load_state_dict(saved_schedule)
    if rank == 0:
        print(f"resumed at step {eg.steps} with {eg.frozen} frozen (saved: {frozen})", flush=True)
    train(model, optimizer, scheduler, eg, batches[stop:], rank)
    if rank == 0:
        print(f"ended at step {eg.steps}, {len(eg.frozen)} of {len(eg.modules)} modules frozen", flush=True)
    eg.close()


def _spawned(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        main(rank, world, args)
        dist.barrier()  # no rank tears down its connections while another still uses them
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    parser.add_argument("--quick", action="store_true", help="40 steps: seconds (what CI runs)")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "egeria-fsdp2"),
                        help="the checkpoint's folder, the same for every rank")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.steps = 40
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            main(dist.get_rank(), dist.get_world_size(), arguments)
            dist.barrier()  # no rank tears down its connections while another still uses them
        finally:
            dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(2, f"{tmp}/init", arguments), nprocs=2, join=True)
