"""Worker processes of the torchrun-style tests: 2 ranks over gloo on CPU (not a test file).

Each worker writes what it saw to ``<out>/rank<R>.pt``; the test compares the ranks.
:func:`run` starts one: its standard error goes to ``<out>/rank<R>.err`` (with Python's
fault handler on), so a rank that dies shows why, and it ends every run the same way: a
barrier, then the process group destroyed while every rank is still there."""

from __future__ import annotations

import copy
import faulthandler
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import egeria
from tiny import Chain, Plan, batches, quick_config


def run(rank: int, world: int, init_file: str, out: str, worker_name: str) -> None:
    """Runs ``worker_name`` as rank ``rank``, then tears the process group down in step."""
    launch(rank, world, init_file, out, globals()[worker_name])


def launch(rank: int, world: int, init_file: str, out: str, worker) -> None:
    """Runs ``worker(rank, world, out)`` as rank ``rank`` (the ``run`` of every worker module)."""
    err = open(os.path.join(out, f"rank{rank}.err"), "w")
    os.dup2(err.fileno(), 2)
    sys.stderr = err
    faulthandler.enable(err)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    worker(rank, world, out)
    gc.collect()  # nothing of the run may keep the group alive into the interpreter's exit
    dist.barrier()
    dist.destroy_process_group()


def _counting_hook(sent: list[int], world: int):
    """A DDP communication hook that all-reduces (averages) as DDP does and counts the bytes."""

    def hook(state, bucket):
        buffer = bucket.buffer()
        sent.append(buffer.numel() * buffer.element_size())
        work = dist.all_reduce(buffer.div_(world), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def _ddp(model, sent, world):
    ddp = DistributedDataParallel(model)  # find_unused_parameters=False: the default
    ddp.register_comm_hook(None, _counting_hook(sent, world))
    return ddp


def _step(ddp, opt, eg, x, y, sent) -> tuple[list, int]:
    before = len(sent)
    loss = F.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    decisions = eg.step(loss)
    return decisions, sum(sent[before:])


def _frozen_params(model, eg) -> list[torch.Tensor]:
    named = dict(model.named_parameters())
    return [named[p] for m in eg.partition.modules if m.name in eg.frozen for p in m.params]


def _trainable_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def freeze_resume_unfreeze(rank: int, world: int, out: str) -> None:
    """Train until rank 0's controller freezes, keep training, checkpoint, resume into a
    fresh DDP model, then a 10x LR drop unfreezes; record events, bytes and weights."""
    torch.manual_seed(0)
    model = Chain()
    sent: list[int] = []
    ddp = _ddp(model, sent, world)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    eg = egeria.Egeria(ddp, opt, config=quick_config())
    data = batches(1, seed=rank + 1) * 400  # each rank its own data
    record: dict = {"bytes": {}, "events": []}
    full = _trainable_bytes(model)
    for i, (x, y) in enumerate(data):
        _, nbytes = _step(ddp, opt, eg, x, y, sent)
        if eg.frozen:
            break
    record["bytes"]["before_freeze"] = (nbytes, full)  # the freeze applies after this step
    frozen = [p.detach().clone() for p in _frozen_params(model, eg)]
    for x, y in data[:5]:
        _, nbytes = _step(ddp, opt, eg, x, y, sent)
    record["bytes"]["frozen"] = (nbytes, _trainable_bytes(model))
    still = [p.detach() for p in _frozen_params(model, eg)][: len(frozen)]
    record["frozen_unchanged"] = all(torch.equal(a, b) for a, b in zip(frozen, still)) and len(frozen) > 0

    # Checkpoint as a torchrun job saves one: rank 0's Egeria state, every rank's weights equal.
    saved = [eg.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(saved, src=0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    record["frozen_at_checkpoint"] = list(eg.frozen)
    record["events"] += [d.to_dict() for d in eg.events]
    eg.close()

    torch.manual_seed(100 + rank)  # different weights until the checkpoint is loaded
    model2 = Chain()
    model2.load_state_dict(weights)
    sent.clear()
    ddp2 = _ddp(model2, sent, world)
    opt2 = torch.optim.SGD(model2.parameters(), lr=1e-4, momentum=0.9)
    opt2.load_state_dict(opt_state)
    eg2 = egeria.Egeria(ddp2, opt2, config=quick_config())
    eg2.load_state_dict(saved[0])
    record["frozen_after_resume"] = list(eg2.frozen)
    _, nbytes = _step(ddp2, opt2, eg2, *data[0], sent)
    record["bytes"]["resumed"] = (nbytes, _trainable_bytes(model2))
    for group in opt2.param_groups:
        group["lr"] *= 0.1
    decisions, _ = _step(ddp2, opt2, eg2, *data[1], sent)
    record["unfreeze"] = [d.to_dict() for d in decisions]
    for x, y in data[2:8]:
        _, nbytes = _step(ddp2, opt2, eg2, x, y, sent)
    record["bytes"]["unfrozen"] = (nbytes, _trainable_bytes(model2), full)
    record["weights"] = torch.cat([p.detach().flatten() for p in model2.parameters()])
    eg2.close()
    torch.save(record, f"{out}/rank{rank}.pt")


def builtin_hook_survives_a_rebuild(rank: int, world: int, out: str) -> None:
    """A DDP with the built-in fp16-compression hook, trained through a static freeze: after
    the rebuild the all-reduced gradients still crossed in fp16 (each value is an fp16
    number), and the replicas agree."""
    torch.manual_seed(0)
    model = Chain()
    ddp = DistributedDataParallel(model)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 2})
    eg = egeria.Egeria(ddp, opt, config=config)
    fp16_grads = []
    for i, (x, y) in enumerate(batches(1, seed=rank + 1) * 5):
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        fp16_grads.append(all(torch.equal(g, g.half().float()) for g in grads) and len(grads) > 0)
        opt.step()
        eg.step(loss)
    torch.save({"fp16_grads": fp16_grads, "frozen": list(eg.frozen),
                "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}, f"{out}/rank{rank}.pt")
    eg.close()


def _plain_steps(model, opt, eg, data) -> None:
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        eg.step(loss)


def _outcome(call) -> dict:
    try:
        call()
    except Exception as err:  # what the rank saw, for the test to read
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None, "message": ""}


def a_load_on_one_rank_only(rank: int, world: int, out: str) -> None:
    """Both ranks train a few steps under a static freeze, rank 0 saves; then rank 0 alone
    loads an earlier checkpoint (as a resume whose folder one rank lacks would): the next
    step boundary must stop both ranks with an error naming what differs."""
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = egeria.EgeriaConfig(policy="static", policy_options={"count": 2, "at_step": 4})
    eg = egeria.Egeria(model, opt, config=config)
    data = batches(1, seed=rank + 1) * 8
    _plain_steps(model, opt, eg, data[:2])
    early = eg.state_dict() if rank == 0 else None
    _plain_steps(model, opt, eg, data[2:6])
    frozen_before = list(eg.frozen)
    if rank == 0:
        eg.load_state_dict(early)
    record = _outcome(lambda: _plain_steps(model, opt, eg, data[6:7]))
    record["frozen_before"] = frozen_before
    eg.close()
    torch.save(record, f"{out}/rank{rank}.pt")


def a_rank_with_another_model(rank: int, world: int, out: str) -> None:
    """Rank 1 builds a wider model than rank 0: the first step boundary stops both."""
    torch.manual_seed(0)
    model = Chain(width=16 if rank == 0 else 12)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 50}))
    record = _outcome(lambda: _plain_steps(model, opt, eg, batches(1, seed=rank + 1)))
    eg.close()
    torch.save(record, f"{out}/rank{rank}.pt")


