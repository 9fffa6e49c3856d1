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
from typing import Any, Callable

import torch
from torch import nn

from .averaging import DEFAULT_SPAN, FreezeToAverage, WeightAverage
from .cache.attach import CacheLoading
from .checkpoint.engine_state import Checkpointing
from .checks import check_int, check_lr_schedule, check_optimizer, check_run_length, checked_loss, submodule_of
from .config import EgeriaConfig
from .decision import Decision
from .distributed import Ranks, WholeWeights, check_fsdp2_policy, distributed_run, rebuild_ddp
from .freezing import FrozenPrefix
from .knowledge.mainguard import refuse_in_reimported_main
from .knowledge.unfreezing import UnfreezeRule, current_lr
from .layers import RunLayers
from .lr_schedule import LRAt, ScheduleWatch
from .memory import MemoryMeter, cache_bytes
from .modes import OwnPasses
from .optimizer_state import ReleasedState
from .partition import Partition, check_blocks, find_blocks
from .policies import Binding, FreezePolicy, Move, PolicyView, StepInfo, as_move, policy_for
from .signals import TensorBoardSignals, scalars
from .stepcount import OptimizerSteps, OutputLosses
from .wrappers import compiled_in, ddp_of, fsdp2_in, unwrap, unwrap_optimizer

__all__ = ["Egeria"]

logger = logging.getLogger(__name__)


