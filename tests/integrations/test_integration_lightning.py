"""EgeriaCallback in real Lightning training: tiny.Chain as a LightningModule on CPU, with
gradient accumulation, a checkpoint resume, and 2-process DDP."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install -e '.[lightning]')")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy  # noqa: E402

import egeria  # noqa: E402
import lightning_tasks as lt  # noqa: E402
from egeria.integrations.lightning import EgeriaCallback  # noqa: E402
from tiny import quick_config  # noqa: E402


def _rule() -> egeria.EgeriaConfig:
    """The paper's rule, quick to decide: every step, W = 3, a tolerance as large as the
    first slopes."""
    return quick_config(tolerance_ratio=1.0)


def _fit(callback: EgeriaCallback, *, data_repeats: int, extra: tuple = (), ckpt_path=None, **trainer_kw):
    recorder = lt.Recorder(callback)
    trainer = lt.trainer([callback, recorder, *extra], **trainer_kw)
    task = lt.Task()
    trainer.fit(task, lt.loader(data_repeats), ckpt_path=ckpt_path)
    return trainer, task, recorder


def test_static_policy_freezes_at_its_optimizer_step_under_gradient_accumulation():
    config = egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 3})
    callback = EgeriaCallback(config)
    # 20 batches, 2 per optimizer step: 10 steps.
    trainer, task, rec = _fit(callback, data_repeats=10, accumulate=2, max_epochs=1)
    eg = callback.egeria
    assert trainer.global_step == eg.steps == 10
    assert [(e.step, e.action, e.modules) for e in eg.events] == [(3, "freeze", ("stem.0",))]
    # Egeria counted each optimizer step once, at the batch that ended it.
    assert [(g, s) for g, s, *_ in rec.steps] == [(s, s) for s in range(1, 11)]
    assert [f for _, _, f, *_ in rec.steps] == [[]] * 2 + [["stem.0"]] * 8
    # SGD with momentum and weight decay left the frozen weights bit-identical; the rest trained.
    assert rec.final["frozen_unchanged_to_end"] is True
    assert not torch.equal(rec.at_freeze[0]["weights"], rec.final["weights"])
    # on_train_end closed Egeria: every parameter trains again.
    assert all(p.requires_grad for p in task.parameters())


def test_checkpoint_resume_restores_the_frozen_set_and_continues_as_the_uninterrupted_run(tmp_path):
    settings = dict(data_repeats=16, accumulate=2)  # 16 optimizer steps per epoch
    torch.manual_seed(0)
    whole = EgeriaCallback(_rule())
    trainer, _, rec_whole = _fit(whole, max_epochs=4, **settings)
    assert trainer.global_step == whole.egeria.steps == 64
    freezes = [e.step for e in whole.egeria.events if e.action == "freeze"]
    assert freezes and freezes[0] <= 32  # something froze before the checkpoint below

    torch.manual_seed(0)
    first = EgeriaCallback(_rule())
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)  # one checkpoint per epoch
    _, _, recorder = _fit(first, max_epochs=2, extra=(saver,), enable_checkpointing=True, **settings)
    frozen_at_checkpoint = [f for g, _, f, *_ in recorder.steps if g == 32][0]
    assert frozen_at_checkpoint
    checkpoint = tmp_path / "epoch=1-step=32.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["callbacks"]["EgeriaCallback"]
    assert saved["frozen"] == len(frozen_at_checkpoint) and saved["steps"] == 32

    torch.manual_seed(123)  # other initial weights: the checkpoint must bring them back
    resumed = EgeriaCallback(_rule())
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)  # the same callback, so Lightning restores it too
    trainer, _, rec = _fit(
        resumed, max_epochs=4, extra=(saver,), enable_checkpointing=True, ckpt_path=str(checkpoint), **settings
    )
    assert rec.started == (32, 32, frozen_at_checkpoint)  # restored before the first resumed step
    assert trainer.global_step == resumed.egeria.steps == 64
    assert all(g == s for g, s, *_ in rec.steps)
    # The same decisions and the same weights as the run that was never interrupted.
    assert resumed.egeria.events == whole.egeria.events
    assert torch.equal(rec.final["weights"], rec_whole.final["weights"])


def test_ddp_two_ranks_stay_bit_identical_through_a_freeze_and_an_unfreeze(tmp_path):
    # ddp_fork: the ranks are forks of this process (no re-import, no re-launch of pytest).
    # One intra-op thread: an OpenMP pool that ran before a fork deadlocks in the child.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    callback = EgeriaCallback(_rule())
    recorder = lt.Recorder(callback, drop_lr_after=4, out=str(tmp_path))  # a 10x LR drop 4 steps after the freeze
    trainer = lt.trainer([callback, recorder], accumulate=2, max_epochs=4, devices=2, strategy="ddp_fork")
    trainer.fit(lt.Task(), lt.loader(64, samples=16))  # 16 samples: each rank sees its own fixed batch
    zero, one = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))

    # One decision source: the same moves at the same steps on both ranks.
    moves = [(e["step"], e["action"], e["modules"]) for e in zero["events"] if e["action"] != "guided"]
    assert moves == [(e["step"], e["action"], e["modules"]) for e in one["events"]]
    assert [a for _, a, _ in moves][:2] == ["freeze", "unfreeze"]
    for rank in (zero, one):
        assert rank["global_step"] == 64 and [(g, s) for g, s, *_ in rank["steps"]] == [(s, s) for s in range(1, 65)]
        # Frozen weights did not move on any rank until the unfreeze.
        assert [u["frozen_unchanged"] for u in rank["at_unfreeze"]] == [True]
        # Each step all-reduced exactly the bytes of the parameters trainable during it:
        # all, then fewer while frozen, then all again after the unfreeze.
        sent = [s for *_, s, _ in rank["steps"]]
        trainable = [t for *_, t in rank["steps"]]
        full = trainable[0]
        assert sent == [full] + trainable[:-1]
        freeze, unfreeze = rank["at_freeze"][0]["step"], rank["at_unfreeze"][0]["step"]
        assert trainable[freeze - 1] < full and trainable[unfreeze - 1] == full
    # Replicas bit-identical after the freeze, after the unfreeze and at the end.
    for a, b in zip(zero["at_freeze"] + zero["at_unfreeze"], one["at_freeze"] + one["at_unfreeze"], strict=True):
        assert torch.equal(a["weights"], b["weights"])
    assert torch.equal(zero["final"]["weights"], one["final"]["weights"])


def test_strategies_that_shard_or_replace_parameters_are_refused_before_training_and_fsdp2_is_not():
    callback = EgeriaCallback()
    for kind, reason in ((FSDPStrategy, r"it wraps .*\(FSDP1\).*ModelParallelStrategy\(\) with fully_shard"),
                         (DeepSpeedStrategy, "DeepSpeed cannot change which parameters train")):
        trainer = SimpleNamespace(strategy=object.__new__(kind))
        with pytest.raises(NotImplementedError, match=f"does not support {kind.__name__}: {reason}"):
            callback.setup(trainer, None, "fit")
    callback.setup(SimpleNamespace(strategy=object.__new__(ModelParallelStrategy)), None, "fit")  # FSDP2: accepted


def test_the_network_must_be_named_when_it_is_not_the_only_child_with_parameters():
    class TwoNets(lt.Task):
        def __init__(self):
            super().__init__()
            self.critic = torch.nn.Linear(3, 1)

    callback = EgeriaCallback(quick_config())
    with pytest.raises(ValueError, match=r"has \['net', 'critic'\]; name the network"):
        lt.trainer([callback], max_steps=1).fit(TwoNets(), lt.loader(1))
    callback = EgeriaCallback(quick_config(), module="body")
    with pytest.raises(ValueError, match=r"module='body'\): Task has no such submodule; its children are \['net'\]"):
        lt.trainer([callback], max_steps=1).fit(lt.Task(), lt.loader(1))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"module": ""}, "module=''"), ({"total_steps": 0}, "total_steps=0"), ({"config": {"window": 3}}, "EgeriaConfig"),
     ({"log_signals": 1}, "log_signals=1 must be True or False")],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EgeriaCallback(**kwargs)


def test_the_integrations_package_imports_without_lightning_and_the_adapter_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "egeria.integrations.lightning")
    monkeypatch.delitem(sys.modules, "egeria.integrations")
    importlib.import_module("egeria.integrations")
    with pytest.raises(ImportError, match=r"pip install -e \'\.\[lightning\]\' in egeria\'s clone"):
        importlib.import_module("egeria.integrations.lightning")


def test_egerias_scalars_and_decisions_reach_lightnings_tensorboard_logger(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 3})
    callback = EgeriaCallback(config)
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="run", version=0)
    # 8 batches, one optimizer step each; Lightning writes step metrics every 2 batches
    _fit(callback, data_repeats=4, accumulate=1, max_epochs=1, logger=logger, log_every_n_steps=2)
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    frozen = [(e.step, e.value) for e in events.Scalars("egeria/frozen_modules")]
    # Lightning numbers a logged step from 0 (the batch after 1 optimizer step is step 1)
    assert frozen == [(1, 0.0), (3, 1.0), (5, 1.0), (7, 1.0)]
    assert [e.step for e in events.Scalars("egeria/frozen_params_share")] == [1, 3, 5, 7]
    released = [(e.step, e.value > 0) for e in events.Scalars("egeria/memory/optimizer_state_released")]
    assert released == [(1, False), (3, True), (5, True), (7, True)]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("egeria/decisions/text_summary")]
    assert texts == [(3, f"step 3: freeze stem.0 ({callback.egeria.events[0].reason})")]


@pytest.mark.parametrize("log_signals", [True, False])
def test_log_signals_false_logs_nothing_of_egerias(tmp_path, log_signals):
    from lightning.pytorch.loggers import CSVLogger

    config = egeria.EgeriaConfig(policy="static", policy_options={"count": 1, "at_step": 3})
    callback = EgeriaCallback(config, log_signals=log_signals)
    logger = CSVLogger(save_dir=str(tmp_path), name="run", version=0)
    _fit(callback, data_repeats=4, accumulate=1, max_epochs=1, logger=logger, log_every_n_steps=2)
    logged = tmp_path / "run" / "version_0" / "metrics.csv"
    assert (logged.exists() and "egeria/frozen_modules" in logged.read_text()) is log_signals
    assert [(d.step, d.action) for d in callback.egeria.events] == [(3, "freeze")]
