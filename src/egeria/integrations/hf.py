"""Egeria in the Hugging Face ``Trainer``: :class:`EgeriaCallback` (``pip install -e ".[hf]"`` in egeria's clone).

Usage::

    from egeria import EgeriaConfig
    from egeria.integrations.hf import EgeriaCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)
    callback = EgeriaCallback(config=EgeriaConfig()).attach(trainer)   # the one added line
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)
    print(callback.egeria.events)        # what froze when

:meth:`EgeriaCallback.attach` adds the callback to the Trainer (unless it is in its
``callbacks`` already) and hands it the Trainer: the callback takes from it what the
events do not carry, the Trainer's callback list (to go ahead of its reporters), its
``DistributedDataParallel`` under ``torchrun`` and, with ``EgeriaCallback(cache=True)``,
its training data loader (see "The activation cache" below). A callback only passed in
``Trainer(callbacks=[...])`` and never attached still freezes in one process; its scalars
then reach ``trainer.state.log_history`` but not the reporters (a warning says so), and
under ``torchrun`` or with the cache it raises an error that names ``attach``.

Where the Trainer's events fire and what the callback does there::

    trainer.train(resume_from_checkpoint=ckpt)
        model weights loaded from ckpt
        optimizer and scheduler created, their state loaded from ckpt
        on_train_begin -> Egeria(model, optimizer, lr_scheduler=..., total_steps=state.max_steps);
                          resuming: Egeria's state loaded from ckpt/egeria.json + egeria-<id>.pt
        for each optimizer step (gradient_accumulation_steps micro-batches):
            forward (Egeria keeps output.loss), backward       # per micro-batch
            optimizer.step(); lr_scheduler.step()
            on_step_end    -> eg.step(): modules freeze or unfreeze here
            checkpoint-N/ saved; on_save -> checkpoint-N/egeria.json + egeria-<id>.pt written
        on_log         -> eg.metrics() added to the logs the Trainer's reporters write
        on_train_end   -> eg.close(): hooks removed, frozen modules trainable again

Signals: at each of the Trainer's logging steps the callback adds Egeria's scalars
(:meth:`egeria.Egeria.metrics`: frozen modules, their share of parameters and backward FLOPs,
each module's latest plasticity, readings sent/answered/dropped/late, Egeria's share of the
step time; names under ``egeria/``) to the training logs, so every reporter of
``report_to`` (TensorBoard, W&B, MLflow, ...) and ``trainer.state.log_history`` get them;
each decision goes to TensorBoard as a text event when it reports there. The reporters
run in the order of the Trainer's callbacks, before a user's, so an attached callback moves
itself ahead of them when training begins. ``EgeriaCallback(log_signals=False)`` leaves the logs
alone.

The activation cache: ``EgeriaCallback(cache=True)`` (or a dict of
:meth:`egeria.Egeria.cache_keyed_batches` options: ``memory_limit``, ``disk_limit``,
``directory``, ``storage_dtype``, ``serve``), attached to the Trainer, skips the frozen
prefix's forward pass as ``eg.cache_loader`` does in a plain loop: each sample's output at
the prefix's end is stored the first time it is computed and served after
(:mod:`egeria.cache`). ``attach`` wraps the Trainer's ``get_train_dataloader`` (its own or a
subclass's): the Trainer builds its loader as always (its sampler and shuffling, its
``data_collator``) over the training data whose items carry their sample keys, and the
collate function adds the keys to each batch; a hook run before any other takes them out
before the model sees the batch (:mod:`egeria.cache.batchkeys`). The items must be dicts
(the Trainer's ``model(**batch)``) of one shape per sample: pad every batch to one length
(a collator that pads to each batch's longest turns the cache off with a warning). Data
that is not map-style, or whose items are random, is trained without the cache, with a
warning. Cached outputs are not saved in checkpoints: a resumed run rebuilds them.

Steps are counted from the optimizer, so they match ``state.global_step`` (less the steps
a ``GradScaler`` skipped under fp16). The loss Egeria reads is the mean ``loss`` of the
model's outputs over each step's micro-batches. A callback does not see the folder
``train(resume_from_checkpoint=...)`` names, so a resumed run looks for Egeria's state, in
this order, in ``EgeriaCallback(resume_from=...)``, ``args.resume_from_checkpoint``,
``args.output_dir/checkpoint-{global_step}`` (where the Trainer saved it), and takes the
first whose saved step is the resumed ``global_step``; with none, Egeria starts afresh with
a warning that names the folders it tried.

Under ``torchrun`` (DDP) the Trainer hands callbacks the bare model, so the callback takes
the Trainer's ``DistributedDataParallel`` around it from the attached Trainer
(``trainer.model_wrapped``, checked to wrap that model) and gives Egeria both: rank 0
decides, every rank applies its moves at the same step,
and the wrapper is rebuilt in place at each freeze and unfreeze so frozen parameters leave
the all-reduce (see :mod:`egeria.distributed`). Rank 0 writes Egeria's state into the
checkpoint; on resume rank 0 alone finds and reads it and sends it to the other ranks, so
every rank resumes the same frozen set even where only rank 0 sees the folder.

Under the Trainer's FSDP2 (``TrainingArguments(fsdp=...)`` with ``fsdp_config`` version 2,
the default of transformers 5, or an accelerate config that asks for it: accelerate shards
the model in place with ``fully_shard``) the callback hands Egeria the sharded model. It
tells FSDP2 from DDP by the model itself, not by the arguments: accelerate shards only on
accelerators and wraps a CPU run in DDP whatever ``fsdp`` says. Under FSDP2 frozen
parameters leave the reduce-scatter (:mod:`egeria.distributed`). Egeria's rule reads whole
weights there, which every rank gathers: the Trainer calls ``on_save`` on every rank, so
every rank makes Egeria's state and the saving rank writes it; on resume rank 0 reads the
file and sends it, and every rank loads it at once (or every rank refuses it). Refused up
front, with the reason:
FSDP1 (``fsdp_config`` version 1: flat parameters cannot freeze in part), DeepSpeed (it
cannot change which parameters train after it starts) and ``DataParallel`` (several GPUs in
one process).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..cache.batchkeys import KeyedCollate, KeyedItems, keyed_items_reason
from ..cache.datasets import random_reason
from ..checkpoint.saved_state import without_policy_state
from ..checkpoint.serialization import STATE_FILE as _EGERIA_FILE
from ..checkpoint.serialization import read_state, saved_steps, write_state
from ..config import EgeriaConfig
from ..engine import Egeria
from ..signals import PREFIX, decision_text
from ..wrappers import fsdp2_in

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "egeria.integrations.hf needs transformers and accelerate: pip install -e '.[hf]' in egeria's clone"
    ) from err

__all__ = ["EgeriaCallback", "STATE_FILE"]

logger = logging.getLogger(__name__)

STATE_FILE = _EGERIA_FILE  # egeria.json, beside egeria-<id>.pt (Egeria.save)
# Egeria arguments the callback passes itself, taken from the Trainer.
_FROM_TRAINER = ("model", "optimizer", "lr_scheduler", "total_steps", "example_inputs")
_ALLOWED = ("unfreeze_rule", "policy", "on_change", "average")
# EgeriaCallback(cache={...}): the options of Egeria.cache_keyed_batches.
_CACHE_OPTIONS = ("memory_limit", "disk_limit", "directory", "storage_dtype", "serve")


class EgeriaCallback(TrainerCallback):
    """Freezes converged front layer modules of the model a ``Trainer`` trains.

    Args:
        config: Egeria's hyperparameters (:class:`~egeria.EgeriaConfig` defaults when None).
        resume_from: the checkpoint folder a resumed ``train()`` restores from, when it is
            neither ``args.resume_from_checkpoint`` nor under ``args.output_dir``.
        log_signals: add Egeria's scalars to the Trainer's training logs (and its decisions
            to TensorBoard as text) at the Trainer's logging steps.
        **egeria_kwargs: further :class:`~egeria.Egeria` arguments: ``unfreeze_rule``,
            ``policy``, ``on_change`` or ``average``. The model, optimizer, scheduler and the number of
            steps come from the Trainer.

    Attributes:
        egeria: the :class:`~egeria.Egeria` of the current (or last) ``train()`` call;
            None before training begins.

    Raises:
        ValueError: ``config`` is not an EgeriaConfig, or an argument is unknown or one the
            Trainer supplies.
    """

    def __init__(self, config: EgeriaConfig | None = None, *, resume_from: str | os.PathLike[str] | None = None,
                 log_signals: bool = True, cache: bool | dict = False, **egeria_kwargs: Any) -> None:
        if config is not None and not isinstance(config, EgeriaConfig):
            raise ValueError(f"EgeriaCallback(config=...) must be an EgeriaConfig, got {type(config).__name__}")
        supplied = sorted(k for k in egeria_kwargs if k in _FROM_TRAINER)
        if supplied:
            raise ValueError(f"EgeriaCallback takes {supplied} from the Trainer; do not pass them")
        unknown = sorted(k for k in egeria_kwargs if k not in _ALLOWED)
        if unknown:
            raise ValueError(f"EgeriaCallback got unknown arguments {unknown}; it accepts config and {list(_ALLOWED)}")
        if not isinstance(log_signals, bool):
            raise ValueError(f"EgeriaCallback(log_signals=...) must be True or False, got {log_signals!r}")
        if not isinstance(cache, (bool, dict)):
            raise ValueError(f"EgeriaCallback(cache=...) must be True, False or a dict of cache options, got {cache!r}")
        odd = sorted(set(cache) - set(_CACHE_OPTIONS)) if isinstance(cache, dict) else []
        if odd:
            raise ValueError(f"EgeriaCallback(cache=...) got unknown cache options {odd}; it accepts {list(_CACHE_OPTIONS)}")
        self.cache_options: dict | None = (dict(cache) if isinstance(cache, dict) else {}) if cache is not False else None
        self._keyed: KeyedItems | None = None  # the training data of the loader the Trainer made last
        self.config = config
        self.resume_from = resume_from
        self.log_signals = log_signals
        self._reporters: list[Any] = []
        self.trainer: Any = None  # the attached Trainer (EgeriaCallback.attach), or None
        self.egeria_kwargs = egeria_kwargs
        self.egeria: Egeria | None = None

    def attach(self, trainer: Any) -> EgeriaCallback:
        """Hands the callback its ``Trainer`` and adds it to the Trainer's callbacks unless
        it is there already; returns the callback. Call it once per Trainer, before
        ``trainer.train()``.

        Raises:
            ValueError: ``trainer`` is not a Hugging Face ``Trainer`` (it has no callback
                handler), or another Trainer was attached before.
        """
        handler = getattr(trainer, "callback_handler", None)
        if handler is None or not hasattr(handler, "callbacks"):
            raise ValueError(f"EgeriaCallback.attach needs a transformers Trainer, got {type(trainer).__name__}")
        attached = self.trainer
        if attached is not None and attached is not trainer:
            raise ValueError("EgeriaCallback.attach: this callback is attached to another Trainer; make one callback per Trainer")
        if not any(c is self for c in handler.callbacks):
            trainer.add_callback(self)
        if self.cache_options is not None and attached is None:
            made = trainer.get_train_dataloader  # the Trainer's method, or the user's override of it
            trainer.get_train_dataloader = lambda: self._keyed_loader(trainer, made)
        self.trainer = trainer
        return self

    def _keyed_loader(self, trainer: Any, made: Any) -> Any:
        """The Trainer's training loader, made by ``made`` over the training data whose
        items carry their cache keys, its collate function adding them to each batch
        (:mod:`egeria.cache.batchkeys`): the sampler, its shuffling and the collation are
        the Trainer's own. Where the data cannot be keyed (or its items are random), the
        loader as the Trainer makes it, with a warning."""
        dataset = trainer.train_dataset
        self._keyed = None
        reason = keyed_items_reason(dataset) or random_reason(dataset)
        if reason is not None:
            logger.warning("Egeria: not caching activations: %s", reason)
            return made()
        keyed = KeyedItems(dataset)
        trainer.train_dataset = keyed  # only while the Trainer builds its loader over it
        try:
            loader = made()
        finally:
            trainer.train_dataset = dataset
        base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard holds a DataLoader
        if not callable(getattr(base, "collate_fn", None)):
            logger.warning("Egeria: not caching activations: the Trainer's loader (%s) has no collate_fn", type(loader).__name__)
            return loader
        base.collate_fn = KeyedCollate(base.collate_fn)
        self._keyed = keyed
        return loader

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Builds Egeria over the Trainer's model and optimizer; on resume, loads its state
        (the Trainer has restored the model, optimizer and scheduler by now)."""
        _check_parallelism(args)
        trainer = self.trainer
        if self.cache_options is not None and trainer is None:
            raise ValueError(
                "EgeriaCallback(cache=...) caches through the Trainer's training loader, which callbacks are not "
                "handed: call EgeriaCallback.attach(trainer) before train()"
            )
        if self.egeria is not None:  # an earlier train() call
            self.egeria.close()
        model = kwargs["model"]
        # Under FSDP2 the model is sharded in place (no wrapper); under DDP the Trainer's wrapper is taken.
        distributed = getattr(args, "world_size", 1) > 1 and not fsdp2_in(model)
        trained = _trainer_ddp(trainer, model) if distributed else model
        self.egeria = Egeria(
            trained,
            kwargs["optimizer"],  # Egeria finds the torch optimizer inside accelerate's wrapper
            module=model if trained is not model else None,
            config=self.config,
            lr_scheduler=kwargs.get("lr_scheduler"),
            total_steps=state.max_steps,
            **self.egeria_kwargs,
        )
        if state.global_step > 0:
            self._resume(args, state)
        if self._keyed is not None:  # a loader made by _keyed_loader for this train() call
            self.egeria.cache_keyed_batches(self._keyed.rows, **self.cache_options)
        if self.log_signals:
            self._reporters = _go_before_reporters(self, trainer, args)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After each optimizer step (and the scheduler's): Egeria's step boundary."""
        if self.egeria is not None:
            decisions = self.egeria.step()
            if self.log_signals and decisions and state.is_world_process_zero:
                for writer in (getattr(r, "tb_writer", None) for r in self._reporters):
                    for decision in decisions if writer is not None else ():
                        writer.add_text(PREFIX + "decisions", decision_text(decision), global_step=decision.step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """Adds Egeria's scalars to a training log (not an evaluation's, not the summary) before the
        reporters write it, and to the entry the Trainer keeps in ``state.log_history``."""
        if not self.log_signals or self.egeria is None or logs is None:
            return
        if "loss" not in logs:  # an evaluation's logs, or the run's summary
            return
        signals = self.egeria.metrics()
        logs.update(signals)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(signals)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Writes Egeria's state into the checkpoint folder the Trainer just saved (the
        Trainer calls this on every rank; the ranks that save write it)."""
        eg = self.egeria
        # Under FSDP2 Egeria's rule makes its state from whole weights, and the averages are
        # saved whole, which every rank gathers.
        if eg is None or not (args.should_save or eg._state_is_collective):
            return
        made = eg.state_dict()
        if not args.should_save:
            return
        folder = _checkpoint_dir(args, state)
        if not os.path.isdir(folder):
            logger.warning("no checkpoint folder %s: Egeria's state was not saved", folder)
            return
        try:
            write_state(made, folder)  # egeria.json + egeria-<id>.pt, each written atomically
        except OSError as err:  # a full disk, a folder gone: the training and the Trainer's checkpoint go on
            logger.warning(
                "Egeria's state was not saved in %s (%s); training goes on, and a resume from this checkpoint starts "
                "Egeria afresh", folder, err,
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Removes Egeria's hooks and stops its controller (``self.egeria`` stays readable)."""
        if self.egeria is not None:
            self.egeria.close()

    def _resume(self, args: Any, state: Any) -> None:
        """Rank 0 finds Egeria's state of the resumed step; every rank loads what rank 0
        found (so a folder one rank cannot see never splits the frozen sets), or raises the
        error rank 0 met. Under FSDP2 with Egeria's rule or freezing to the average the
        ranks load it together (the rule's reference is rebuilt from whole weights they
        gather, each rank cuts its shards of the averages, and they take the state or refuse
        it together); otherwise rank 0 loads it and the others take its state."""
        eg = self.egeria
        together = eg._state_is_collective
        outcome = self._resume_on_rank0(args, state, load=not together) if eg._decides else None
        kind, detail = eg._from_rank0(outcome, "EgeriaCallback's resume (on_train_begin)")
        if kind == "error":
            raise ValueError(detail)
        if kind == "loaded" and not eg._decides:
            eg.load_state_dict(detail)
        if kind == "read":
            try:
                eg.load_state_dict(detail)
            except ValueError as err:
                raise ValueError(f"Egeria's state of step {state.global_step} cannot be resumed: {err}") from err
            logger.info("Egeria resumed at step %d with %s frozen", eg.steps, eg.frozen)

    def _resume_on_rank0(self, args: Any, state: Any, load: bool) -> tuple[str, Any]:
        """Rank 0: loads (``load``) or reads Egeria's state of the resumed step from the
        first folder that holds it: ``("loaded", what the other ranks load)``, ``("read",
        the state)``, ``("error", why)`` or ``("none", None)``."""
        candidates = [self.resume_from, getattr(args, "resume_from_checkpoint", None), _checkpoint_dir(args, state)]
        tried = []
        for folder in dict.fromkeys(os.fspath(c) for c in candidates if isinstance(c, (str, os.PathLike))):
            saved = saved_steps(folder)
            tried.append(f"{folder} ({'no ' + STATE_FILE if saved is None else f'step {saved}'})")
            if saved == state.global_step:
                try:
                    if not load:
                        return "read", read_state(folder)
                    self.egeria.load(folder)
                except (OSError, ValueError) as err:
                    return "error", f"Egeria's state in {folder} cannot be resumed: {err}"
                logger.info("Egeria resumed at step %d with %s frozen from %s", self.egeria.steps, self.egeria.frozen, folder)
                # The other ranks do not run the policy: they need all but its state.
                return "loaded", without_policy_state(self.egeria.state_dict())
        logger.warning(
            "resuming at step %d, but no Egeria state of that step in %s: Egeria starts afresh and counts steps "
            "from 0; pass EgeriaCallback(resume_from=<the checkpoint folder>)",
            state.global_step, "; ".join(tried),
        )
        return "none", None


def _check_parallelism(args: Any) -> None:
    """Refuses the Trainer's parallel modes Egeria cannot freeze through."""
    if getattr(args, "n_gpu", 1) > 1:
        raise NotImplementedError(
            f"EgeriaCallback does not support DataParallel (n_gpu={args.n_gpu} in one process): launch one "
            "process per GPU with torchrun (DDP), or use a single GPU"
        )
    if getattr(args, "deepspeed", None):
        raise NotImplementedError(
            f"EgeriaCallback does not support deepspeed (TrainingArguments.deepspeed={args.deepspeed!r}): DeepSpeed "
            "cannot change which parameters train after it is initialised; use DDP (torchrun) or FSDP2 "
            "(TrainingArguments.fsdp with fsdp_config version 2)"
        )
    if _fsdp_version(args) == 1:
        raise NotImplementedError(
            f"EgeriaCallback does not support FSDP1 (TrainingArguments.fsdp={args.fsdp!r}, fsdp_config version 1): "
            "it flattens parameters into FlatParameters whose requires_grad must be uniform, so a frozen set "
            "cannot change mid-run; use FSDP2 (fsdp_config={'version': 2}, the default) or DDP"
        )


def _fsdp_version(args: Any) -> int | None:
    """The FSDP version the Trainer shards with (accelerate's ``fsdp_version``; 2 unless
    ``fsdp_config`` says otherwise), or None without FSDP."""
    if not getattr(args, "fsdp", None):
        return None
    config = getattr(args, "fsdp_config", None) or {}
    return int(config.get("version", 2))


def _go_before_reporters(callback: EgeriaCallback, trainer: Any, args: Any) -> list[Any]:
    """Moves ``callback`` ahead of the reporting callbacks (TensorBoard, W&B, ...) in the
    attached ``trainer``'s callback list, so that the scalars it adds in ``on_log`` reach
    them; returns the reporters. Without a Trainer it warns, where the Trainer reports
    anywhere, that only ``state.log_history`` gets the scalars."""
    if trainer is None:
        report_to = getattr(args, "report_to", None) or []
        report_to = [r for r in ([report_to] if isinstance(report_to, str) else report_to) if r != "none"]
        if report_to:
            logger.warning(
                "Egeria's scalars reach trainer.state.log_history but not the Trainer's reporters %s, which log before "
                "this callback: call EgeriaCallback.attach(trainer) before train() (or pass log_signals=False)",
                report_to,
            )
        return []
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    kinds = tuple(INTEGRATION_TO_CALLBACK.values())
    callbacks = trainer.callback_handler.callbacks
    reporters = [c for c in callbacks if isinstance(c, kinds)]
    first = next((i for i, c in enumerate(callbacks) if isinstance(c, kinds)), None)
    mine = next(i for i, c in enumerate(callbacks) if c is callback)
    if first is not None and mine > first:
        callbacks.insert(first, callbacks.pop(mine))
    return reporters


def _trainer_ddp(trainer: Any, model: nn.Module) -> nn.Module:
    """The attached ``trainer``'s ``DistributedDataParallel`` around ``model`` (a callback
    is handed only the bare model).

    Raises:
        NotImplementedError: no Trainer attached, or its wrapped model is not a DDP around
            ``model``.
    """
    if trainer is None:
        raise NotImplementedError(
            "EgeriaCallback under several processes needs the Trainer's DistributedDataParallel, which callbacks are "
            "not handed: call EgeriaCallback.attach(trainer) before train()"
        )
    wrapped = getattr(trainer, "model_wrapped", None)
    if not isinstance(wrapped, DistributedDataParallel) or wrapped.module is not model:
        raise NotImplementedError(
            f"EgeriaCallback under several processes needs the Trainer's DistributedDataParallel around the model; "
            f"the Trainer wraps it in {type(wrapped).__name__}: train with torchrun's DDP (no FSDP1, DeepSpeed or "
            "other wrapper)"
        )
    return wrapped


def _checkpoint_dir(args: Any, state: Any) -> str:
    """The folder the Trainer saves the checkpoint of ``state.global_step`` to."""
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

