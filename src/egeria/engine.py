"""``Egeria``: layer freezing driven from the user's own training loop.

Where each piece runs, in a plain loop::

    eg = Egeria(model, optimizer, total_steps=...)   # finds the blocks
    for x, y in loader:
        loss = loss_fn(model(x), y)   # 1st forward: blocks traced (a hook records the order).
                                      # Evaluation steps: the policy's hook sends the
                                      # batch to the controller as the forward starts.
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        eg.step(loss)                 # step boundary: 1st call builds the layer modules
                                      # and binds the policy (Egeria's starts its
                                      # controller); then the policy says how many
                                      # leading modules are frozen, and the engine
                                      # freezes or unfreezes them
    eg.close()                        # hooks removed, controller stopped

The engine owns the step count, the layer modules, the frozen prefix
(:class:`~egeria.freezing.FrozenPrefix`) and the events; a policy
(:mod:`egeria.policies`) decides *when*, the engine applies *how*, the same for every
policy. Egeria's own rule is :class:`~egeria.knowledge.KnowledgeGuided`. Decisions take
effect only inside :meth:`Egeria.step`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from .cache.attach import attach_loader
from .checkpoint.saved_state import check_saved_state, policy_state_spec, sealed
from .checkpoint.serialization import read_state, write_state
from .checkpoint.statecheck import check
from .checks import check_int
from .config import EgeriaConfig
from .decision import Decision
from .distributed import Ranks, distributed_run, rebuild_ddp
from .freezing import FrozenPrefix
from .hooks import mark
from .knowledge import KnowledgeGuided
from .knowledge.mainguard import refuse_in_reimported_main
from .knowledge.unfreezing import UnfreezeRule, current_lr
from .lr_schedule import LRAt, ScheduleWatch
from .modes import OwnPasses
from .partition import (
    ExecutionTrace, Partition, build_partition, check_blocks, chosen_modules, find_blocks, leading_within,
)
from .policies import Binding, FreezePolicy, Move, StepInfo, make_policy
from .stepcount import OptimizerSteps
from .wrappers import compiled_in, ddp_of, unwrap, unwrap_optimizer

__all__ = ["Egeria"]

logger = logging.getLogger(__name__)

_STATE_FORMAT = 5


class Egeria:
    """Freezes converged front layer modules of ``model`` while it trains.

    Args:
        model: the model being trained, as the loop calls it: the module itself or wrapped
            in ``DistributedDataParallel`` and/or ``torch.compile`` (Egeria hooks and
            splits the module inside; :mod:`egeria.wrappers`).
        optimizer: its optimizer; its param groups are never changed.
        config: hyperparameters; :class:`EgeriaConfig` defaults when None.
        lr_scheduler: the learning-rate scheduler, if any; or later, :meth:`set_schedule`.
            Egeria's rule reads the learning-rate mass still ahead from it
            (:mod:`egeria.lr_schedule`), whatever its class.
        total_steps: optimizer steps the run will take; needed by the first :meth:`step`
            when ``config.eval_interval`` is None and by the schedule baselines (give it
            here or, once known, to :meth:`set_schedule`).
        unfreeze_rule: replaces the default learning-rate-drop rule of Egeria's policy (for
            cyclical schedules); called at each step with an :class:`UnfreezeContext`.
        example_inputs: optional positional arguments for one forward pass run now (in eval
            mode, without gradients) to find the layer modules before training starts.
        policy: a freezing policy object (see :mod:`egeria.policies`) deciding *when* to
            freeze; ``config.policy`` picks one by name (default: Egeria's own rule).
        on_change: called with every :class:`~egeria.Decision` (freeze, unfreeze, end of
            bootstrapping) as it is applied, inside :meth:`step`.
        module: the part of ``model`` that Egeria hooks, splits into layer modules and
            freezes, when it is not the whole module inside the wrappers: a submodule of it
            whose forward takes the batch's inputs (a LightningModule's network, which
            Lightning calls through ``training_step``). A ``DistributedDataParallel``
            wrapper around ``model`` is still rebuilt at each freeze and unfreeze.
        lr_schedule: the learning rate of every optimizer step, as a callable
            ``lr_at(step) -> float`` (steps from 0), when the scheduler cannot state it
            (a metric-driven or hand-written schedule); it takes precedence over
            ``lr_scheduler`` for the schedule policies read (:mod:`egeria.lr_schedule`).

    Steps are counted from the optimizer (:mod:`egeria.stepcount`): a call of
    :meth:`step` that follows no ``optimizer.step()`` (a micro-batch of gradient
    accumulation, a step ``GradScaler`` skipped) counts nothing.

    Under ``torchrun`` (an initialised process group of several ranks), rank 0 decides and
    every rank applies its decisions at the same step; a ``DistributedDataParallel`` model
    is rebuilt at every freeze and unfreeze so that frozen parameters are not all-reduced
    (:mod:`egeria.distributed`). Build Egeria on every rank at the same point.

    Raises:
        ValueError: for bad arguments, an optimizer without any of the model's
            parameters, or a model with fewer than two layer modules.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        config: EgeriaConfig | None = None,
        lr_scheduler: Any = None,
        total_steps: int | None = None,
        unfreeze_rule: UnfreezeRule | None = None,
        example_inputs: tuple | None = None,
        policy: FreezePolicy | None = None,
        on_change: Callable[[Decision], Any] | None = None,
        module: nn.Module | None = None,
        lr_schedule: LRAt | None = None,
    ) -> None:
        refuse_in_reimported_main()  # a spawned process re-running a script without the __main__ guard stops here
        self.config = config if config is not None else EgeriaConfig()
        if not isinstance(self.config, EgeriaConfig):
            raise ValueError(f"config must be an EgeriaConfig, got {type(self.config).__name__}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.wrapper = model
        model, wrappers = unwrap(model)
        self._ddp = ddp_of(wrappers)
        self._compiled = compiled_in(wrappers)
        if module is not None:
            model = _submodule(model, module)
        optimizer = unwrap_optimizer(optimizer)
        _check_optimizer(model, optimizer)
        if on_change is not None and not callable(on_change):
            raise ValueError(f"on_change must be callable, got {type(on_change).__name__}")
        _check_lr_schedule(lr_schedule)
        self.policy: FreezePolicy = _choose_policy(self.config, policy, unfreeze_rule)
        self._custom_unfreeze = unfreeze_rule is not None
        self.model = model
        self.optimizer = optimizer
        self.total_steps: int | None = None
        self.lr_scheduler: Any = None
        self.steps = 0
        self.events: list[Decision] = []
        self.on_change = on_change
        self._output_loss: tuple[Any, int] | None = None  # (sum, count) of this step's output losses
        self._own = OwnPasses(model)
        self._blocks = find_blocks(model, self.config.modules)
        check_blocks(model, self._blocks)
        self._ranks = Ranks() if distributed_run() else None
        self._counter = OptimizerSteps(optimizer)
        self._partition: Partition | None = None
        self._layout: tuple[Partition, list] | None = None  # the partition's names and shapes, for the ranks' digest
        self._partition_error: ValueError | None = None
        self._prefix: FrozenPrefix | None = None
        self._bound = False
        self._planned = False  # a step ran: total_steps is fixed
        self._cache: Any = None  # an egeria.cache.ActivationCache once cache_loader() is called
        self._closed = False
        self._told_nothing_freezes = False
        self._saved_flops: list[float] | None = None  # the layer modules' weight computation a checkpoint recorded
        self._lr_at = lr_schedule
        self._schedule = ScheduleWatch()  # the run's learning-rate schedule, read once (egeria.lr_schedule)
        self.set_schedule(total_steps=total_steps, lr_scheduler=lr_scheduler)
        self._trace: ExecutionTrace | None = ExecutionTrace(model, self._blocks)
        self._trace_end = mark(model.register_forward_hook(self._on_forward_end))
        self._loss_hook = mark(model.register_forward_hook(self._capture_loss))
        if example_inputs is not None:
            if not isinstance(example_inputs, tuple):
                raise ValueError(
                    f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}; "
                    "write example_inputs=(x,)"
                )
            with self._own.eval_forward():
                model(*example_inputs)

    # -- public view -------------------------------------------------------------

    @property
    def modules(self) -> list[str]:
        """Layer module names in execution order (the last is the head)."""
        return self.partition.names

    @property
    def partition(self) -> Partition:
        """The layer modules (known after the first forward pass)."""
        return self._require_partition("eg.partition")

    @property
    def frozen(self) -> list[str]:
        """Names of the frozen layer modules, always a prefix of :attr:`modules`."""
        return [] if self._prefix is None else self._prefix.names

    @property
    def stage(self) -> str:
        """``"bootstrap"`` while Egeria's rule waits for the loss to settle, else ``"guided"``."""
        return getattr(self.policy, "stage", "guided")

    @property
    def window(self) -> int | None:
        """W of Egeria's rule now (halved at each unfreeze); None for other policies."""
        return getattr(self.policy, "window", None)

    @property
    def eval_interval(self) -> int | None:
        """n of Egeria's rule, once the layer modules are known; None for other policies."""
        if not isinstance(self.policy, KnowledgeGuided):
            return None
        if self.policy.eval_interval is None and self._finished_order() is None and self._partition is None:
            return None
        return self.policy.planned_interval(self.total_steps, len(self.partition))

    @property
    def history(self) -> list[dict]:
        """Plasticity readings so far: step, module, plasticity, smoothed, slope, tolerance."""
        link = getattr(self.policy, "link", None)
        return [] if link is None else list(link.history)

    @property
    def controller_stats(self) -> dict:
        """The controller link's counts: executor, evaluations sent, dropped and answered,
        decisions discarded as too late, the lag (in steps) of every answer, faults, and
        ``overhead``: Egeria's own time on the training thread over the run (seconds, and
        its share of the run's wall time between step boundaries)."""
        link = getattr(self.policy, "link", None)
        if link is None:
            return {}
        return {**link.stats(), "overhead": self.policy.budget.summary()}

    @property
    def cache_stats(self) -> dict:
        """The activation cache's counts (batches served, computed, prefetch hit rate) and
        each cache level's tier, size and choice; empty without :meth:`cache_loader`."""
        return {} if self._cache is None else self._cache.summary()

    def cache_loader(
        self,
        loader: Any,
        *,
        memory_limit: int = 2 * 2**30,
        disk_limit: int = 16 * 2**30,
        directory: str | None = None,
        storage_dtype: torch.dtype | None = None,
        prefetch: int = 4,
        serve: str = "auto",
    ) -> Any:
        """Wraps the training ``DataLoader`` so frozen modules' outputs are cached and their
        forward pass is skipped (see :mod:`egeria.cache`). Iterate over what it returns
        instead of ``loader``; batches are unchanged.

        Args:
            memory_limit: bytes of cached activations kept in memory.
            disk_limit: bytes of cached activations kept on disk when memory is too small.
            directory: the folder disk caches go in (the system's temporary folder by
                default: ``$TMPDIR``, else ``/tmp`` on Linux). A disk cache is chosen only
                where the folder has room for it, is named in ``cache_stats["directory"]``
                and an INFO line, and its file is unlinked as soon as it is open, so none
                outlives the process, even one that is killed.
            storage_dtype: ``torch.bfloat16`` or ``torch.float16`` to store floating
                activations in half the bytes; not exact (the default keeps their dtype).
            prefetch: batches read ahead in a background thread (0: none).
            serve: ``"auto"`` serves a frozen prefix from the cache only where a forward
                pass is measured to be faster that way; ``"always"`` serves wherever it can.

        Returns:
            The wrapped loader, or ``loader`` itself when its data is random (a transform
            that is not a pure function of the sample; a warning says why).

        Raises:
            ValueError: for a bad limit, dtype or loader, or a model under ``torch.compile``.
        """
        if self._compiled:
            raise ValueError(
                "the activation cache skips the frozen blocks by swapping their forward, which a torch.compile "
                "graph does not see; use cache_loader with an uncompiled model (or compile without the cache)"
            )
        wrapped, self._cache = attach_loader(
            loader,
            self._cache,
            model=self.model,
            partition=lambda: self._partition,
            own=self._own,
            frozen=0 if self._prefix is None else self._prefix.count,
            memory_limit=memory_limit,
            disk_limit=disk_limit,
            directory=directory,
            storage_dtype=storage_dtype,
            prefetch=prefetch,
            serve=serve,
        )
        return wrapped

    def set_schedule(self, *, total_steps: int | None = None, lr_scheduler: Any = None) -> None:
        """Gives the run's length and its learning-rate scheduler once they are known (a
        framework may know them only when training starts); before the first :meth:`step`.

        Raises:
            ValueError: a bad ``total_steps``; a policy that needs ``total_steps`` without it.
            RuntimeError: after the first step (the policy already planned with the old values).
        """
        if total_steps is not None:
            check_int(total_steps, "total_steps")
            if self._planned:
                raise RuntimeError("Egeria.set_schedule(total_steps=...) must come before the first step()")
            self.total_steps = total_steps
        if lr_scheduler is not None:
            self.lr_scheduler = lr_scheduler
            self._schedule.watch(self.steps, lr_scheduler, self.optimizer, keep=(self.wrapper, self.model))

    # -- the step boundary ---------------------------------------------------------

    def step(self, loss: torch.Tensor | float | None = None) -> list[Decision]:
        """Call after ``optimizer.step()`` (and the scheduler's step); calls that follow no
        optimizer step (micro-batches, skipped steps) are allowed and count nothing.

        Args:
            loss: the step's training loss (a scalar tensor or a number); used during
                bootstrapping. Non-finite values are logged and ignored. None: the mean
                of the losses the model's training forwards returned since the previous
                step, where its output carries one (``output.loss`` or
                ``output["loss"]``, as Hugging Face models do; under gradient
                accumulation each micro-batch's).

        Returns:
            Every decision applied at this step (freeze, unfreeze, end of bootstrapping).

        Raises:
            RuntimeError: when called before any forward pass of the model, or after close().
            ValueError: a bad loss; more than one optimizer step since the last call; a
                policy that needs ``total_steps`` without it.
        """
        self._check_open()
        loss_value = _checked_loss(loss)
        if not self._counter.boundary():
            return []
        if loss_value is None and self._output_loss is not None:
            total, count = self._output_loss
            loss_value = total / count
        self._output_loss = None  # the next step's micro-batches count afresh
        if getattr(self.policy, "requires_total_steps", False) and self.total_steps is None and not self._bound:
            raise ValueError(
                "EgeriaConfig.eval_interval=None derives n from total_steps, but total_steps=None; "
                "pass total_steps=len(loader) * epochs (optimizer steps), call eg.set_schedule(total_steps=...) "
                "before training, or set eval_interval"
            )
        prefix = self._bind()
        self._planned = True  # the policy plans with total_steps from this step on
        self.steps += 1
        self._schedule.watch(self.steps, self.lr_scheduler, self.optimizer)
        before = len(self.events)
        partition = prefix.partition
        info = StepInfo(
            self.steps, self.total_steps, prefix.count, partition.freezable, current_lr(self.optimizer), loss_value
        )
        move = self._decide(info)
        if self._ranks is not None:
            move = self._ranks.agree(move, self.steps, lambda: self._summary(prefix))
        if move is not None:
            self._apply(move)
        return self.events[before:]

    def _summary(self, prefix: FrozenPrefix) -> dict[str, Any]:
        """What every rank of a distributed run must hold alike (its digest travels with
        every step boundary's agreement)."""
        if self._layout is None or self._layout[0] is not prefix.partition:
            named = dict(self.model.named_parameters())
            self._layout = (prefix.partition, [
                (m.name, [(p, tuple(named[p].shape)) for p in m.params if p in named]) for m in prefix.partition.modules
            ])
        return {"layer modules": self._layout[1], "frozen set": prefix.names, "policy": self.policy.name}

    def _from_rank0(self, value: Any, what: str) -> Any:
        """``value`` as rank 0 holds it, on every rank (``value`` itself outside torchrun):
        the integrations decide there whether and what to resume. Every rank must call it."""
        return value if self._ranks is None else self._ranks.from_leader(value, what)

    def _decide(self, info: StepInfo) -> Move | None:
        """The policy's move at this boundary (on rank 0 only in a distributed run)."""
        if not self._decides:
            return None
        target = self.policy.target(info)
        if target is None or isinstance(target, Move):
            return target
        return Move(int(target), f"{self.policy.name} policy")

    @property
    def _decides(self) -> bool:
        """Whether this process runs the policy: always, but rank 0 alone under torchrun."""
        return self._ranks is None or self._ranks.leader

    def _apply(self, move: Move) -> None:
        assert self._prefix is not None
        for action, names in self._prefix.move_to(move.frozen):
            evaluated_at = move.evaluated_at if action == "freeze" else None
            self._record(Decision(self.steps, action, names, move.reason, evaluated_at))

    def _record(self, decision: Decision) -> None:
        self.events.append(decision)
        logger.info("step %d: %s %s (%s)", decision.step, decision.action, ", ".join(decision.modules), decision.reason)
        if self.on_change is not None:
            self.on_change(decision)

    def _capture_loss(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Keeps the loss a training forward returns in its output (no copy, no sync)."""
        if not module.training or self._own.is_active():
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(())
            total, count = self._output_loss or (0.0, 0)
            self._output_loss = (loss + total, count + 1)

    def _bind(self) -> FrozenPrefix:
        """The frozen prefix; at the first call, also binds the policy to the layer modules."""
        partition = self.partition
        if self._prefix is None:
            self._prefix = FrozenPrefix(self.model, partition, self._frozen_changed)
        if not self._bound:
            self._bound = True
            if not self._decides:
                return self._prefix
            self.policy.bind(
                Binding(
                    self.model,
                    partition,
                    self.optimizer,
                    frozen=lambda: self._prefix.count if self._prefix is not None else 0,
                    step=lambda: self.steps,
                    own_pass=self._own.is_active,
                    event=self._record,
                    lr_schedule=lambda: self._schedule.schedule(
                        self.optimizer, self.total_steps, self._lr_at, final=self._planned
                    ),
                )
            )
            logger.info("Egeria: %d layer modules %s, policy %s", len(partition), partition.names, self.policy.name)
        return self._prefix

    def _frozen_changed(self, count: int) -> None:
        if self._cache is not None:
            self._cache.set_frozen(count)
        if self._ddp is not None:
            rebuild_ddp(self._ddp)

    # -- the layer modules -----------------------------------------------------------

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        """The first forward pass ended: the execution order is known (built on demand)."""
        if self._trace is not None:
            self._trace.remove()
            self._trace_end.remove()

    def _computed_partition(self) -> Partition | None:
        """This model's layer modules (capped), where the first forward pass has ended."""
        order = self._finished_order()
        if order is None:
            return None
        return self._capped(
            build_partition(
                self.model,
                self._blocks,
                order,
                max_modules=self.config.max_modules,
                user_chosen=chosen_modules(self.model, self.config.modules),
            )
        )

    def _require_partition(self, what: str) -> Partition:
        if self._partition_error is not None:
            raise ValueError(str(self._partition_error)) from self._partition_error
        if self._partition is None:
            order = self._finished_order()
            if order is None:
                raise RuntimeError(
                    f"{what} needs the layer modules, which Egeria learns from the model's first forward "
                    "pass: call it after a forward pass (or pass example_inputs= to Egeria)"
                )
            try:
                self._partition = self._computed_partition()
            except ValueError as err:
                logger.error("Egeria cannot split this model into layer modules: %s", err)
                self._partition_error = err
                raise
        return self._partition

    def _capped(self, partition: Partition, saved_flops: list[float] | None = None) -> Partition:
        """``partition`` with its freezable modules holding at most
        ``config.max_frozen_flops`` of the model's weight computation, under Egeria's own
        policy or a baseline the config names (which takes no cap unless one is given); a
        policy object of the user's is not capped by it. Where the cap leaves nothing to
        freeze, one WARNING says why and what to change (a model of one layer module is
        refused outright)."""
        flops = self._module_flops(partition, saved_flops)
        share = self.config.max_frozen_flops
        capped = isinstance(self.policy, KnowledgeGuided) or self.config.policy != "egeria"
        if share is not None and capped and flops is not None and sum(flops) > 0:
            allowed = leading_within(flops, share, partition.freezable)
            if allowed == 0 < partition.freezable:
                self._nothing_can_freeze(
                    f"its first layer module {partition.modules[0].name!r} holds "
                    f"{100 * flops[0] / sum(flops):.0f}% of the model's weight computation, above "
                    f"EgeriaConfig.max_frozen_flops={share:g}; raise max_frozen_flops, "
                    "or pass modules= naming smaller layer modules"
                )
            partition.freezable = min(partition.freezable, allowed)
        return partition

    def _module_flops(self, partition: Partition, saved: list[float] | None = None) -> list[float] | None:
        """Each layer module's weight computation in the first forward pass, as this
        process's trace counted it, or as a checkpoint recorded it (``saved``, or the one
        loaded: a run resumed before its first forward pass); None where neither is known."""
        if self._trace is not None and self._trace.flops:
            return partition.flops(self._trace.flops)
        saved = saved if saved is not None else self._saved_flops
        return list(saved) if saved is not None and len(saved) == len(partition) else None

    def _nothing_can_freeze(self, why: str) -> None:
        """The one warning of a run in which no module can ever freeze."""
        if not self._told_nothing_freezes:
            self._told_nothing_freezes = True
            logger.warning("Egeria can freeze nothing in this model: %s", why)

    def _finished_order(self) -> list[str] | None:
        """The blocks' execution order once the first forward pass has ended, else None."""
        trace = self._trace
        if trace is None or trace.active or not trace.order:
            return None
        return trace.order

    # -- checkpointing -------------------------------------------------------------

    def state_dict(self) -> dict:
        """Egeria's state as a JSON-safe dict.

        Together with the model's and optimizer's state it reproduces the same frozen
        set and the same later decisions. Egeria's own policy adds the reference model's
        snapshot tensors that differ from the model's current weights (those of the watched
        module, base64-encoded) and its int8 calibration, so it is larger than a few numbers.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        self._check_open()
        prefix = self._bind()
        return sealed({
            "format": _STATE_FORMAT,
            "config": self.config.to_dict(),
            "partition": prefix.partition.to_state(),
            "steps": self.steps,
            "total_steps": self.total_steps,
            "lr_cadence": self._schedule.steps_per_epoch,  # optimizer steps per scheduler step, once learnt
            "module_flops": self._module_flops(prefix.partition),  # for the cap of a run resumed before a forward
            "frozen": prefix.count,
            "events": [d.to_dict() for d in self.events],
            "policy": self.policy.name,
            # Under torchrun only rank 0 runs the policy; the other ranks' states lack it.
            "policy_state": self.policy.state_dict() if self._decides else None,
        })

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes :meth:`state_dict` into ``directory`` as ``egeria.json`` (a few numbers
        and names) and ``egeria-<id>.pt`` (the reference model's tensors as tensors); the
        JSON is renamed into place last, so a crash or a full disk at any point leaves the
        previous checkpoint whole (:mod:`egeria.checkpoint.serialization`).

        Raises:
            OSError: the files cannot be written (the previous ones are kept).
            RuntimeError: after :meth:`close`.
        """
        write_state(self.state_dict(), directory)

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restores what :meth:`save` wrote (restore the model and optimizer first).

        Raises:
            FileNotFoundError: ``directory`` holds no Egeria checkpoint.
            ValueError: the checkpoint cannot be read or does not fit this model.
        """
        self.load_state_dict(read_state(directory))

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output. Load the model's and optimizer's checkpoint
        first: the frozen modules and the reference are rebuilt from the model's weights.

        The whole state is checked against this model first (every field's type and
        range, the partition, the tensors' shapes and dtypes, the policy's state), so a
        state it refuses leaves this Egeria as it was.

        Raises:
            ValueError: naming the field that does not fit this model or this format.
        """
        self._check_open()
        flops = state.get("module_flops") if isinstance(state, dict) else None
        flops = flops if isinstance(flops, list) and all(_finite_count(f) for f in flops) else None
        partition, context = check_saved_state(
            state,
            model=self.model,
            format=_STATE_FORMAT,
            policy=self.policy.name,
            decides=self._decides,
            current=self._partition if self._partition is not None else self._computed_partition(),
            cap=lambda p: self._capped(p, saved_flops=flops),
        )
        if self._decides:
            check(state["policy_state"], policy_state_spec(self.policy, context), "state.policy_state")
        changed = {k: (v, state["config"].get(k)) for k, v in self.config.to_dict().items() if state["config"].get(k) != v}
        if changed:
            logger.warning("Egeria config differs from the saved one (now, saved): %s", changed)
        # Checked: nothing above changed this Egeria; from here on it takes the state.
        if self.total_steps is None and state.get("total_steps") is not None:
            self.total_steps = state["total_steps"]
        self._schedule.assume_cadence(state.get("lr_cadence"))
        self._release()
        if self._trace is not None:
            self._trace.remove()
            self._trace_end.remove()
        self._partition, self._prefix = partition, None
        self._saved_flops = flops
        self.steps = state["steps"]
        self.events = [Decision.from_dict(e) for e in state["events"]]
        prefix = self._bind()
        prefix.move_to(state["frozen"])
        if self._decides:
            self.policy.load_state_dict(state["policy_state"])
        self._counter.settle()

    # -- life cycle ----------------------------------------------------------------

    def close(self, *, unfreeze: bool = True) -> None:
        """Removes every hook and stops the policy (Egeria's controller).

        Args:
            unfreeze: make frozen modules trainable again (default), so the model trains
                as plain PyTorch afterwards; False keeps their parameters frozen (their
                BatchNorm and dropout stay in eval mode until the next ``model.train()``).
        """
        if self._closed:
            return
        self._release(unfreeze=unfreeze)
        if self._trace is not None:
            self._trace.remove()
            self._trace_end.remove()
        self._loss_hook.remove()
        self._counter.remove()
        if self._cache is not None:
            self._cache.close()
        # Let go of the user's DDP (and with it the process group) now, not whenever the
        # garbage collector breaks the cycle through the frozen prefix: a process group
        # torn down during the interpreter's exit, in an order the collector sets, can abort
        # the process. Egeria's own group stays registered until destroy_process_group().
        if self._prefix is not None:
            self._prefix.on_change = None
        self._ddp = None
        self._closed = True

    def _release(self, unfreeze: bool = True) -> None:
        """Unbinds the policy and lets go of the frozen prefix (unfrozen unless told not to)."""
        if self._bound:
            if self._decides:
                self.policy.unbind()
            self._bound = False
        if self._prefix is not None:
            if unfreeze:
                self._prefix.move_to(0)
            self._prefix.release_locks(False)  # frozen modules stay in eval mode until the user's next train()

    def __enter__(self) -> Egeria:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Egeria was closed; create a new one to keep freezing")


def _choose_policy(config: EgeriaConfig, policy: FreezePolicy | None, unfreeze_rule: UnfreezeRule | None) -> FreezePolicy:
    if policy is not None and config.policy != "egeria":
        raise ValueError(f"pass either policy= or EgeriaConfig.policy={config.policy!r}, not both")
    if policy is None:
        if config.policy == "egeria":
            return KnowledgeGuided(config, unfreeze_rule=unfreeze_rule)
        policy = make_policy(config.policy, **config.policy_options)
    if not isinstance(policy, FreezePolicy):
        raise ValueError(f"policy={policy!r} lacks the FreezePolicy methods (bind, target, unbind, state_dict)")
    if unfreeze_rule is not None:
        raise ValueError("unfreeze_rule= applies to Egeria's own policy; give it to KnowledgeGuided(unfreeze_rule=...)")
    return policy


def _submodule(model: nn.Module, module: Any) -> nn.Module:
    """``module``, seen through ``torch.compile``, once it is known to lie inside ``model``."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not any(m is module for m in model.modules()):
        raise ValueError(
            f"module= ({type(module).__name__}) is not a submodule of the model ({type(model).__name__}); "
            "pass a part of the model being trained, e.g. module=model.net"
        )
    inner, wrappers = unwrap(module)
    if ddp_of(wrappers) is not None:
        raise ValueError("module= must not be wrapped in DistributedDataParallel; wrap the whole model instead")
    return inner


def _checked_loss(loss: Any) -> torch.Tensor | float | None:
    """The loss as a detached scalar tensor or a float; ValueError for anything else."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"Egeria.step(loss): loss must be a scalar, got shape {tuple(loss.shape)}")
        return loss.detach().reshape(())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    raise ValueError(f"Egeria.step(loss): loss must be a tensor or a number, got {type(loss).__name__}")


def _finite_count(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_lr_schedule(lr_schedule: Any) -> None:
    if lr_schedule is None or callable(lr_schedule):
        return
    hint = " (a scheduler goes to lr_scheduler=)" if hasattr(lr_schedule, "step") else ""
    raise ValueError(
        f"Egeria(lr_schedule={lr_schedule!r}) must be a callable lr_at(step) -> float giving the learning rate of "
        f"optimizer step `step` (from 0), or None{hint}"
    )


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    model_ids = {id(p) for p in model.parameters()}
    held = sum(1 for g in groups for p in g["params"] if id(p) in model_ids)
    if held == 0:
        raise ValueError(
            f"the optimizer ({type(optimizer).__name__}) holds none of the model's parameters; "
            "pass the optimizer that trains this model"
        )
