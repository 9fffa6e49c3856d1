"""The Hugging Face ``Trainer`` callback, trained for real: a tiny GPT-2 (tied embeddings)
built from a config, gradient accumulation 2, a checkpoint resume."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

import egeria
from tiny import quick_config

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e '.[hf]')")

from egeria.integrations.hf import STATE_FILE, EgeriaCallback  # noqa: E402
from hf_workers import Tokens, gpt2  # noqa: E402

ACCUMULATION = 2


@pytest.fixture(autouse=True)
def no_heap_scans(monkeypatch):
    """The callback takes what it needs from the Trainer it is attached to or from its
    events; a scan of the heap for the Trainer's objects fails every test here."""
    import gc

    def refused(*args, **kwargs):
        raise AssertionError("gc.get_objects() called: EgeriaCallback must not scan the heap")

    monkeypatch.setattr(gc, "get_objects", refused)

class Recorder(transformers.TrainerCallback):
    """Egeria's view at every optimizer step, read after the EgeriaCallback ran."""

    def __init__(self, callback: EgeriaCallback) -> None:
        self.callback = callback
        self.frozen_at: dict[int, list[str]] = {}  # global_step -> frozen modules
        self.begin: tuple[int, list[str]] | None = None  # (Egeria's steps, frozen) at train begin
        self.forwards = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        eg = self.callback.egeria
        self.begin = (eg.steps, list(eg.frozen))
        model.register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.forwards += module.training

    def on_step_end(self, args, state, control, **kwargs):
        self.frozen_at[state.global_step] = list(self.callback.egeria.frozen)


def trainer_for(output_dir, callback: EgeriaCallback, *, max_steps: int, save_steps: int = 100, distinct: int = 32):
    """A Trainer of a tiny GPT-2 with the callback: AdamW with weight decay, accumulation 2;
    a linear schedule with random data, a constant one with few distinct sequences."""
    schedule, lr = ("linear", 1e-2) if distinct == 32 else ("constant", 1e-2)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=lr, weight_decay=0.1, lr_scheduler_type=schedule,
        save_strategy="steps", save_steps=save_steps, logging_strategy="no", report_to="none", use_cpu=True,
        seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    recorder = Recorder(callback)
    data = Tokens(distinct)
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=data, callbacks=[callback, recorder])
    return trainer, recorder


def static(at_step: int) -> egeria.EgeriaConfig:
    return egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": at_step})


def snapshotting(config: egeria.EgeriaConfig) -> tuple[EgeriaCallback, dict[str, torch.Tensor]]:
    """A callback whose on_change copies each module's parameters as the module freezes."""
    store: dict[str, torch.Tensor] = {}

    def on_change(decision: egeria.Decision) -> None:
        if decision.action == "freeze":
            eg = callback.egeria
            params = dict(eg.model.named_parameters())
            for module in eg.partition.modules:
                if module.name in decision.modules:
                    store.update({p: params[p].detach().clone() for p in module.params})

    callback = EgeriaCallback(config, on_change=on_change)
    return callback, store


def test_static_policy_freezes_at_the_optimizer_step_not_the_micro_batch(tmp_path):
    callback, frozen_weights = snapshotting(static(3))
    trainer, recorder = trainer_for(tmp_path, callback, max_steps=8)
    trainer.train()
    eg = callback.egeria
    front = eg.modules[0]
    assert recorder.forwards == 8 * ACCUMULATION
    assert {step: bool(frozen) for step, frozen in recorder.frozen_at.items()} == {
        1: False, 2: False, 3: True, 4: True, 5: True, 6: True, 7: True, 8: True
    }
    assert [(d.step, d.action, d.modules) for d in eg.events] == [(3, "freeze", (front,))]
    assert eg.steps == trainer.state.global_step == 8
    params = dict(trainer.model.named_parameters())
    assert "transformer.wpe.weight" in frozen_weights
    for name, value in frozen_weights.items():
        assert torch.equal(params[name], value), name
    # The tied embedding weight belongs to the head and kept training.
    assert "transformer.wte.weight" not in frozen_weights


