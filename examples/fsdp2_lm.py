"""Egeria over FSDP2 in a plain loop: a small Transformer LM sharded with ``fully_shard``,
its front layers frozen on a linear schedule, a checkpoint through
``torch.distributed.checkpoint`` three quarters of the way and a resume from it.

Run (needs torch >= 2.6; CPU, 2 processes over gloo, a few minutes on a busy 2-core machine)::

    torchrun --nproc_per_node 2 examples/fsdp2_lm.py --out /tmp/egeria-fsdp2
    python examples/fsdp2_lm.py --out /tmp/egeria-fsdp2     # starts the 2 CPU ranks itself

Under FSDP2 rank 0 holds a shard of each weight, so the policies that read weights
(Egeria's own rule, AutoFreeze, SmartFRZ) are refused; the schedules (``linear``,
``static``, ``freezeout``) work. Frozen parameters leave the reduce-scatter, the frozen
prefix runs without autograd, and ``eg.dcp_state()`` saves the model, the optimizer and
Egeria together (a resume keeps the frozen modules' optimizer state).
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


def build(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, egeria.Egeria]:
    """The model sharded per layer and at the root, its optimizer, and Egeria over it."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TransformerLM(VOCAB, d_model=64, n_heads=4, n_layers=4, d_ff=128, max_len=LENGTH, dropout=0.0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = egeria.EgeriaConfig(policy="linear")
    return model, optimizer, egeria.Egeria(model, optimizer, config=config, total_steps=steps)


def train(model, optimizer, eg, batches, rank: int) -> None:
    for tokens in batches:
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for decision in eg.step(loss):
            if rank == 0:
                print(f"step {decision.step}: {decision.action} {', '.join(decision.modules)}", flush=True)


def main(rank: int, world: int, args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    batches = [torch.randint(0, VOCAB, (BATCH, LENGTH + 1), generator=g) for _ in range(args.steps)]
    stop = 3 * args.steps // 4  # the linear schedule has frozen modules by then
    model, optimizer, eg = build(args.steps)
    train(model, optimizer, eg, batches[:stop], rank)
    frozen = eg.frozen
    dcp.save({"train": eg.dcp_state()}, checkpoint_id=os.path.join(args.out, "checkpoint"))
    eg.close()
    model, optimizer, eg = build(args.steps)  # a new run, as after a restart
    dcp.load({"train": eg.dcp_state()}, checkpoint_id=os.path.join(args.out, "checkpoint"))
    if rank == 0:
        print(f"resumed at step {eg.steps} with {eg.frozen} frozen (saved: {frozen})", flush=True)
    train(model, optimizer, eg, batches[stop:], rank)
    if rank == 0:
        print(f"ended at step {eg.steps}, {len(eg.frozen)} of {len(eg.modules)} modules frozen", flush=True)
    eg.close()


def _spawned(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        main(rank, world, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "egeria-fsdp2"),
                        help="the checkpoint's folder, the same for every rank")
    arguments = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            main(dist.get_rank(), dist.get_world_size(), arguments)
        finally:
            dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(2, f"{tmp}/init", arguments), nprocs=2, join=True)
