"""A torchrun job for the restart test (not a test file): 2 gloo ranks on CPU train a
tiny model under DDP with Egeria's default rule, checkpoint every ``--every`` steps, and
resume from the newest complete checkpoint when torchrun restarts them.

    python -m torch.distributed.run --nproc-per-node=2 --max-restarts=1 ... \\
        restart_worker.py --out DIR --steps 200 --every 20 [--kill RANK:STEP[:save]]

What it does, as a user's script would:

- **Checkpoints**: at every ``--every``-th step rank 0 writes ``DIR/ckpt/.tmp-step-NNNNNN/``
  (``train.pt``: the model, optimizer and scheduler; ``eg.save``: Egeria), then renames it
  to ``DIR/ckpt/step-NNNNNN/``, so a checkpoint folder is there whole or not at all. It
  never overwrites or removes a checkpoint folder (a folder that exists already stops the
  job); only a crashed save's temporary folder is removed.
- **Resume**: at start every rank loads the newest ``step-*`` folder rank 0 finds (the
  model, optimizer and scheduler first, then ``eg.load``) and trains on from its step.
- **Kill**: on torchrun's first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), rank RANK sends
  itself SIGKILL in the middle of step STEP (after the backward pass, before the optimizer
  step); with ``:save``, rank 0 kills itself at checkpoint step STEP after writing the
  temporary folder and before renaming it.
- **Record**: every attempt appends ``{"rank", "attempt", "resumed_from"}`` to
  ``DIR/attempts.jsonl``; at the end each rank writes ``DIR/result-rank<R>.json``: Egeria's
  events, the frozen modules, digests of the final weights, and (rank 0) the checkpoint
  folders present.

Run it with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: otherwise torchrun (torch 2.4 on)
keeps one rendezvous store across restarts, and the restarted ranks' gloo group reads the
killed attempt's addresses from it and hangs in ``init_process_group`` (pytorch/pytorch#135712).

Everything is deterministic: fixed batches (each rank its own), ``executor="inline"``, a
pinned ``eval_interval``, no cost budget and no CPU-load wait (both read the clock).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiny.py beside this file

import egeria  # noqa: E402
from tiny import Chain, batches  # noqa: E402

#: A complete checkpoint's folder name; a save in progress writes ``.tmp-`` + this name.
CHECKPOINT = re.compile(r"step-(\d{6})")
TEMPORARY = ".tmp-"


def config(interval: int) -> egeria.EgeriaConfig:
    """Egeria's default rule, decided deterministically: readings inline every ``interval``
    steps; no cost budget and no wait for a quiet CPU (each reads the clock)."""
    return egeria.EgeriaConfig(executor="inline", eval_interval=interval, cost_budget=None, cpu_threshold=None)


def build(steps: int):
    """The model (seeded), its DDP wrapper, SGD with momentum and a step schedule with two
    tenfold drops (at half and three quarters of the run), and Egeria over them; nothing loaded."""
    torch.manual_seed(0)
    model = Chain()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[steps // 2, 3 * steps // 4], gamma=0.1)
    return model, ddp, opt, sched


def checkpoints(root: Path) -> list[Path]:
    """The complete checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and CHECKPOINT.fullmatch(p.name))


def step_of(folder: Path) -> int:
    match = CHECKPOINT.fullmatch(folder.name)
    assert match is not None
    return int(match.group(1))


def save(root: Path, step: int, model, opt, sched, eg: egeria.Egeria, *, die_before_rename: bool = False) -> None:
    """Rank 0 writes the checkpoint of ``step`` into a temporary folder, then renames it
    into place; a folder already there is never overwritten."""
    final = root / f"step-{step:06d}"
    if final.exists():
        raise FileExistsError(f"{final} exists: a checkpoint is never overwritten")
    tmp = root / f"{TEMPORARY}{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)  # a crashed save of ours: never a complete checkpoint
    tmp.mkdir(parents=True)
    train = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step}
    with open(tmp / "train.pt", "wb") as f:
        torch.save(train, f)
        f.flush()
        os.fsync(f.fileno())
    eg.save(tmp)
    if die_before_rename:
        os.kill(os.getpid(), signal.SIGKILL)
    os.rename(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(folder: Path, model, opt, sched) -> None:
    """The model, optimizer and scheduler of a checkpoint (Egeria's state follows)."""
    train = torch.load(folder / "train.pt", weights_only=True)
    model.load_state_dict(train["model"])
    opt.load_state_dict(train["optimizer"])
    sched.load_state_dict(train["scheduler"])


def digest(named) -> str:
    """SHA-256 of named tensors' names and bytes, in order."""
    h = hashlib.sha256()
    for name, tensor in named:
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints")
    parser.add_argument("--interval", type=int, default=5, help="Egeria's eval_interval")
    parser.add_argument("--kill", default=None, help="RANK:STEP or 0:STEP:save, on the first attempt only")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_rank = kill_step = None
    kill_in_save = False
    if args.kill and attempt == 0:
        parts = args.kill.split(":")
        kill_rank, kill_step, kill_in_save = int(parts[0]), int(parts[1]), parts[2:] == ["save"]
    root = args.out / "ckpt"

    model, ddp, opt, sched = build(args.steps)
    found = [str(checkpoints(root)[-1]) if rank == 0 and checkpoints(root) else None]
    dist.broadcast_object_list(found, src=0)  # every rank resumes from the folder rank 0 found
    resumed = Path(found[0]) if found[0] is not None else None
    if resumed is not None:
        load(resumed, model, opt, sched)
    eg = egeria.Egeria(ddp, opt, config=config(args.interval), lr_scheduler=sched, total_steps=args.steps)
    if resumed is not None:
        eg.load(resumed)
        assert eg.steps == step_of(resumed), (eg.steps, resumed)
    with open(args.out / "attempts.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, "attempt": attempt, "resumed_from": resumed and resumed.name}) + "\n")

    data = batches(8, seed=rank + 1)  # each rank its own batches
    model.train()
    for step in range(eg.steps + 1, args.steps + 1):
        x, y = data[(step - 1) % len(data)]
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        if rank == kill_rank and step == kill_step and not kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        sched.step()
        eg.step(loss)
        if step % args.every == 0:
            if rank == 0:
                save(root, step, model, opt, sched, eg, die_before_rename=kill_in_save and step == kill_step)
            dist.barrier()  # the checkpoint is complete before any rank trains on

    result = {
        "events": [d.to_dict() for d in eg.events],
        "frozen": eg.frozen,
        "digest": digest(model.state_dict().items()),  # parameters and buffers
        "params": digest(model.named_parameters()),  # BatchNorm's statistics are each rank's own
        "steps": eg.steps,
        "checkpoints": [p.name for p in checkpoints(root)] if rank == 0 else None,
    }
    write_json(args.out / f"result-rank{rank}.json", result)
    eg.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