def test_egerias_own_rule_freezes_inside_the_trainer(tmp_path):
    callback, frozen_weights = snapshotting(quick_config())
    trainer, recorder = trainer_for(tmp_path, callback, max_steps=40, distinct=4)
    trainer.train()
    eg = callback.egeria
    freezes = [d for d in eg.events if d.action == "freeze"]
    assert freezes, f"nothing froze in 40 steps; history {eg.history[-3:]}"
    assert freezes[0].modules[0] == eg.modules[0]
    assert eg.steps == trainer.state.global_step == 40
    assert eg.controller_stats["failure"] is None
    assert not [d for d in eg.events if d.action == "unfreeze"]  # a constant learning rate
    params = dict(trainer.model.named_parameters())
    still_frozen = [p for m in eg.partition.modules[: len(recorder.frozen_at[40])] for p in m.params]
    assert "transformer.wpe.weight" in still_frozen
    for name in still_frozen:
        assert torch.equal(params[name], frozen_weights[name]), name


# (config, distinct sequences, checkpoint step, last step): each run has frozen a module
# by its checkpoint, resumed mid-epoch (4 optimizer steps per epoch).
RESUMES = {
    "static": (static(2), 32, 3, 8),
    "egeria": (quick_config(), 4, 29, 32),
    "static-average": (static(5), 32, 3, 8),  # frozen to its average after the checkpoint
}


@pytest.mark.parametrize(
    "case, where", [("static", "output_dir"), ("egeria", "output_dir"), ("static", "moved"), ("static-average", "output_dir")]
)
def test_resume_restores_the_frozen_set_and_continues_like_an_uninterrupted_run(tmp_path, case, where):
    """``where``: the checkpoint lies under the resumed run's output_dir, or was moved
    elsewhere and is named to the callback (``resume_from``)."""
    config, distinct, at, last = RESUMES[case]
    extra = {"average": egeria.WeightAverage(span=3)} if case.endswith("average") else {}
    whole = EgeriaCallback(config, **extra)
    trainer, _ = trainer_for(tmp_path / "whole", whole, max_steps=last, save_steps=at, distinct=distinct)
    trainer.train()
    expected = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    frozen_at_checkpoint = [m for e in whole.egeria.events if e.step <= at and e.action == "freeze" for m in e.modules]
    assert frozen_at_checkpoint or extra, f"nothing froze by step {at}: {whole.egeria.events}"
    checkpoint = tmp_path / "whole" / f"checkpoint-{at}"
    assert (checkpoint / STATE_FILE).is_file()

    copy = tmp_path / "resumed" / checkpoint.name if where == "output_dir" else tmp_path / "moved" / "kept"
    shutil.copytree(checkpoint, copy)
    resumed = EgeriaCallback(config, resume_from=copy if where == "moved" else None, **extra)
    trainer, recorder = trainer_for(tmp_path / "resumed", resumed, max_steps=last, save_steps=at, distinct=distinct)
    trainer.train(resume_from_checkpoint=str(copy))
    eg = resumed.egeria
    assert recorder.begin == (at, frozen_at_checkpoint)
    assert recorder.forwards == (last - at) * ACCUMULATION
    assert eg.steps == trainer.state.global_step == last
    assert [d.to_dict() for d in eg.events] == [d.to_dict() for d in whole.egeria.events]
    # The Trainer's own resume is exact on CPU (weights, AdamW state, scheduler, data order).
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_a_resume_without_egerias_state_of_that_step_starts_afresh_and_names_the_folders_tried(tmp_path, caplog):
    first = EgeriaCallback(static(2))
    trainer, _ = trainer_for(tmp_path / "first", first, max_steps=4, save_steps=2)
    trainer.train()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "first" / "checkpoint-2", elsewhere)
    shutil.copy(tmp_path / "first" / "checkpoint-4" / STATE_FILE, elsewhere / STATE_FILE)  # Egeria's state of step 4
    resumed = EgeriaCallback(static(2), resume_from=elsewhere)
    trainer, recorder = trainer_for(tmp_path / "second", resumed, max_steps=4, save_steps=2)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        trainer.train(resume_from_checkpoint=str(elsewhere))
    assert recorder.begin == (0, [])  # afresh: a state of another step would not fit the weights
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "resuming at step 2" in message and "step 4" in message and "checkpoint-2 (no egeria.json)" in message


