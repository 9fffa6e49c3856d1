"""Worker processes of the FSDP2 tests: 2 ranks over gloo on CPU, the model sharded with
``fully_shard`` (not a test file).

:func:`every_scenario` runs them all in one start of the ranks (starting them costs more
than the runs on a busy machine: each imports torch) and writes what each saw to
``<out>/<scenario>-rank<R>.pt``; the tests compare the ranks. :func:`run` starts it as
:func:`ddp_workers.launch` does for DDP."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

import egeria
from ddp_workers import launch
from tiny import Chain, Plan, batches, quick_config

CLASSES = 4  # every parameter's first dimension splits evenly over 2 ranks: no padding in the byte counts


def run(rank: int, world: int, init_file: str, out: str, worker_name: str) -> None:
    """Runs ``worker_name`` of this module as rank ``rank``, one thread each (two ranks
    that share a busy machine's cores spin less so)."""
    torch.set_num_threads(1)
    launch(rank, world, init_file, out, globals()[worker_name])


#: Freeze the stem (Linear, then BatchNorm) after step 2, unfreeze after step 3, freeze
#: three modules after step 4; the runs take :data:`STEPS` steps (few: on a busy 2-core
#: machine each step of two niced ranks takes seconds).
PLAN = {2: 2, 3: 0, 4: 3}
STEPS = 5


class Counted:
    """Bytes FSDP2 reduce-scatters (gradients in) and all-gathers (parameters out) on this
    rank, through its public custom-collective hooks."""

    def __init__(self) -> None:
        self.reduce_scattered = 0
        self.all_gathered = 0
        counter = self

        class ReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                counter.reduce_scattered += input_tensor.numel() * input_tensor.element_size()
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        class AllGather(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                counter.all_gathered += output_tensor.numel() * output_tensor.element_size()
                return super().__call__(output_tensor, input_tensor, group, async_op)

        self.reduce_scatter, self.all_gather = ReduceScatter(), AllGather()

    def take(self) -> tuple[int, int]:
        taken = (self.reduce_scattered, self.all_gathered)
        self.reduce_scattered = self.all_gathered = 0
        return taken


def sharded_chain(seed: int, counted: Counted | None = None, kind: type[Chain] = Chain) -> Chain:
    """The tests' Chain (or a subclass), sharded as FSDP2 users do: the stem and each
    block, then the root."""
    torch.manual_seed(seed)
    model = kind(classes=CLASSES)
    fully_shard(model.stem)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if counted is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(counted.reduce_scatter)
                module.set_custom_all_gather(counted.all_gather)
    return model


def full(model) -> torch.Tensor:
    """Every parameter whole (an all-gather of the shards; every rank must call it)."""
    return torch.cat([p.full_tensor().flatten() for p in model.parameters()])


def _step(model, opt, eg, x, y):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return eg.step(loss)


def _trainable_bytes(model) -> int:
    """Bytes of the trainable parameters' whole gradients (what a reduce-scatter takes in)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def freeze_unfreeze(rank: int, world: int, out: str) -> dict:
    """:data:`STEPS` steps under :data:`PLAN`, each rank its own data; per step: bytes reduce-scattered
    and all-gathered, the trainable bytes, whether the stem's output needed autograd, the
    stem's BatchNorm buffers; the frozen weights before and after their frozen steps."""
    counted = Counted()
    model = sharded_chain(0, counted)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eg = egeria.Egeria(model, opt, policy=Plan(PLAN))
    stem_out: list[bool] = []
    hook = model.stem.register_forward_hook(lambda m, a, o: stem_out.append(o.requires_grad))
    record: dict = {"steps": [], "events": []}
    frozen_at: dict[int, torch.Tensor] = {}
    for step, (x, y) in enumerate(batches(STEPS, classes=CLASSES, seed=rank + 1), start=1):
        trainable = _trainable_bytes(model)
        decisions = _step(model, opt, eg, x, y)
        rs, ag = counted.take()
        bn = model.stem[1]
        record["steps"].append({
            "step": step, "reduce_scattered": rs, "all_gathered": ag, "trainable": trainable,
            "stem_output_needed_grad": stem_out[-1], "frozen": list(eg.frozen),
            "bn": torch.cat([bn.running_mean, bn.running_var]).clone(),
        })
        record["events"] += [d.to_dict() for d in decisions]
        if step in (2, 3):  # the stem as it froze (step 2) and as it unfroze (step 3)
            frozen_at[step] = torch.cat([p.full_tensor().flatten() for p in model.stem.parameters()])
    hook.remove()
    record["stem_unchanged_while_frozen"] = torch.equal(frozen_at[2], frozen_at[3])
    record["weights"] = full(model)
    record["all_parameters"] = sum(p.numel() * p.element_size() for p in model.parameters())
    eg.close()
    return record


def _resumable_run(rank: int, out: str, stop: int | None, rollback: bool = False, release: bool = True) -> dict:
    """:data:`STEPS` AdamW steps under :data:`PLAN` (unfreezing at 3); with ``stop``, saved
    through DCP after step ``stop`` and resumed into a fresh model, optimizer and Egeria, or
    with ``rollback`` into the same ones after two more steps (whose freeze holds the saved
    frozen modules and more as the checkpoint loads). ``release``: the frozen parameters'
    optimizer state leaves the optimizer (egeria.optimizer_state)."""
    data = batches(STEPS, classes=CLASSES, seed=rank + 1)
    model = sharded_chain(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    config = egeria.EgeriaConfig(release_optimizer_state=release)
    eg = egeria.Egeria(model, opt, policy=Plan(PLAN), config=config)
    record: dict = {}
    start = 0
    if stop is not None:
        for x, y in data[:stop]:
            _step(model, opt, eg, x, y)
        record["frozen_at_save"] = list(eg.frozen)
        record["held_at_save"] = sum(p in opt.state for n, p in model.named_parameters() if n.startswith("stem."))
        folder = f"{out}/dcp-{'rollback' if rollback else 'fresh'}"
        dcp.save({"train": eg.dcp_state()}, checkpoint_id=folder)
        if rollback:
            for x, y in data[stop : stop + 2]:
                _step(model, opt, eg, x, y)
            record["frozen_before_load"] = list(eg.frozen)
        else:
            eg.close()
            model = sharded_chain(100)  # other weights until the checkpoint loads
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
            eg = egeria.Egeria(model, opt, policy=Plan(PLAN), config=config)
        dcp.load({"train": eg.dcp_state()}, checkpoint_id=folder)
        record["frozen_after_load"] = list(eg.frozen)
        record["held_after_load"] = sum(p in opt.state for n, p in model.named_parameters() if n.startswith("stem."))
        record["trainable_after_load"] = [n for n, p in model.named_parameters() if p.requires_grad]
        start = stop
    decisions = []
    for x, y in data[start:]:
        decisions += [d.to_dict() for d in _step(model, opt, eg, x, y)]
    record["decisions"] = decisions
    record["steps"] = eg.steps
    record["weights"] = full(model)
    eg.close()
    return record


def resume_equals_uninterrupted(rank: int, world: int, out: str) -> dict:
    """The same run three times: uninterrupted; saved after step 2 (as the stem froze) and
    resumed afresh; saved there, trained to step 4 and rolled back into the same objects.
    The unfreeze at step 3 and the freeze at step 4 come after the resume. And once more
    uninterrupted with the frozen parameters' optimizer state kept in the optimizer."""
    return {"uninterrupted": _resumable_run(rank, out, None), "resumed": _resumable_run(rank, out, 2),
            "rolled_back": _resumable_run(rank, out, 2, rollback=True),
            "kept": _resumable_run(rank, out, None, release=False)}


#: Egeria's rule decides its first freezes within this many steps of the tests' Chain on a
#: batch seen again every step (SGD, lr 1e-4); a resumed run is saved after RULE_SAVE_AT.
RULE_STEPS = 140
RULE_SAVE_AT = 30


def _rule_run(rank: int, out: str, layout: str, stop: int | None = None) -> dict:
    """:data:`RULE_STEPS` steps of Egeria's rule (``quick_config``: a reading every step,
    inline) on this rank's fixed batch, the model sharded with ``fully_shard`` or wrapped in
    DDP (``layout``); with ``stop``, saved through DCP after step ``stop`` and resumed into
    a fresh model, optimizer and Egeria. Per step every parameter whole; rank 0's readings."""
    data = batches(1, classes=CLASSES, seed=rank + 1) * RULE_STEPS

    def fresh(seed: int):
        if layout == "fsdp2":
            model = sharded_chain(seed)
            trained = model
        else:
            torch.manual_seed(seed)
            model = Chain(classes=CLASSES)
            trained = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        return model, trained, opt, egeria.Egeria(trained, opt, config=quick_config(), total_steps=RULE_STEPS)

    def whole(model) -> torch.Tensor:
        return full(model) if layout == "fsdp2" else torch.cat([p.detach().flatten() for p in model.parameters()])

    model, trained, opt, eg = fresh(0)
    record: dict = {"weights": [], "events": []}
    for step, (x, y) in enumerate(data, start=1):
        record["events"] += [d.to_dict() for d in _step(trained, opt, eg, x, y)]
        record["weights"].append(whole(model))
        if step == stop:
            folder = f"{out}/dcp-rule"
            dcp.save({"train": eg.dcp_state()}, checkpoint_id=folder)
            eg.close()
            model, trained, opt, eg = fresh(100)  # other weights until the checkpoint loads
            dcp.load({"train": eg.dcp_state()}, checkpoint_id=folder)
            record["frozen_after_load"] = list(eg.frozen)
    record["history"] = eg.history
    record["frozen"] = list(eg.frozen)
    eg.close()
    return record


def egeria_rule(rank: int, world: int, out: str) -> dict:
    """Egeria's own rule over FSDP2 against the same training under DDP (same initial
    weights, each rank its own batch), and the FSDP2 run saved through DCP after
    :data:`RULE_SAVE_AT` steps and resumed."""
    return {"fsdp2": _rule_run(rank, out, "fsdp2"), "ddp": _rule_run(rank, out, "ddp"),
            "resumed": _rule_run(rank, out, "fsdp2", stop=RULE_SAVE_AT)}


class LossChain(Chain):
    """The tests' Chain as a Hugging Face model answers: its output carries the loss."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}


def _trainer_args(rank: int, output_dir: str):
    """The ``TrainingArguments`` fields ``EgeriaCallback`` reads, as the Trainer sets them
    under FSDP2 on 2 ranks: rank 0 alone saves, into ``output_dir``."""
    from types import SimpleNamespace

    return SimpleNamespace(world_size=2, n_gpu=1, fsdp="full_shard", fsdp_config={}, deepspeed=None,
                           should_save=rank == 0, output_dir=output_dir, resume_from_checkpoint=None)


def _save_shards(model, opt, path: str) -> None:
    """This rank's model and optimizer shards, as the Trainer's checkpoint holds them."""
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)


def _restore_shards(model, opt, path: str) -> None:
    """What the Trainer restores from :func:`_save_shards` before ``on_train_begin``."""
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])


def _hf_run(rank: int, out: str, stop: int | None = None) -> dict:
    """:func:`_rule_run`'s FSDP2 run driven as the HF Trainer drives ``EgeriaCallback``
    (accelerate shards only on accelerators, so the Trainer itself cannot run here): the
    model's output carries the loss, ``on_step_end`` after each optimizer step, and with
    ``stop`` the Trainer's checkpoint after step ``stop`` (each rank its model and optimizer
    shards, ``on_save`` on every rank, rank 0 alone saving into its output folder, which
    rank 1 cannot see), then a fresh model and optimizer restored from it and a fresh
    callback resuming at that step. Per step every parameter whole; rank 0's readings."""
    from types import SimpleNamespace

    from egeria.integrations.hf import EgeriaCallback

    data = batches(1, classes=CLASSES, seed=rank + 1) * RULE_STEPS
    args = _trainer_args(rank, f"{out}/hf-output-rank{rank}")
    state = SimpleNamespace(max_steps=RULE_STEPS, global_step=0)

    def begin(seed: int, shards: str | None = None):
        model = sharded_chain(seed, kind=LossChain)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
        if shards is not None:  # what the Trainer restores before on_train_begin
            _restore_shards(model, opt, shards)
        callback = EgeriaCallback(quick_config(), log_signals=False)
        callback.on_train_begin(args, state, None, model=model, optimizer=opt, lr_scheduler=None)
        return model, opt, callback

    model, opt, callback = begin(0)
    record: dict = {"weights": []}
    for x, y in data:
        loss = model(x, y)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.global_step += 1
        callback.on_step_end(args, state, None)
        record["weights"].append(full(model))
        if state.global_step == stop:
            folder = f"{args.output_dir}/checkpoint-{stop}"
            if args.should_save:
                os.makedirs(folder)  # the Trainer's checkpoint folder, on the saving rank
            shards = f"{out}/hf-shards-rank{rank}.pt"
            _save_shards(model, opt, shards)
            callback.on_save(args, state, None)
            callback.on_train_end(args, state, None)
            model, opt, callback = begin(100, shards)  # other weights until the shards load
            record["frozen_after_load"] = list(callback.egeria.frozen)
            record["saved_by_rank"] = os.path.exists(f"{folder}/egeria.json")
    eg = callback.egeria
    record.update(events=[d.to_dict() for d in eg.events], history=eg.history, frozen=list(eg.frozen))
    callback.on_train_end(args, state, None)
    return record


def _refused_together(rank: int, out: str) -> dict:
    """A state rank 0's check refuses (its policy's part damaged) and the other ranks' would
    take, loaded on every rank under FSDP2 with Egeria's rule: what each rank raised, and
    its frozen modules and step count before and after."""
    from egeria.checkpoint.saved_state import sealed

    model = sharded_chain(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    eg = egeria.Egeria(model, opt, config=quick_config())
    x, y = batches(1, classes=CLASSES, seed=rank + 1)[0]
    for _ in range(3):
        _step(model, opt, eg, x, y)
    state = eg.state_dict()
    state = eg._from_rank0(state if eg._decides else None, "test")  # rank 0's, with its policy's part
    damaged = sealed({**state, "frozen": 1, "policy_state": {**state["policy_state"], "stage": "nonsense"}})
    before = (list(eg.frozen), eg.steps)
    try:
        eg.load_state_dict(damaged)
        said = None
    except ValueError as err:
        said = str(err)
    record = {"said": said, "before": before, "after": (list(eg.frozen), eg.steps)}
    eg.close()
    return record


def hf_callback(rank: int, world: int, out: str) -> dict:
    """Egeria's rule under FSDP2 through the HF callback, uninterrupted and saved after
    :data:`RULE_SAVE_AT` then resumed; and a state refused by rank 0 alone."""
    return {"uninterrupted": _hf_run(rank, out), "resumed": _hf_run(rank, out, stop=RULE_SAVE_AT),
            "refused": _refused_together(rank, out)}


#: The cache scenario: the stem and blocks.0 (two FSDP2 units) freeze after step 2.
CACHE_PLAN = {2: 3}


class EpochBatches:
    """A batch sampler whose n-th epoch yields ``epochs[n]`` (the last one from then on)."""

    def __init__(self, epochs: list[list[list[int]]]) -> None:
        self.epochs, self.epoch = epochs, -1

    def __iter__(self):
        self.epoch += 1
        return iter(self.epochs[min(self.epoch, len(self.epochs) - 1)])

    def __len__(self) -> int:
        return len(self.epochs[min(max(self.epoch, 0), len(self.epochs) - 1)])


def _cache_run(rank: int, cached: bool) -> dict:
    """Four epochs of two batches of 8 under :data:`CACHE_PLAN`, each rank its own 24
    samples; rank 1's third epoch draws 8 samples it has never seen in its second batch,
    rank 0's the same two batches every epoch. Per step: every parameter whole, the bytes
    all-gathered, and the batches the cache served so far."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(rank + 1)
    data = TensorDataset(torch.randn(24, 8, generator=g), torch.randint(0, CLASSES, (24,), generator=g))
    usual = [list(range(8)), list(range(8, 16))]
    epochs = [usual, usual, [list(range(8)), list(range(16, 24))] if rank == 1 else usual, usual]
    loader = DataLoader(data, batch_sampler=EpochBatches(epochs))
    counted = Counted()
    model = sharded_chain(0, counted)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eg = egeria.Egeria(model, opt, policy=Plan(CACHE_PLAN))
    batches_in = eg.cache_loader(loader, serve="always", prefetch=0) if cached else loader
    record: dict = {"steps": []}
    for _ in range(len(epochs)):
        for x, y in batches_in:
            _step(model, opt, eg, x, y)
            rs, ag = counted.take()
            record["steps"].append({"weights": full(model), "all_gathered": ag,
                                    "served": eg.cache_stats.get("served", 0), "frozen": list(eg.frozen)})
            counted.take()  # full() gathered too
    record["frozen_unit_bytes"] = sum(p.numel() * p.element_size() for u in (model.stem, model.blocks[0]) for p in u.parameters())
    eg.close()
    return record


def activation_cache(rank: int, world: int, out: str) -> dict:
    """The activation cache under FSDP2, against the same run without it."""
    return {"cached": _cache_run(rank, True), "plain": _cache_run(rank, False)}


def refusals(rank: int, world: int, out: str) -> dict:
    """What Egeria says under FSDP2 to the policies that read the model on their own."""
    model = sharded_chain(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    said: dict = {}
    for policy in ("autofreeze", "smartfrz"):
        try:
            egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy=policy), total_steps=100).close()
            said[policy] = None
        except ValueError as err:
            said[policy] = str(err)
    return said


def _lightning_fit(rank: int, out: str, max_steps: int, *, ckpt_path: str | None = None,
                   save_to: str | None = None, rule: bool = False) -> dict:
    """``Trainer.fit`` under Lightning's FSDP2 strategy (``ModelParallelStrategy``, the model
    sharded in ``configure_model``) with ``EgeriaCallback`` under :data:`PLAN` (SGD at 0.05),
    or with ``rule`` under Egeria's rule (``quick_config``, SGD at 1e-4, :data:`RULE_STEPS`
    steps in the run's plan): one step per epoch on this rank's fixed batch (epoch
    boundaries make resuming exact); per step the frozen modules, every parameter whole and
    the stem's. ``ckpt_path`` resumes from a checkpoint; ``save_to`` saves one at the end."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from egeria.integrations.lightning import EgeriaCallback

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Chain(classes=CLASSES)

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for unit in (self.net.stem, *self.net.blocks, self.net):
                fully_shard(unit, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4 if rule else 0.05, momentum=0.9)

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            eg = egeria_callback.egeria
            self.steps.append({"step": trainer.global_step, "egeria_steps": eg.steps, "frozen": list(eg.frozen),
                               "weights": full(pl_module.net), "stem": full(pl_module.net.stem)})

    if rule:
        egeria_callback = EgeriaCallback(quick_config(), total_steps=RULE_STEPS)
    else:
        egeria_callback = EgeriaCallback(policy=Plan(PLAN))
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        callbacks=[egeria_callback, recorder], max_steps=max_steps, max_epochs=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out, use_distributed_sampler=not rule,
    )
    if rule:  # each rank the fixed batch of _rule_run, its own loader (no distributed sampler)
        x, y = batches(1, classes=CLASSES, seed=rank + 1)[0]
    else:  # 16 samples: the sampler gives each rank 8, shuffled afresh each epoch
        x, y = batches(1, classes=CLASSES, seed=1)[0]
    trainer.fit(Task(), DataLoader(TensorDataset(x, y), batch_size=16 if rule else 8), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    eg = egeria_callback.egeria
    return {"steps": recorder.steps, "events": [e.to_dict() for e in eg.events], "history": eg.history,
            "global_step": trainer.global_step}


def lightning(rank: int, world: int, out: str) -> dict:
    """The Lightning callback under its FSDP2 strategy, in a real ``Trainer.fit`` on the ranks
    already started (Lightning takes them for torchrun's, through the variables torchrun
    sets, and finds the process group up): the run uninterrupted, and the same run saved
    after step 4 (three modules frozen) and resumed by a fresh Trainer."""
    try:
        import lightning  # noqa: F401
    except ImportError:
        return {"skipped": "needs lightning (pip install -e '.[lightning]')"}
    os.environ.update(TORCHELASTIC_RUN_ID="egeria-tests", RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")  # read only to start a process group, which is up already
    folder, rule_folder = f"{out}/lightning-checkpoint", f"{out}/lightning-rule-checkpoint"
    return {"uninterrupted": _lightning_fit(rank, out, STEPS), "saved": _lightning_fit(rank, out, 4, save_to=folder),
            "resumed": _lightning_fit(rank, out, STEPS, ckpt_path=folder),
            "rule": _lightning_fit(rank, out, RULE_STEPS, rule=True),
            "rule_saved": _lightning_fit(rank, out, RULE_SAVE_AT, save_to=rule_folder, rule=True),
            "rule_resumed": _lightning_fit(rank, out, RULE_STEPS, ckpt_path=rule_folder, rule=True)}


#: Freezing to the average under FSDP2: the stem (Linear, then BatchNorm) freezes after step
#: 3 to the average of its weights over a span of 2 steps; its BatchNorm re-estimates on the
#: next 10 batches (1/momentum), to step 13. Saved after step 2 (averaging) or 6 (re-estimating).
AVERAGE_PLAN = {3: 2}
AVERAGE_SPAN = 2
AVERAGE_STEPS = 15


def _average_run(rank: int, out: str, stop: int | None = None, via: str = "dcp") -> dict:
    """:data:`AVERAGE_STEPS` AdamW steps under :data:`AVERAGE_PLAN`, freezing to the average,
    each rank its own data; per step the stem's whole weights before and after the step
    boundary and its BatchNorm statistics. With ``stop``, saved after step ``stop`` and
    resumed into a fresh model, optimizer and Egeria: through DCP (``via="dcp"``) or as the HF
    Trainer drives ``EgeriaCallback`` (``via="hf"``: each rank its own shards, ``on_save`` on
    every rank, rank 0 alone writing Egeria's state, the resume on every rank)."""
    from types import SimpleNamespace

    from egeria.integrations.hf import EgeriaCallback

    data = batches(AVERAGE_STEPS, classes=CLASSES, seed=rank + 1)
    args = _trainer_args(rank, f"{out}/average-output-rank{rank}")
    state = SimpleNamespace(max_steps=AVERAGE_STEPS, global_step=0)

    def begin(seed: int, shards: str | None = None):
        model = sharded_chain(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        average = egeria.WeightAverage(span=AVERAGE_SPAN)
        if via == "dcp":
            return model, opt, None, egeria.Egeria(model, opt, policy=Plan(AVERAGE_PLAN), average=average)
        if shards is not None:  # what the Trainer restores before on_train_begin
            _restore_shards(model, opt, shards)
        callback = EgeriaCallback(policy=Plan(AVERAGE_PLAN), average=average, log_signals=False)
        callback.on_train_begin(args, state, None, model=model, optimizer=opt, lr_scheduler=None)
        return model, opt, callback, callback.egeria

    def stem(model) -> torch.Tensor:
        return torch.cat([p.full_tensor().flatten() for p in model.stem.parameters()])

    model, opt, callback, eg = begin(0)
    record: dict = {"before": [], "after": [], "bn": [], "frozen": []}
    for step, (x, y) in enumerate(data, start=1):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        record["before"].append(stem(model))
        if callback is None:
            eg.step(loss)
        else:
            state.global_step = step
            callback.on_step_end(args, state, None)
        record["after"].append(stem(model))
        bn = model.stem[1]
        record["bn"].append(torch.cat([bn.running_mean, bn.running_var]).clone())
        record["frozen"].append(list(eg.frozen))
        if step == stop:
            if callback is None:
                folder = f"{out}/average-dcp-{stop}"
                dcp.save({"train": eg.dcp_state()}, checkpoint_id=folder)
                eg.close()
                model, opt, callback, eg = begin(100)  # other weights until the checkpoint loads
                dcp.load({"train": eg.dcp_state()}, checkpoint_id=folder)
            else:
                if args.should_save:
                    os.makedirs(f"{args.output_dir}/checkpoint-{stop}")  # the Trainer's folder, on the saving rank
                shards = f"{out}/average-shards-{stop}-rank{rank}.pt"
                _save_shards(model, opt, shards)
                callback.on_save(args, state, None)
                callback.on_train_end(args, state, None)
                model, opt, callback, eg = begin(100, shards)
            record["frozen_after_load"] = list(eg.frozen)
    record["weights"] = full(model)
    eg.close()
    return record


def averaging(rank: int, world: int, out: str) -> dict:
    """Freezing to the average under FSDP2: uninterrupted; resumed through DCP after step 2
    (averages under way) and after step 6 (the BatchNorm re-estimate under way); resumed
    through the HF callback after step 6."""
    return {"uninterrupted": _average_run(rank, out), "dcp_2": _average_run(rank, out, 2),
            "dcp_6": _average_run(rank, out, 6), "hf_6": _average_run(rank, out, 6, via="hf")}


SCENARIOS = (freeze_unfreeze, resume_equals_uninterrupted, egeria_rule, hf_callback, activation_cache, refusals, lightning,
             averaging)


def every_scenario(rank: int, world: int, out: str) -> None:
    """Every scenario in turn (a rank that fails stops the run: the test shows its stderr,
    where each scenario's wall time is written for a reader of a slow run)."""
    for scenario in SCENARIOS:
        began = time.monotonic()
        torch.save(scenario(rank, world, out), f"{out}/{scenario.__name__}-rank{rank}.pt")
        print(f"{scenario.__name__}: {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