class Egeria(Checkpointing, CacheLoading):
    """Freezes converged front layer modules of ``model`` while it trains.

    Args:
        model: the model being trained, as the loop calls it: the module itself (sharded
            with ``fully_shard`` or not) or wrapped in ``DistributedDataParallel`` and/or
            ``torch.compile`` (Egeria hooks and splits the module inside;
            :mod:`egeria.wrappers`).
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
        writer: a TensorBoard ``SummaryWriter`` for a plain loop: :meth:`metrics` is
            written to it every ``log_every`` steps and at every decision, and each
            decision as a text event (:mod:`egeria.signals`); the HF and Lightning
            callbacks give the same scalars to the Trainer's own loggers instead.
        log_every: steps between the writer's scalars.
        average: freeze each module to the running average of its recent weights, its
            BatchNorm statistics re-estimated for them, instead of to its last iterate
            (:class:`~egeria.averaging.WeightAverage`; None: the last iterate). It costs a
            float32 copy of the freezable modules' trainable weights and one pass over them
            per step (:mod:`egeria.averaging`).

    Steps are counted from the optimizer (:mod:`egeria.stepcount`): a call of
    :meth:`step` that follows no ``optimizer.step()`` (a micro-batch of gradient
    accumulation, a step ``GradScaler`` skipped) counts nothing.

    Under ``torchrun`` (an initialised process group of several ranks), rank 0 decides and
    every rank applies its decisions at the same step; a ``DistributedDataParallel`` model
    is rebuilt at every freeze and unfreeze so that frozen parameters are not all-reduced
    (:mod:`egeria.distributed`). Build Egeria on every rank at the same point. A model
    sharded with ``fully_shard`` (FSDP2) needs no rebuild: frozen parameters leave its
    reduce-scatter by their ``requires_grad``; the policies that read the model on rank 0
    and the activation cache are refused there, and frozen modules' buffers are made rank
    0's at each freeze.

    Raises:
        ValueError: for bad arguments, an optimizer without any of the model's
            parameters, a model with fewer than two layer modules, or under FSDP2 a policy
            that reads the model (naming the ones that work).
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
        writer: Any = None,
        log_every: int = 50,
        average: WeightAverage | None = None,
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
        self._fsdp2 = fsdp2_in(model)  # sharded with fully_shard (egeria.distributed)
        if module is not None:
            model = submodule_of(model, module)
        optimizer = unwrap_optimizer(optimizer)
        check_optimizer(model, optimizer)
        if on_change is not None and not callable(on_change):
            raise ValueError(f"on_change must be callable, got {type(on_change).__name__}")
        check_lr_schedule(lr_schedule)
        if average is not None and not isinstance(average, WeightAverage):
            raise ValueError(f"average must be an egeria.WeightAverage or None, got {type(average).__name__}")
        self._average_settings = average
        self._signals = TensorBoardSignals(writer, log_every) if writer is not None else None
        self.policy: FreezePolicy = policy_for(self.config, policy, unfreeze_rule)
        self._asks = PolicyView(self.policy)  # what the engine asks the policy beyond deciding
        if self._fsdp2:
            check_fsdp2_policy(self.policy.name, self._asks.reads_model, self._asks.gathers_weights)
        self._custom_unfreeze = unfreeze_rule is not None
        self.model = model
        self.optimizer = optimizer
        self.total_steps: int | None = None
        self.lr_scheduler: Any = None
        self.steps = 0
        self.events: list[Decision] = []
        self.on_change = on_change
        self._own = OwnPasses(model)
        blocks = find_blocks(model, self.config.modules)
        check_blocks(model, blocks)
        self._ranks = Ranks() if distributed_run() else None
        # the ranks FSDP2 shards the model over (None: not FSDP2, or one process)
        self._fsdp2_ranks = self._ranks if self._fsdp2 else None
        # FSDP2 with Egeria's rule: the whole weights it reads, gathered by every rank (egeria.distributed)
        self._whole = WholeWeights(model, self._ranks) if self._fsdp2 and self._asks.gathers_weights else None
        self._counter = OptimizerSteps(optimizer)
        self._prefix: FrozenPrefix | None = None
        self._bound = False
        self._planned = False  # a step ran: total_steps is fixed
        self._cache: Any = None  # an egeria.cache.ActivationCache once cache_loader() is called
        self._closed = False
        self._lr_at = lr_schedule
        self._schedule = ScheduleWatch()  # the run's learning-rate schedule, read once (egeria.lr_schedule)
        self.set_schedule(total_steps=total_steps, lr_scheduler=lr_scheduler)
        # the layer modules, from the first forward pass; a policy the config names takes
        # the config's cap, a policy object where it says so
        self._layers = RunLayers(model, blocks, self.config, capped=policy is None or self._asks.capped_by_config,
                                 quiet_passes=self._asks.quiet_passes_cap)
        self._losses = OutputLosses(model, self._own.is_active)  # the loss a model's output carries
        # memory by part, on sampled steps and around each change (egeria.memory)
        self._memory = MemoryMeter(model, optimizer, self._own.is_active, self._memory_context,
                                   activations=not self._compiled)
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
        return self._layers.require("eg.partition")

    @property
    def frozen(self) -> list[str]:
        """Names of the frozen layer modules, always a prefix of :attr:`modules`."""
        return [] if self._prefix is None else self._prefix.names

    @property
    def stage(self) -> str:
        """``"bootstrap"`` while Egeria's rule waits for the loss to settle, else ``"guided"``."""
        return self._asks.stage

    @property
    def window(self) -> int | None:
        """W of Egeria's rule now (halved at each unfreeze); None for other policies."""
        return self._asks.window

    @property
    def eval_interval(self) -> int | None:
        """n of Egeria's rule, once the layer modules are known; None for other policies."""
        return self._asks.evaluation_interval(self.total_steps, lambda: len(self.partition), self._layers.known)

    @property
    def history(self) -> list[dict]:
        """Plasticity readings so far: step, module, plasticity, smoothed, slope, tolerance."""
        return self._asks.history()

    @property
    def controller_stats(self) -> dict:
        """The controller link's counts: executor, evaluations sent, dropped and answered,
        the lag (in steps) of every answer, the step boundaries where training waited for a
        due answer (``training_waits``, ``training_waited_s``), faults, and
        ``overhead``: Egeria's own time on the training thread over the run (seconds, and
        its share of the run's wall time between step boundaries)."""
        return self._asks.controller_stats()

    def metrics(self) -> dict[str, float]:
        """Egeria's scalars now as one flat dict, every name under ``egeria/``: the frozen
        modules and their share of the parameters and of the backward FLOPs, the latest
        plasticity of each module read, the controller's readings sent, answered, dropped
        and late, Egeria's share of the step time, and the latest measured memory by part
        (:mod:`egeria.signals`, :mod:`egeria.memory`)."""
        partition = None
        if self._layers.known and self._layers.error is None:
            partition = self.partition
        return scalars(
            0 if self._prefix is None else self._prefix.count,
            None if partition is None else [m.num_params for m in partition.modules],
            None if partition is None else self._layers.module_flops(partition),
            self.history,
            self.controller_stats,
            self._memory.rows[-1] if self._memory.rows else None,
        )

    @property
    def memory_history(self) -> list[dict]:
        """Memory by part (bytes, :mod:`egeria.memory`) of each measured step and just before
        each freeze or unfreeze: step, frozen (modules), parameters, gradients,
        optimizer_state, optimizer_state_released, activations, activation_cache,
        activation_cache_disk, and on CUDA cuda_allocated and cuda_max_allocated."""
        return list(self._memory.rows)

    def _memory_context(self) -> tuple[int, int, dict]:
        """The frozen count, the released optimizer state's bytes and the cache's bytes by tier."""
        prefix = self._prefix
        if prefix is None:
            return 0, 0, cache_bytes({})
        released = prefix.optimizer_state.nbytes if prefix.optimizer_state is not None else 0
        return prefix.count, released, cache_bytes(self.cache_stats)

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
        loss_value = checked_loss(loss)
        if not self._counter.boundary():
            return []
        output_loss = self._losses.take()  # taken at every boundary: the next step's count afresh
        if loss_value is None:
            loss_value = output_loss
        if not self._bound:
            check_run_length(self._asks.requires_total_steps, self.total_steps)
        if self._whole is not None:
            self._whole.at_boundary(not self._bound, self._decides and self._asks.reads_weights_now())
        prefix = self._bind()
        self._planned = True  # the policy plans with total_steps from this step on
        self.steps += 1
        self._schedule.watch(self.steps, self.lr_scheduler, self.optimizer)
        if prefix.average is not None:
            self._fold_average(prefix)
        before = len(self.events)
        partition = prefix.partition
        info = StepInfo(
            self.steps, self.total_steps, prefix.count, partition.freezable, current_lr(self.optimizer), loss_value
        )
        self._memory.boundary(self.steps)
        move = self._decide(info)
        if self._ranks is not None:
            move = self._ranks.agree(move, self.steps, lambda: self._ranks.summary(self.model, prefix, self.policy.name))
        if move is not None:
            self._apply(move)
        if self._signals is not None:
            self._signals.after_step(self, self.events[before:])
        return self.events[before:]

    def _fold_average(self, prefix: FrozenPrefix) -> None:
        """Freezing to the average, at each boundary before the policy's move: the batch
        just trained counts for the BatchNorm re-estimates under way, and the unfrozen
        modules' weights join their averages (:mod:`egeria.averaging`)."""
        assert prefix.average is not None
        ended = prefix.average.tick()
        if ended:
            if self._ranks is not None:
                # each rank re-estimated on its own batches: rank 0's statistics, everywhere
                self._ranks.share_buffers(prefix.average.buffers_of(ended))
            if self._cache is not None:
                self._cache.set_frozen(prefix.settled)
        prefix.average.update(prefix.count)

    @property
    def _state_is_collective(self) -> bool:
        """Whether making and loading Egeria's state is a collective every rank joins:
        under FSDP2 with several ranks, where Egeria's rule reads whole weights or the
        averages are sharded (each rank gathers its part)."""
        return self._whole is not None or (self._fsdp2_ranks is not None and self._average_settings is not None)

    def _from_rank0(self, value: Any, what: str) -> Any:
        """``value`` as rank 0 holds it, on every rank (``value`` itself outside torchrun):
        the integrations decide there whether and what to resume. Every rank must call it."""
        return value if self._ranks is None else self._ranks.from_leader(value, what)

    def _decide(self, info: StepInfo) -> Move | None:
        """The policy's move at this boundary (on rank 0 only in a distributed run)."""
        if not self._decides:
            return None
        return as_move(self.policy.target(info), self.policy.name)

    @property
    def _decides(self) -> bool:
        """Whether this process runs the policy: always, but rank 0 alone under torchrun."""
        return self._ranks is None or self._ranks.leader

    def _apply(self, move: Move) -> None:
        assert self._prefix is not None
        adds = tuple(self._prefix.partition.names[self._prefix.count : min(move.frozen, self._prefix.partition.freezable)])
        if move.modules and move.modules != adds:
            logger.warning(
                "step %d: %s named %s to freeze, but a move to %d frozen modules from %d adds %s; nothing changed",
                self.steps, self.policy.name, list(move.modules), move.frozen, self._prefix.count, list(adds),
            )
            return
        if max(0, min(move.frozen, self._prefix.partition.freezable)) != self._prefix.count:
            self._memory.changing(self.steps)
        changes = self._prefix.move_to(move.frozen)
        if changes:
            self._memory.changed()
        for action, names in changes:
            evaluated_at = move.evaluated_at if action == "freeze" else None
            self._record(Decision(self.steps, action, names, move.reason, evaluated_at))

    def _record(self, decision: Decision) -> None:
        self.events.append(decision)
        logger.info("step %d: %s %s (%s)", decision.step, decision.action, ", ".join(decision.modules), decision.reason)
        if self.on_change is not None:
            self.on_change(decision)

    def _bind(self) -> FrozenPrefix:
        """The frozen prefix; at the first call, also binds the policy to the layer modules."""
        partition = self.partition
        if self._prefix is None:
            self._prefix = FrozenPrefix(self.model, partition, self._frozen_changed)
            if self.config.release_optimizer_state:
                self._prefix.optimizer_state = ReleasedState(self.optimizer)
            if self._average_settings is not None:
                self._prefix.average = FreezeToAverage(
                    self.model, partition, self._prefix.trainable, self._average_span(partition)
                )
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
                    # final once a step ran, here or before a resume (a resumed run's first
                    # forward reads the schedule as the uninterrupted run's did)
                    lr_schedule=lambda: self._schedule.schedule(
                        self.optimizer, self.total_steps, self._lr_at, final=self._planned or self.steps > 0
                    ),
                    weights=None if self._whole is None else self._whole.read,
                )
            )
            logger.info("Egeria: %d layer modules %s, policy %s", len(partition), partition.names, self.policy.name)
        return self._prefix

    def _average_span(self, partition: Partition) -> int:
        """The steps an average weighs: the user's, else W x n of Egeria's rule, else
        :data:`~egeria.averaging.DEFAULT_SPAN`."""
        assert self._average_settings is not None
        if self._average_settings.span is not None:
            return self._average_settings.span
        window = self._asks.window
        interval = self._asks.evaluation_interval(self.total_steps, lambda: len(partition), True)
        return window * interval if window and interval else DEFAULT_SPAN

    def _frozen_changed(self, count: int) -> None:
        if self._fsdp2_ranks is not None and count > 0:
            # FSDP2 never synchronises buffers: each rank's BatchNorm statistics are its
            # own data's, and a frozen module runs in eval mode on them. Rank 0's, everywhere.
            assert self._prefix is not None
            blocks = [b for m in self._prefix.partition.modules[:count] for b in m.blocks]
            self._fsdp2_ranks.share_buffers([buf for b in blocks for buf in self.model.get_submodule(b).buffers()])
        if self._cache is not None:
            assert self._prefix is not None
            self._cache.set_frozen(self._prefix.settled)
        if self._ddp is not None:
            rebuild_ddp(self._ddp)

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
        self._layers.stop_tracing()
        self._losses.remove()
        self._memory.remove()
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
            if self._prefix.average is not None:
                self._prefix.average.unfreeze()  # a BatchNorm re-estimate under way ends where it is
            if self._prefix.optimizer_state is not None:
                self._prefix.optimizer_state.close()  # modules left frozen get their optimizer state back
            self._prefix.release_locks(False)  # frozen modules stay in eval mode until the user's next train()

    def __enter__(self) -> Egeria:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Egeria was closed; create a new one to keep freezing")