def test_a_full_disk_at_egerias_save_warns_and_training_goes_on(tmp_path, caplog, monkeypatch):
    import errno

    import egeria.integrations.hf as hf

    writes = []

    def full_at_the_second(state, folder):
        writes.append(folder)
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(state, folder)

    real = hf.write_state
    monkeypatch.setattr(hf, "write_state", full_at_the_second)
    callback = EgeriaCallback(static(2))
    trainer, _ = trainer_for(tmp_path, callback, max_steps=6, save_steps=2)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        trainer.train()
    assert trainer.state.global_step == callback.egeria.steps == 6  # trained to the end
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "Egeria's state was not saved in" in message and "checkpoint-4" in message and "No space left" in message
    # The checkpoints before and after keep Egeria's state; the one it failed at has none.
    assert [(tmp_path / f"checkpoint-{s}" / STATE_FILE).is_file() for s in (2, 4, 6)] == [True, False, True]


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="must be an EgeriaConfig, got dict"):
        EgeriaCallback({"policy": "static"})
    with pytest.raises(ValueError, match=r"takes \['optimizer', 'total_steps'\] from the Trainer"):
        EgeriaCallback(total_steps=10, optimizer=None)
    with pytest.raises(ValueError, match=r"unknown arguments \['windw'\]"):
        EgeriaCallback(windw=3)
    with pytest.raises(ValueError, match=r"log_signals=...\) must be True or False, got 'yes'"):
        EgeriaCallback(log_signals="yes")


@pytest.mark.slow
def test_ddp_two_ranks_stay_bit_identical_through_a_freeze_and_an_unfreeze(tmp_path):
    import socket

    import torch.multiprocessing as mp

    import hf_workers

    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(hf_workers.train_two_ranks, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))

    assert zero["wrapped"] == "DistributedDataParallel"
    # One decision source: the same moves at the same steps on both ranks.
    moves = [(e["step"], e["action"], e["modules"]) for e in zero["events"] if e["action"] != "guided"]
    assert moves == [(e["step"], e["action"], e["modules"]) for e in one["events"] if e["action"] != "guided"]
    assert [a for _, a, _ in moves][:2] == ["freeze", "unfreeze"], moves
    freeze, unfreeze = moves[0][0], moves[1][0]
    for rank in (zero, one):
        steps = rank["steps"]
        assert [r["step"] for r in steps] == list(range(1, 41))
        # Frozen from step `freeze` to the unfreeze: the first module did not move.
        first = [r["first_module"] for r in steps]
        assert all(torch.equal(first[freeze - 1], w) for w in first[freeze:unfreeze])
        assert not torch.equal(first[freeze - 2], first[freeze - 1]) and not torch.equal(first[unfreeze - 1], first[unfreeze])
        # Each step all-reduced the bytes of the parameters trainable during it: all, fewer
        # while frozen, all again after the unfreeze.
        full = steps[0]["trainable"]
        assert [r["sent"] for r in steps] == [full] + [r["trainable"] for r in steps[:-1]]
        assert steps[freeze - 1]["trainable"] < full and steps[unfreeze - 1]["trainable"] == full
    assert torch.equal(zero["weights"], one["weights"])


