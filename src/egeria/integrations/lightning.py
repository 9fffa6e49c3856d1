"""Egeria in PyTorch Lightning: a ``Callback`` that freezes converged front layer modules.

Usage (``pip install -e ".[lightning]"`` in egeria's clone)::

    import lightning.pytorch as pl
    from egeria.integrations.lightning import EgeriaCallback

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_network()          # the part Egeria splits and freezes

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)
        ...

    trainer = pl.Trainer(max_epochs=10, callbacks=[EgeriaCallback(module="net")])
    trainer.fit(Classifier(), loader)           # ckpt_path=... resumes the frozen set too

Where each piece runs, in Lightning's hooks::

    setup("fit")           refuses strategies Egeria cannot freeze through (FSDPStrategy, which is
                           FSDP1, DeepSpeed, XLA)
    on_train_start         Egeria(trainer.strategy.model, trainer.optimizers[0], module=net,
                           total_steps=trainer.estimated_stepping_batches, lr_scheduler=...);
                           a checkpoint's Egeria state is applied here, after Lightning
                           restored the model, the optimizer and the loops
    on_train_batch_end     eg.step(outputs["loss"]): every batch; only batches that end in an
                           optimizer step count (accumulate_grad_batches, skipped AMP steps);
                           at Lightning's logging steps, eg.metrics() through pl_module.log_dict,
                           and each decision as text to a logger that takes text
    state_dict             Egeria's state, saved in the checkpoint under "EgeriaCallback"
    on_train_end           eg.close(): hooks removed, frozen modules trainable again
    on_exception           eg.close(unfreeze=False)

Egeria gets the object Lightning trains (under ``strategy="ddp"`` the
``DistributedDataParallel`` wrapper), so it rebuilds that wrapper in place at every freeze
and unfreeze: frozen parameters leave the all-reduce, and unfrozen ones rejoin it (the
bug of Lightning's ``BackboneFinetuning`` under DDP, Lightning issue 20340, does not
arise). Under DDP rank 0 decides and every rank applies its moves at the same step; the
checkpoint holds rank 0's state; on resume rank 0 decides whether to load it and sends
what it loaded to every rank, so the ranks never resume different frozen sets.

Under ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` applied in ``configure_model``)
Egeria freezes through the shards (:mod:`egeria.distributed`; no wrapper to rebuild), with
Egeria's rule (which reads whole weights every rank gathers: Lightning saves and loads
the callback's state on every rank) or a policy that decides from the step; its
checkpoints hold rank 0's Egeria state and rank 0's model buffers on every rank.
Lightning's ``FSDPStrategy`` wraps with FSDP1 and is refused, as DeepSpeed is, with the
reason.

Signals: Egeria's scalars (:meth:`egeria.Egeria.metrics`, names under ``egeria/``) go to
every logger of the Trainer through ``pl_module.log_dict`` at the steps Lightning logs
(``log_every_n_steps``), and each freeze or unfreeze as a text event to the loggers whose
``experiment`` has ``add_text`` (TensorBoard's); ``EgeriaCallback(log_signals=False)``
logs nothing.

``module`` names the network inside the LightningModule (``get_submodule`` path): Lightning
calls the LightningModule with ``(batch, batch_idx)``, while Egeria's controller must run
the network on its inputs. Left out, the LightningModule's only child holding parameters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ..averaging import WeightAverage
from ..checkpoint.saved_state import without_policy_state
from ..config import EgeriaConfig
from ..decision import Decision
from ..engine import Egeria
from ..knowledge.unfreezing import UnfreezeRule
from ..policies import FreezePolicy
from ..signals import PREFIX, decision_text

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as err:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "egeria.integrations.lightning needs PyTorch Lightning: pip install -e '.[lightning]' in egeria's clone"
    ) from err

__all__ = ["EgeriaCallback"]

logger = logging.getLogger(__name__)

# Strategies that shard or replace the model's parameters in ways Egeria cannot freeze
# (DeepSpeed and XLA subclass DDP), each with the reason. ModelParallelStrategy is FSDP2:
# the user's configure_model calls fully_shard, which Egeria works through.
_UNSUPPORTED = {
    "FSDPStrategy": "it wraps the model in FullyShardedDataParallel (FSDP1), whose flat parameters need one "
    "requires_grad each, so a frozen set cannot change mid-run; use strategy=ModelParallelStrategy() with "
    "fully_shard (FSDP2) in configure_model, or strategy='ddp'",
    "DeepSpeedStrategy": "DeepSpeed cannot change which parameters train after it is initialised; use strategy='ddp' "
    "or ModelParallelStrategy with fully_shard",
    "XLAStrategy": "Egeria freezes parameters of a model on CPU or CUDA devices; use strategy='ddp'",
    "SingleDeviceXLAStrategy": "Egeria freezes parameters of a model on CPU or CUDA devices; use a single CPU or GPU",
}


def _model_parallel() -> type:
    """Lightning's FSDP2 strategy (``ModelParallelStrategy``), or a stand-in class where
    this Lightning lacks it."""
    try:
        from lightning.pytorch.strategies import ModelParallelStrategy
    except ImportError:
        return type("NoModelParallelStrategy", (), {})
    return ModelParallelStrategy


class EgeriaCallback(pl.Callback):
    """Runs :class:`egeria.Egeria` on the network of a LightningModule while it trains.

    Args:
        config: Egeria's hyperparameters; :class:`~egeria.EgeriaConfig` defaults when None.
        module: the network inside the LightningModule, as a ``get_submodule`` path
            (``"net"``, ``"model.backbone"``); None: its only child that holds parameters.
        total_steps: optimizer steps of the run; None: ``trainer.estimated_stepping_batches``.
        policy: a freezing policy object (see :mod:`egeria.policies`), as for ``Egeria``.
        unfreeze_rule: replaces the default learning-rate-drop unfreeze rule.
        on_change: called with every :class:`~egeria.Decision` as it is applied.
        log_signals: log Egeria's scalars and decisions to the Trainer's loggers.
        average: freeze each module to the average of its recent weights
            (:class:`~egeria.WeightAverage`), as for ``Egeria``.

    Attributes:
        egeria: the running :class:`~egeria.Egeria` (from ``on_train_start``; after
            training its ``events`` and ``history`` stay readable), else None.

    Raises:
        ValueError: a bad argument, naming it.
    """

    def __init__(
        self,
        config: EgeriaConfig | None = None,
        *,
        module: str | None = None,
        total_steps: int | None = None,
        policy: FreezePolicy | None = None,
        unfreeze_rule: UnfreezeRule | None = None,
        on_change: Callable[[Decision], Any] | None = None,
        log_signals: bool = True,
        average: WeightAverage | None = None,
    ) -> None:
        if not isinstance(log_signals, bool):
            raise ValueError(f"log_signals={log_signals!r} must be True or False")
        if config is not None and not isinstance(config, EgeriaConfig):
            raise ValueError(f"config must be an EgeriaConfig, got {type(config).__name__}")
        if module is not None and (not isinstance(module, str) or not module):
            raise ValueError(f"module={module!r} must name a submodule of the LightningModule, e.g. module='net'")
        if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
            raise ValueError(f"total_steps={total_steps!r} must be a positive integer")
        self.config = config
        self.module = module
        self.total_steps = total_steps
        self.log_signals = log_signals
        self._options = dict(policy=policy, unfreeze_rule=unfreeze_rule, on_change=on_change, average=average)
        self.egeria: Egeria | None = None
        self._live = False  # self.egeria is open
        self._pending: dict | None = None  # a checkpoint's state, applied at on_train_start
        self._state: dict = {}  # the last state, saved while no Egeria runs

    # -- life cycle ----------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuses, before any training, a strategy Egeria cannot freeze through."""
        if stage != "fit":
            return
        strategy = trainer.strategy
        reason = next((_UNSUPPORTED[c.__name__] for c in type(strategy).__mro__ if c.__name__ in _UNSUPPORTED), None)
        if reason is None and not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, _model_parallel())):
            reason = (
                "Egeria freezes parameters of a replicated model or one sharded with fully_shard; use a single "
                "device, strategy='ddp' (or 'ddp_spawn') or ModelParallelStrategy with fully_shard"
            )
        if reason is not None:
            raise NotImplementedError(f"EgeriaCallback does not support {type(strategy).__name__}: {reason}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Builds Egeria over the strategy's model, then applies a checkpoint's state."""
        self._close()  # a previous fit's
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"EgeriaCallback needs exactly one optimizer, got {len(trainer.optimizers)}; "
                "return one from configure_optimizers"
            )
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        self.egeria = Egeria(
            trainer.strategy.model,
            trainer.optimizers[0],
            config=self.config,
            module=self._network(pl_module),
            total_steps=self.total_steps or _known_steps(trainer.estimated_stepping_batches),
            lr_scheduler=schedulers[0] if schedulers else None,
            **self._options,
        )
        self._live = True
        # Rank 0 decides whether and what to resume; the other ranks load what it loaded
        # (all but the policy's state, which only rank 0 runs).
        eg = self.egeria
        pending = self._pending if eg._decides else None
        shared = eg._from_rank0(None if not pending else without_policy_state(pending), "EgeriaCallback's resume")
        if shared:
            eg.load_state_dict(pending if eg._decides else shared)
            logger.info("Egeria resumed at step %d with %s frozen", eg.steps, eg.frozen)
        self._pending = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """A step boundary when an optimizer step ended this batch (Egeria checks)."""
        if not self._live:
            return
        assert self.egeria is not None
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        decisions = self.egeria.step(loss if isinstance(loss, torch.Tensor) else None)
        if self.log_signals and trainer.loggers:
            self._log_signals(trainer, pl_module, decisions)

    def _log_signals(self, trainer: pl.Trainer, pl_module: pl.LightningModule, decisions: list[Decision]) -> None:
        """Egeria's scalars at Lightning's logging steps, the decisions as text at once."""
        assert self.egeria is not None
        if trainer.is_global_zero:
            for logger_ in trainer.loggers:
                add_text = getattr(getattr(logger_, "experiment", None), "add_text", None)
                for decision in decisions if callable(add_text) else ():
                    add_text(PREFIX + "decisions", decision_text(decision), global_step=trainer.global_step)
        # The logger connector's own test of whether this batch's step metrics are written
        # (every log_every_n_steps); without it, every batch (Lightning keeps the last).
        if getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", True):
            pl_module.log_dict(self.egeria.metrics(), on_step=True, on_epoch=False, logger=True, prog_bar=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keeps Egeria's last state (for a checkpoint saved after training) and closes it."""
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Closes Egeria, leaving the frozen modules frozen: unfreezing would rebuild DDP, a
        collective, while other ranks may be failing."""
        self._close(unfreeze=False, keep_state=False)

    # -- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Egeria's state (JSON-safe); under DDP rank 0's is the one Lightning saves, and
        under FSDP2 every rank returns rank 0's (each rank writes its part of the checkpoint
        there, and which rank's copy of a value every rank holds is kept is the writer's
        choice). Lightning calls it on every rank."""
        if self._live and self.egeria is not None and self.egeria.steps > 0:
            return self._rank0s(self.egeria.state_dict())
        return dict(self._pending or self._state)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Under FSDP2: the checkpoint's model buffers are rank 0's (copies; FSDP2 never
        synchronises buffers, and the checkpoint keeps one rank's copy), so that a resumed
        rank 0 reads as the uninterrupted one did."""
        ranks = self._fsdp2_ranks()
        if ranks is not None and isinstance(checkpoint.get("state_dict"), dict):
            checkpoint["state_dict"] = ranks.with_rank0_buffers(checkpoint["state_dict"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keeps a checkpoint's state until ``on_train_start`` (Egeria does not exist yet)."""
        self._pending = dict(state_dict) or None

    # -- helpers --------------------------------------------------------------------

    def _network(self, pl_module: pl.LightningModule) -> nn.Module:
        """The network Egeria splits and freezes (see ``module``)."""
        if self.module is not None:
            try:
                return pl_module.get_submodule(self.module)
            except AttributeError:
                names = [n for n, _ in pl_module.named_children()]
                raise ValueError(
                    f"EgeriaCallback(module={self.module!r}): {type(pl_module).__name__} has no such submodule; "
                    f"its children are {names}"
                ) from None
        holders = [(n, c) for n, c in pl_module.named_children() if next(c.parameters(), None) is not None]
        if len(holders) != 1:
            raise ValueError(
                f"EgeriaCallback(module=None) needs a LightningModule with one child holding parameters, "
                f"{type(pl_module).__name__} has {[n for n, _ in holders]}; name the network, e.g. module='net'"
            )
        return holders[0][1]

    def _fsdp2_ranks(self) -> Any:
        """The run's ranks under FSDP2 (egeria.distributed.Ranks), else None."""
        return None if self.egeria is None else self.egeria._fsdp2_ranks

    def _rank0s(self, state: dict) -> dict:
        """Rank 0's ``state`` on every rank under FSDP2 (every rank must call it); ``state`` otherwise."""
        ranks = self._fsdp2_ranks()
        return state if ranks is None else ranks.from_leader(state if ranks.leader else None, "EgeriaCallback.state_dict()")

    def _close(self, *, unfreeze: bool = True, keep_state: bool = True) -> None:
        if self._live and self.egeria is not None:
            if keep_state and self.egeria.steps > 0:
                self._state = self._rank0s(self.egeria.state_dict())
            self.egeria.close(unfreeze=unfreeze)
        self._live = False


def _known_steps(estimated: float | int) -> int | None:
    """``trainer.estimated_stepping_batches`` when it is a length (not inf or -1)."""
    if isinstance(estimated, float) and not math.isfinite(estimated):
        return None
    return int(estimated) if estimated >= 1 else None