def a_rank_that_stops_stepping(rank: int, world: int, out: str) -> None:
    """Rank 1 stops calling eg.step() after two steps (as `if rank == 0: eg.step()` would):
    rank 0 must give up at its next boundary with an error naming the call, not hang."""
    import egeria.distributed

    egeria.distributed.BOUNDARY_TIMEOUT_S = 3.0
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 50}))
    data = batches(1, seed=rank + 1) * 4
    _plain_steps(model, opt, eg, data[:2])
    if rank == 0:
        record = _outcome(lambda: _plain_steps(model, opt, eg, data[2:4]))
    else:
        record = {"error": None, "message": ""}
    eg.close()
    torch.save(record, f"{out}/rank{rank}.pt")


def freeze_to_average(rank: int, world: int, out: str) -> None:
    """The static policy freezes the stem (its Linear and BatchNorm) to its average at step 3 on
    ranks that see different batches, under a DDP that leaves buffers alone
    (``broadcast_buffers=False``): the averaged weights and the re-estimated statistics
    must agree on every rank."""
    torch.manual_seed(0)
    model = Chain()
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = egeria.EgeriaConfig(policy="static", policy_options={"count": 2, "at_step": 3})
    eg = egeria.Egeria(ddp, opt, config=config, average=egeria.WeightAverage(span=2))
    settled = []
    for x, y in batches(16, seed=rank + 1):
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        eg.step(loss)
        settled.append(eg._prefix.settled)
    torch.save({"frozen": list(eg.frozen), "settled": settled,
                "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
                "buffers": torch.cat([b.detach().double().flatten() for b in model.buffers()])}, f"{out}/rank{rank}.pt")
    eg.close()


def _release_run(rank: int, world: int, release: bool) -> dict:
    """AdamW under DDP with a scripted plan: the front two freeze at step 4, a checkpoint at
    step 10 resumes into a fresh DDP model, all unfreeze at step 14, three freeze at step 18;
    ``release`` takes the frozen parameters' state out of the optimizer."""
    plan = {4: 2, 14: 0, 18: 3}
    config = egeria.EgeriaConfig(release_optimizer_state=release)
    data = batches(2, seed=rank + 1) * 11  # each rank its own data
    sent: list[int] = []
    torch.manual_seed(0)
    model = Chain()
    ddp = _ddp(model, sent, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    eg = egeria.Egeria(ddp, opt, policy=Plan(plan), config=config)
    for x, y in data[:10]:
        _step(ddp, opt, eg, x, y, sent)
    out = {"held_while_frozen": sum(p in opt.state for p in _frozen_params(model, eg))}
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()), eg.state_dict())
    eg.close()

    torch.manual_seed(100 + rank)
    model = Chain()
    model.load_state_dict(saved[0])
    ddp = _ddp(model, sent, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    opt.load_state_dict(saved[1])
    eg = egeria.Egeria(ddp, opt, policy=Plan(plan), config=config)
    eg.load_state_dict(saved[2])
    out["held_after_resume"] = sum(p in opt.state for p in _frozen_params(model, eg))
    events = []
    for x, y in data[10:]:
        events += [d.action for d in _step(ddp, opt, eg, x, y, sent)[0]]
    out["events"] = events
    out["weights"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    state = opt.state_dict()["state"]
    out["state"] = torch.cat([state[k][name].flatten().float() for k in sorted(state) for name in sorted(state[k])])
    eg.close()
    return out


def optimizer_state_release(rank: int, world: int, out: str) -> None:
    """The same DDP run with and without the release of optimizer state."""
    record = {"release": _release_run(rank, world, True), "keep": _release_run(rank, world, False)}
    torch.save(record, f"{out}/rank{rank}.pt")