def test_parallel_modes_egeria_cannot_freeze_through_are_refused_up_front():
    from types import SimpleNamespace

    state = SimpleNamespace(max_steps=4, global_step=0)
    with pytest.raises(NotImplementedError, match="DataParallel \\(n_gpu=2"):
        EgeriaCallback().on_train_begin(SimpleNamespace(world_size=1, n_gpu=2), state, None, model=gpt2())
    args = SimpleNamespace(world_size=2, n_gpu=1, fsdp="full_shard", fsdp_config={"version": 1}, deepspeed=None)
    with pytest.raises(NotImplementedError, match="does not support FSDP1 \\(TrainingArguments.fsdp='full_shard'.*use FSDP2"):
        EgeriaCallback().on_train_begin(args, state, None, model=gpt2())
    args = SimpleNamespace(world_size=2, n_gpu=1, fsdp=None, deepspeed="ds_config.json")
    with pytest.raises(NotImplementedError, match="does not support deepspeed.*cannot change which parameters train"):
        EgeriaCallback().on_train_begin(args, state, None, model=gpt2())
    args = SimpleNamespace(world_size=2, n_gpu=1, fsdp=None, deepspeed=None)
    with pytest.raises(NotImplementedError, match=r"not handed: call EgeriaCallback.attach\(trainer\)"):
        EgeriaCallback().on_train_begin(args, state, None, model=gpt2())  # no Trainer attached
    bare = gpt2()  # an attached Trainer with no DDP around the model
    callback = EgeriaCallback().attach(fake_trainer(model_wrapped=bare))
    with pytest.raises(NotImplementedError, match="the Trainer wraps it in GPT2LMHeadModel"):
        callback.on_train_begin(args, state, None, model=bare)


def fake_trainer(**attributes):
    """What EgeriaCallback.attach and on_train_begin read of a Trainer, and nothing more."""
    from types import SimpleNamespace

    handler = SimpleNamespace(callbacks=[])
    return SimpleNamespace(callback_handler=handler, add_callback=handler.callbacks.append, **attributes)


def test_attach_adds_the_callback_once_and_refuses_what_is_not_a_trainer(tmp_path):
    callback = EgeriaCallback(static(3))
    trainer, _ = trainer_for(tmp_path, callback, max_steps=1)  # listed in Trainer(callbacks=...)
    assert callback.attach(trainer) is callback and callback.trainer is trainer
    assert sum(c is callback for c in trainer.callback_handler.callbacks) == 1
    late = EgeriaCallback(static(3))
    late.attach(trainer)  # not listed: attach adds it
    assert sum(c is late for c in trainer.callback_handler.callbacks) == 1
    with pytest.raises(ValueError, match="needs a transformers Trainer, got dict"):
        EgeriaCallback().attach({})
    other, _ = trainer_for(tmp_path / "other", EgeriaCallback(static(3)), max_steps=1)
    with pytest.raises(ValueError, match="attached to another Trainer"):
        callback.attach(other)


def test_the_callback_tells_fsdp2_from_ddp_by_the_model_not_by_the_trainers_arguments():
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    # fsdp_config without a version: FSDP2, transformers 5's default. On an accelerator,
    # accelerate shards the model in place; on CPU it wraps the model in DDP whatever
    # `fsdp` says. The callback must hand Egeria what the Trainer really built.
    args = SimpleNamespace(world_size=2, n_gpu=1, fsdp="full_shard", fsdp_config={}, deepspeed=None)
    state = SimpleNamespace(max_steps=4, global_step=0)
    config = egeria.EgeriaConfig(policy="linear")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = gpt2()
        fully_shard(sharded)
        callback = EgeriaCallback(config, log_signals=False)
        callback.on_train_begin(args, state, None, model=sharded, optimizer=torch.optim.SGD(sharded.parameters(), lr=0.1))
        assert callback.egeria.wrapper is sharded and callback.egeria._ddp is None
        callback.egeria.close()
        # Egeria's rule too, reading whole weights that every rank gathers (its save and
        # resume on every rank: tests/test_fsdp.py).
        callback = EgeriaCallback(egeria.EgeriaConfig(), log_signals=False)
        callback.on_train_begin(args, state, None, model=sharded, optimizer=torch.optim.SGD(sharded.parameters(), lr=0.1))
        assert callback.egeria.wrapper is sharded and callback.egeria._whole is not None
        callback.egeria.close()

        bare = gpt2()
        ddp = DistributedDataParallel(bare)
        callback = EgeriaCallback(config, log_signals=False).attach(fake_trainer(model_wrapped=ddp))
        callback.on_train_begin(args, state, None, model=bare, optimizer=torch.optim.SGD(bare.parameters(), lr=0.1))
        assert callback.egeria._ddp is ddp
        callback.egeria.close()
    finally:
        dist.destroy_process_group()


