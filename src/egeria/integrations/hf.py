"""Egeria in the Hugging Face ``Trainer``: :class:`EgeriaCallback` (``pip install egeria[hf]``).

Usage::

    from egeria import EgeriaConfig
    from egeria.integrations.hf import EgeriaCallback

    callback = EgeriaCallback(config=EgeriaConfig())
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)
    print(callback.egeria.events)        # what froze when

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
run in the order of the Trainer's callbacks, before a user's, so the callback moves itself
ahead of them when training begins. ``EgeriaCallback(log_signals=False)`` leaves the logs
alone.

Steps are counted from the optimizer, so they match ``state.global_step`` (less the steps
a ``GradScaler`` skipped under fp16). The loss Egeria reads is the mean ``loss`` of the
model's outputs over each step's micro-batches. A callback does not see the folder
``train(resume_from_checkpoint=...)`` names, so a resumed run looks for Egeria's state, in
this order, in ``EgeriaCallback(resume_from=...)``, ``args.resume_from_checkpoint``,
``args.output_dir/checkpoint-{global_step}`` (where the Trainer saved it), and takes the
first whose saved step is the resumed ``global_step``; with none, Egeria starts afresh with
a warning that names the folders it tried.

Under ``torchrun`` (DDP) the Trainer hands callbacks the bare model, so the callback looks
up the Trainer's ``DistributedDataParallel`` around it (the one whose ``.module`` is that
model) and gives Egeria both: rank 0 decides, every rank applies its moves at the same step,
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

import gc
import logging
import os
import warnings
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

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
        "egeria.integrations.hf needs transformers and accelerate: pip install egeria[hf]"
    ) from err

__all__ = ["EgeriaCallback", "STATE_FILE"]

logger = logging.getLogger(__name__)

STATE_FILE = _EGERIA_FILE  # egeria.json, beside egeria-<id>.pt (Egeria.save)
# Egeria arguments the callback passes itself, taken from the Trainer.
_FROM_TRAINER = ("model", "optimizer", "lr_scheduler", "total_steps", "example_inputs")
_ALLOWED = ("unfreeze_rule", "policy", "on_change")


class EgeriaCallback(TrainerCallback):
    """Freezes converged front layer modules of the model a ``Trainer`` trains.

    Args:
        config: Egeria's hyperparameters (:class:`~egeria.EgeriaConfig` defaults when None).
        resume_from: the checkpoint folder a resumed ``train()`` restores from, when it is
            neither ``args.resume_from_checkpoint`` nor under ``args.output_dir``.
        log_signals: add Egeria's scalars to the Trainer's training logs (and its decisions
            to TensorBoard as text) at the Trainer's logging steps.
        **egeria_kwargs: further :class:`~egeria.Egeria` arguments: ``unfreeze_rule``,
            ``policy`` or ``on_change``. The model, optimizer, scheduler and the number of
            steps come from the Trainer.

    Attributes:
        egeria: the :class:`~egeria.Egeria` of the current (or last) ``train()`` call;
            None before training begins.

    Raises:
        ValueError: ``config`` is not an EgeriaConfig, or an argument is unknown or one the
            Trainer supplies.
    """

    def __init__(self, config: EgeriaConfig | None = None, *, resume_from: str | os.PathLike[str] | None = None,
                 log_signals: bool = True, **egeria_kwargs: Any) -> None:
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
        self.config = config
        self.resume_from = resume_from
        self.log_signals = log_signals
        self._reporters: list[Any] = []
        self.egeria_kwargs = egeria_kwargs
        self.egeria: Egeria | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Builds Egeria over the Trainer's model and optimizer; on resume, loads its state
        (the Trainer has restored the model, optimizer and scheduler by now)."""
        _check_parallelism(args)
        if self.egeria is not None:  # an earlier train() call
            self.egeria.close()
        model = kwargs["model"]
        # Under FSDP2 the model is sharded in place (no wrapper); under DDP the Trainer's wrapper is found.
        distributed = getattr(args, "world_size", 1) > 1 and not fsdp2_in(model)
        trained = _trainer_ddp(model) if distributed else model
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
        if self.log_signals:
            self._reporters = _go_before_reporters(self)

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
        # Under FSDP2 Egeria's rule makes its state from whole weights that every rank gathers.
        if eg is None or not (args.should_save or eg._whole is not None):
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
        error rank 0 met. Under FSDP2 with Egeria's rule the ranks load it together (its
        reference is rebuilt from whole weights they gather, and they take the state or
        refuse it together); otherwise rank 0 loads it and the others take its state."""
        eg = self.egeria
        together = eg._whole is not None
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


def _go_before_reporters(callback: EgeriaCallback) -> list[Any]:
    """Moves ``callback`` ahead of the Trainer's reporting callbacks (TensorBoard, W&B,
    ...) in the Trainer's callback list, so that the scalars it adds in ``on_log`` reach
    them; returns the reporters. A callback is not handed the Trainer, so its callback
    handler is found among live objects, once per ``train()``."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
    from transformers.trainer_callback import CallbackHandler

    kinds = tuple(INTEGRATION_TO_CALLBACK.values())
    with warnings.catch_warnings():  # isinstance on some live objects (torch's deprecated aliases) warns
        warnings.simplefilter("ignore")
        # type(o), not isinstance: isinstance asks a weakref proxy's dead referent and raises
        handlers = [o for o in gc.get_objects() if issubclass(type(o), CallbackHandler) and callback in o.callbacks]
    if len(handlers) != 1:
        logger.warning("Egeria's scalars are not logged: found %d Trainers holding its callback, not one", len(handlers))
        return []
    callbacks = handlers[0].callbacks
    reporters = [c for c in callbacks if isinstance(c, kinds)]
    first = next((i for i, c in enumerate(callbacks) if isinstance(c, kinds)), None)
    mine = next(i for i, c in enumerate(callbacks) if c is callback)
    if first is not None and mine > first:
        callbacks.insert(first, callbacks.pop(mine))
    return reporters


def _trainer_ddp(model: nn.Module) -> nn.Module:
    """The Trainer's ``DistributedDataParallel`` around ``model``. A callback is handed only
    the bare model, so the wrapper is found among live objects, once per ``train()``.

    Raises:
        NotImplementedError: no DDP, or several, wrap the model.
    """
    # type(o), not isinstance: isinstance asks a weakref proxy's dead referent and raises
    # ReferenceError (FSDP1 leaves such proxies among live objects)
    found = [o for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel) and o.module is model]
    if len(found) != 1:
        raise NotImplementedError(
            f"EgeriaCallback under several processes needs the Trainer's DistributedDataParallel around the model; "
            f"found {len(found)}: train with torchrun's DDP (no FSDP, DeepSpeed or other wrapper)"
        )
    return found[0]


def _checkpoint_dir(args: Any, state: Any) -> str:
    """The folder the Trainer saves the checkpoint of ``state.global_step`` to."""
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