def test_the_integrations_package_imports_without_transformers(monkeypatch):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    monkeypatch.delitem(sys.modules, "egeria.integrations.hf", raising=False)
    importlib.import_module("egeria.integrations")
    with pytest.raises(ImportError, match=r"pip install -e \'\.\[hf\]\' in egeria\'s clone"):
        importlib.import_module("egeria.integrations.hf")


def _tensorboard_events(folder):
    """The scalars and texts of every event file under ``folder``: ({tag: [(step, value)]},
    {tag: [(step, text)]})."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars, texts = {}, {}
    for run in sorted({p.parent for p in folder.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in events.Scalars(tag))
        for tag in events.Tags()["tensors"]:
            texts.setdefault(tag, []).extend((e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag))
    return scalars, texts


def test_egerias_scalars_reach_the_trainers_tensorboard_and_log_history(tmp_path):
    pytest.importorskip("tensorboard")
    callback = EgeriaCallback(static(3))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_strategy="steps", logging_steps=2, report_to="tensorboard", save_strategy="no", use_cpu=True,
        seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    # the user's callback comes after the Trainer's reporters: attached, Egeria moves itself ahead of them
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=Tokens(32), callbacks=[callback])
    callback.attach(trainer)
    trainer.train()
    front = callback.egeria.modules[0]
    logged = [(h["step"], h["egeria/frozen_modules"]) for h in trainer.state.log_history if "loss" in h]
    assert logged == [(2, 0.0), (4, 1.0), (6, 1.0), (8, 1.0)]
    assert all("egeria/frozen_params_share" in h for h in trainer.state.log_history if "loss" in h)
    # the frozen front's optimizer state left the optimizer at the freeze (egeria.memory)
    released = [h["egeria/memory/optimizer_state_released"] > 0 for h in trainer.state.log_history if "loss" in h]
    assert released == [False, True, True, True]
    scalars, texts = _tensorboard_events(tmp_path)
    assert scalars["train/egeria/frozen_modules"] == [(2, 0.0), (4, 1.0), (6, 1.0), (8, 1.0)]
    assert [s for s, _ in scalars["train/egeria/frozen_backward_flops_share"]] == [2, 4, 6, 8]
    reason = callback.egeria.events[0].reason
    assert texts["egeria/decisions/text_summary"] == [(3, f"step 3: freeze {front} ({reason})")]


def test_log_signals_false_leaves_the_trainers_logs_alone(tmp_path):
    callback = EgeriaCallback(static(3), log_signals=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_strategy="steps", logging_steps=2, report_to="none", save_strategy="no", use_cpu=True,
        seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=Tokens(32), callbacks=[callback])
    trainer.train()
    assert not [k for h in trainer.state.log_history for k in h if k.startswith("egeria/")]
    assert [(d.step, d.action) for d in callback.egeria.events] == [(3, "freeze")]


def test_an_unattached_callback_logs_to_log_history_and_warns_that_reporters_miss_its_scalars(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    callback = EgeriaCallback(static(3))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_strategy="steps", logging_steps=2, report_to="tensorboard", save_strategy="no", use_cpu=True,
        seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=Tokens(32), callbacks=[callback])
    with caplog.at_level(logging.WARNING, logger="egeria"):
        trainer.train()
    assert [(h["step"], h["egeria/frozen_modules"]) for h in trainer.state.log_history if "loss" in h] == [(2, 0.0), (4, 1.0)]
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "not the Trainer's reporters ['tensorboard']" in message and "EgeriaCallback.attach(trainer)" in message
    scalars, _ = _tensorboard_events(tmp_path)
    assert "train/egeria/frozen_modules" not in scalars  # the reporter wrote before the callback added them
