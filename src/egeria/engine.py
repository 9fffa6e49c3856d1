"""``Egeria``: knowledge-guided layer freezing driven from the user's own training loop.

Where each piece runs, in a plain loop::

    eg = Egeria(model, optimizer, total_steps=...)   # finds the blocks, installs hooks
    for x, y in loader:
        loss = loss_fn(model(x), y)   # 1st forward: blocks traced -> layer modules.
                                      # Evaluation steps: the batch goes to the
                                      # controller as the forward pass starts.
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        eg.step(loss)                 # step boundary: bootstrapping check, the
                                      # evaluation's weights sent, the controller's
                                      # answers applied, unfreezing
    eg.close()                        # hooks removed, controller stopped

The controller (reference model and freezing rule, :mod:`egeria.controller`) runs in
its own process by default and never makes the training loop wait; its decisions take
effect only inside :meth:`Egeria.step`. With ``executor="inline"`` they depend only on
the sequence of losses, batches, weights and learning rates, never on wall-clock time.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator

import torch
from torch import nn

from .bootstrap import BootstrapMonitor
from .config import EgeriaConfig
from .decision import Decision
from .freezing import EvalLock, freeze_parameters, unfreeze_parameters
from .link import ControllerLink
from .nested import map_tensors
from .policies import FreezePolicy, StepInfo, make_policy
from .partition import ExecutionTrace, Partition, build_partition, chosen_modules, find_blocks, first_tensor
from .protocol import Result
from .service import ControllerSpec
from .unfreezing import CYCLICAL_SCHEDULERS, LRDropRule, UnfreezeContext, UnfreezeRule, current_lr
from .weights import ModuleKeys, cpu_snapshot

__all__ = ["Egeria", "derive_eval_interval"]

logger = logging.getLogger(__name__)

_STATE_FORMAT = 2
# The paper's guideline (4.2.2): n = total / (2 W) / modules / (1 + 0.5 + 0.25), the last
# factor covering bootstrapping, smoothing delay and window halving.
_GUIDELINE_FACTOR = 1.75


def derive_eval_interval(total_steps: int, window: int, num_modules: int) -> int:
    """n from the paper's guideline, at least 1 (the engine also applies ``min_eval_interval``)."""
    return max(1, int(total_steps / (2 * window) / num_modules / _GUIDELINE_FACTOR))


class Egeria:
    """Freezes converged front layer modules of ``model`` while it trains.

    Args:
        model: the model being trained (called by the user's loop).
        optimizer: its optimizer; its param groups are never changed.
        config: hyperparameters; :class:`EgeriaConfig` defaults when None.
        lr_scheduler: the learning-rate scheduler, if any (used to warn about cyclical
            schedules, which need ``unfreeze_rule``).
        total_steps: optimizer steps the run will take; needed when
            ``config.eval_interval`` is None.
        unfreeze_rule: replaces the default learning-rate-drop rule (for cyclical
            schedules); called at each step with an :class:`UnfreezeContext`.
        example_inputs: optional positional arguments for one forward pass run now (in eval
            mode, without gradients) to find the layer modules before training starts.
        policy: a freezing policy object (see :mod:`egeria.policies`) deciding *when* to
            freeze instead of Egeria's plasticity rule; ``config.policy`` picks one by name.

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
    ) -> None:
        self.config = config if config is not None else EgeriaConfig()
        if not isinstance(self.config, EgeriaConfig):
            raise ValueError(f"config must be an EgeriaConfig, got {type(self.config).__name__}")
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        _check_optimizer(model, optimizer)
        if total_steps is not None and (not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1):
            raise ValueError(f"total_steps={total_steps!r} must be a positive integer")
        if self.config.eval_interval is None and total_steps is None and policy is None and self.config.policy == "egeria":
            raise ValueError(
                "EgeriaConfig.eval_interval=None derives n from total_steps, but total_steps=None; "
                "pass total_steps=len(loader) * epochs or set eval_interval"
            )
        if policy is not None and self.config.policy != "egeria":
            raise ValueError(
                f"pass either policy= or EgeriaConfig.policy={self.config.policy!r}, not both"
            )
        if policy is None and self.config.policy != "egeria":
            policy = make_policy(self.config.policy, **self.config.policy_options)
        if policy is not None and not isinstance(policy, FreezePolicy):
            raise ValueError(f"policy={policy!r} lacks the FreezePolicy methods (bind, target, unbind, state_dict)")
        self.policy: FreezePolicy | None = policy
        self.model = model
        self.optimizer = optimizer
        self.total_steps = total_steps
        self.unfreeze_rule: UnfreezeRule = unfreeze_rule or LRDropRule(self.config.unfreeze_lr_drop)
        if unfreeze_rule is None and type(lr_scheduler).__name__ in CYCLICAL_SCHEDULERS:
            logger.warning(
                "%s is cyclical: the default unfreeze rule (a %gx learning-rate drop) fits annealing "
                "schedules; pass unfreeze_rule= for cyclical ones",
                type(lr_scheduler).__name__,
                self.config.unfreeze_lr_drop,
            )

        self._blocks = find_blocks(model, self.config.modules)
        weighted = [b for b in self._blocks if any(True for _ in model.get_submodule(b).parameters())]
        if len(weighted) < 2:
            raise ValueError(
                f"the model has a single layer module ({weighted!r}); the head is never frozen, "
                "so Egeria has nothing to freeze; name the modules with EgeriaConfig.modules (a list of "
                "submodule names or a regex) if the model wraps its layers"
            )
        self._trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        self._params = dict(model.named_parameters())
        self.stage = "bootstrap"
        self.steps = 0
        self.window = self.config.window
        self.events: list[Decision] = []
        self._partition: Partition | None = None
        self._eval_interval: int | None = self.config.eval_interval
        self._frozen = 0
        self._locks: list[EvalLock] = []
        self._lr_at_freeze: float | None = None
        self._freeze_step: int | None = None
        self._bootstrap = BootstrapMonitor(self.config.bootstrap_change_rate)
        self._losses: list[Any] = []
        self._link: ControllerLink | None = None
        self._cache: Any = None  # an egeria.cache.ActivationCache once cache_loader() is called
        self._armed = False  # set by _arm_next once the layer modules are known
        self._capturing = False
        self._internal_forward = False
        self._captured_batch: tuple | None = None  # an evaluation's batch, until step()
        self._captured_activation: torch.Tensor | None = None
        self._output_handles: list = []
        self._closed = False
        self._warned_no_loss = False
        self._partition_error: ValueError | None = None

        self._handles = [
            model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True),
            model.register_forward_hook(self._on_forward_end),
        ]
        self._trace: ExecutionTrace | None = ExecutionTrace(model, self._blocks)
        if example_inputs is not None:
            if not isinstance(example_inputs, tuple):
                raise ValueError(
                    f"example_inputs must be a tuple of positional arguments, got {type(example_inputs).__name__}; "
                    "write example_inputs=(x,)"
                )
            self._trace_with(example_inputs)

    # -- public view -------------------------------------------------------------

    @property
    def modules(self) -> list[str]:
        """Layer module names in execution order (the last is the head)."""
        return self._require_partition("eg.modules").names

    @property
    def frozen(self) -> list[str]:
        """Names of the frozen layer modules, always a prefix of :attr:`modules`."""
        if self._partition is None:
            return []
        return self._partition.names[: self._frozen]

    @property
    def eval_interval(self) -> int | None:
        """n, once known (after the first forward pass when derived)."""
        return self._eval_interval

    @property
    def history(self) -> list[dict]:
        """Plasticity readings so far: step, module, plasticity, smoothed, slope, tolerance."""
        return [] if self._link is None else list(self._link.history)

    @property
    def controller_stats(self) -> dict:
        """The controller link's counts: executor, evaluations sent, dropped and answered,
        decisions discarded as too late, the lag (in steps) of every answer, faults."""
        return {} if self._link is None else self._link.stats()

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
            directory: where disk caches go (a temporary directory by default).
            storage_dtype: ``torch.bfloat16`` or ``torch.float16`` to store floating
                activations in half the bytes; not exact (the default keeps their dtype).
            prefetch: batches read ahead in a background thread (0: none).
            serve: ``"auto"`` serves a frozen prefix from the cache only where a forward
                pass is measured to be faster that way; ``"always"`` serves wherever it can.

        Returns:
            The wrapped loader, or ``loader`` itself when its data is random (a transform
            that is not a pure function of the sample; a warning says why).

        Raises:
            ValueError: for a bad limit, dtype or loader.
        """
        from .cache import ActivationCache, CachedLoader, Keyed, random_reason

        for name, value in (("memory_limit", memory_limit), ("disk_limit", disk_limit), ("prefetch", prefetch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"cache_loader({name}={value!r}): must be an integer >= 0")
        if serve not in ("auto", "always"):
            raise ValueError(f"cache_loader(serve={serve!r}): use 'auto' or 'always'")
        if storage_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"cache_loader(storage_dtype={storage_dtype!r}): use None, torch.bfloat16 or torch.float16")
        dataset = getattr(loader, "dataset", None)
        reason = None if dataset is None else random_reason(dataset)
        if reason is not None:
            logger.warning("Egeria: not caching activations: %s", reason)
            return loader
        wrapped = CachedLoader(loader, lambda plan: None, lambda position, keys: None)  # checks the loader
        rows = len(dataset) * Keyed(dataset).variants
        if self._cache is not None and self._cache.rows != rows:
            raise ValueError(
                f"cache_loader: this Egeria caches {self._cache.rows} sample keys, the new loader has {rows}; "
                "wrap one training loader"
            )
        if self._cache is None:
            self._cache = ActivationCache(
                self.model,
                lambda: self._partition,
                rows,
                memory_limit=memory_limit,
                disk_limit=disk_limit,
                directory=directory,
                storage_dtype=storage_dtype,
                prefetch=prefetch,
                serve=serve,
                internal=lambda: self._internal_forward,
                eval_forward=self._internal_eval_forward,
            )
            self._cache.set_frozen(self._frozen)
        wrapped.on_epoch, wrapped.on_batch = self._cache.on_epoch, self._cache.on_batch
        return wrapped

    @property
    def partition(self) -> Partition:
        return self._require_partition("eg.partition")

    # -- the step boundary ---------------------------------------------------------

    def step(self, loss: torch.Tensor | float | None = None) -> list[Decision]:
        """Call once per optimizer step, after ``optimizer.step()``.

        Args:
            loss: the step's training loss (a scalar tensor or a number); used during
                bootstrapping. Non-finite values are logged and ignored.

        Returns:
            Every decision applied at this step (freeze, unfreeze, end of bootstrapping).

        Raises:
            RuntimeError: when called before any forward pass of the model, or after close().
        """
        self._check_open()
        partition = self._require_partition("Egeria.step()")
        loss_value = _checked_loss(loss)
        self.steps += 1
        before = len(self.events)
        self._step(partition, loss_value)
        return self.events[before:]

    def _step(self, partition: Partition, loss_value: Any) -> None:
        if self.policy is not None:
            info = StepInfo(self.steps, self.total_steps, self._frozen, partition.freezable, current_lr(self.optimizer))
            target = self.policy.target(info)
            if target is not None:
                self._move_to(target)
            return
        n = self._eval_interval
        assert n is not None
        if self.stage == "bootstrap":
            self._record_loss(loss_value)
            if self.steps % n == 0:
                self._end_bootstrap_interval()
        self._send_readout()
        if self._link is not None:
            for result in self._link.results(self.steps):
                self._apply(result)
        self._maybe_unfreeze()
        self._arm_next()

    def _arm_next(self) -> None:
        """Capture the next step's batch when that step evaluates plasticity (or ends a
        bootstrap interval) and a module is left to watch."""
        n = self._eval_interval
        self._armed = (
            self._link is not None
            and self._link.usable
            and n is not None
            and (self.steps + 1) % n == 0
            and self._partition is not None
            and self._frozen < self._partition.freezable
        )

    def _record_loss(self, loss: torch.Tensor | float | None) -> None:
        if loss is None:
            if not self._warned_no_loss:
                logger.warning("Egeria.step() got no loss; bootstrapping cannot end without losses")
                self._warned_no_loss = True
            return
        self._losses.append(loss)

    def _end_bootstrap_interval(self) -> None:
        values = [float(v) for v in self._losses]  # one device sync per interval
        self._losses = []
        if self._bootstrap.end_interval(values):
            self.stage = "guided"
            self._log_event(Decision(self.steps, "guided", (), "training loss settled"))
            logger.info("step %d: loss settled, bootstrapping over; guided freezing starts", self.steps)

    def _send_readout(self) -> None:
        """Completes this step's evaluation: a batch captured while bootstrapping goes out
        now if guided freezing just started; the weights after the update go out."""
        batch, activation = self._captured_batch, self._captured_activation
        self._captured_batch = self._captured_activation = None
        link = self._link
        if link is None or batch is None:
            return
        if self.stage != "guided":
            return
        if not link.awaiting_readout and not link.offer(self.model.state_dict, self.steps, self._frozen, batch):
            return
        if self.config.activation_mode == "train" and activation is None:
            link.cancel()
            return
        link.readout(self.model.state_dict(), activation)

    def _apply(self, result: Result) -> Decision | None:
        """Applies a freeze decision at this step boundary, unless it came too late."""
        if result.decision is None or result.module != self._frozen:
            return None
        assert self._link is not None and self._eval_interval is not None
        lag = self.steps - result.step
        bound = self.config.max_lag_intervals * self._eval_interval
        if lag > bound:
            logger.info(
                "step %d: freeze of %s decided at step %d arrived after %d steps (bound %d); discarded, "
                "the controller watches it afresh", self.steps, ", ".join(result.decision.modules),
                result.step, lag, bound,
            )
            self._link.discarded += 1
            self._link.restart(self._frozen, self.window)
            return None
        decision = Decision(self.steps, "freeze", result.decision.modules, result.decision.reason, result.step)
        self._freeze_front_module()
        self._link.froze(result.module)
        self._log_event(decision)
        return decision

    def _freeze_front_module(self) -> None:
        if self._frozen == 0:  # the unfreeze rule measures the LR drop from here
            self._lr_at_freeze = current_lr(self.optimizer)
            self._freeze_step = self.steps
        module = self._require_partition("freeze").modules[self._frozen]
        freeze_parameters(self._params[p] for p in module.params if p in self._trainable)
        self._locks.extend(EvalLock(self.model.get_submodule(b)) for b in module.blocks)
        self._frozen += 1
        if self._cache is not None:
            self._cache.set_frozen(self._frozen)

    def _maybe_unfreeze(self) -> Decision | None:
        if self._frozen == 0:
            return None
        ctx = UnfreezeContext(
            self.steps, current_lr(self.optimizer), self._lr_at_freeze, self._freeze_step, tuple(self.frozen)
        )
        if not self.unfreeze_rule(ctx):
            return None
        names = tuple(self.frozen)
        self._unfreeze_all()
        self.window = max(self.config.min_window, self.window // 2)
        if self._link is not None:
            self._link.restart(0, self.window)
        decision = Decision(self.steps, "unfreeze", names, f"learning rate {ctx.lr:.3g} (was {ctx.lr_at_freeze:.3g})")
        self._log_event(decision)
        return decision

    def _unfreeze_all(self) -> None:
        partition = self._require_partition("unfreeze")
        for module in partition.modules[: self._frozen]:
            unfreeze_parameters(self._params[p] for p in module.params if p in self._trainable)
        for lock in self._locks:
            lock.release(self.model.training)
        self._locks = []
        self._frozen = 0
        if self._cache is not None:
            self._cache.set_frozen(0)
        self._lr_at_freeze = None
        self._freeze_step = None

    def _move_to(self, target: int) -> Decision | None:
        """Freezes or unfreezes so that the first ``target`` modules are frozen."""
        partition = self._require_partition("policy")
        target = max(0, min(int(target), partition.freezable))
        if target == self._frozen:
            return None
        reason = f"{self.policy.name} policy" if self.policy is not None else ""
        if target < self._frozen:
            decision = Decision(self.steps, "unfreeze", tuple(self.frozen), reason)
            self._unfreeze_all()
            self._log_event(decision)
            if target == 0:
                return decision
        names = tuple(partition.names[self._frozen : target])
        freeze = Decision(self.steps, "freeze", names, reason)
        while self._frozen < target:
            self._freeze_front_module()
        self._log_event(freeze)
        return freeze

    def _log_event(self, decision: Decision) -> None:
        self.events.append(decision)
        logger.info("step %d: %s %s (%s)", decision.step, decision.action, ", ".join(decision.modules), decision.reason)

    # -- hooks ---------------------------------------------------------------------

    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._capturing = False
        if self._internal_forward:
            return
        if self._armed and module.training and self._captured_batch is None and self._link is not None:
            batch = map_tensors((args, kwargs), _cpu_copy)  # the loop may reuse its input buffers
            if self.stage == "guided" and not self._link.offer(self.model.state_dict, self.steps + 1, self._frozen, batch):
                return  # dropped: the controller is behind
            self._captured_batch = batch
            self._capturing = self.config.activation_mode == "train"

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._capturing = False
        if self._trace is not None:
            self._finish_trace()

    def _on_block_output(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._capturing and index == self._frozen and self._captured_activation is None:
                tensor = first_tensor(output)
                if tensor is not None:
                    self._captured_activation = tensor.detach().to("cpu", copy=True)

        return hook

    def _trace_with(self, example_inputs: tuple) -> None:
        with self._internal_eval_forward():
            self.model(*example_inputs)

    @contextlib.contextmanager
    def _internal_eval_forward(self) -> Iterator[None]:
        """Egeria's own forward passes: eval mode, no gradients, no capture; every
        submodule's training flag is restored after, as the user had set it."""
        flags = [(m, m.training) for m in self.model.modules()]
        self._internal_forward = True
        try:
            self.model.eval()
            with torch.no_grad():
                yield
        finally:
            for m, flag in flags:
                m.training = flag
            self._internal_forward = False

    def _finish_trace(self) -> None:
        assert self._trace is not None
        order = self._trace.order
        self._trace.remove()
        self._trace = None
        chosen = chosen_modules(self.model, self.config.modules)
        try:
            partition = build_partition(
                self.model, self._blocks, order, max_modules=self.config.max_modules, user_chosen=chosen
            )
        except ValueError as err:
            # Raised from step(), not from inside the user's forward pass; training goes on plain.
            logger.error("Egeria cannot split this model into layer modules: %s", err)
            self._partition_error = err
            return
        self._install_partition(partition)

    def _install_partition(self, partition: Partition) -> None:
        self._partition = partition
        if self._eval_interval is None and self.total_steps is not None:
            cfg = self.config
            guideline = derive_eval_interval(self.total_steps, cfg.window, len(partition))
            self._eval_interval = max(guideline, cfg.min_eval_interval)
            if guideline < cfg.min_eval_interval and self.policy is None:
                logger.info(
                    "the guideline gives n=%d for %d steps; using min_eval_interval=%d, so fewer "
                    "modules may be evaluated for freezing in this run",
                    guideline, self.total_steps, cfg.min_eval_interval,
                )
        named = dict(self.model.named_modules())
        hooked = self.policy is None and self.config.activation_mode == "train"
        self._output_handles = [
            named[m.output_block].register_forward_hook(self._on_block_output(i))
            for i, m in enumerate(partition.modules[: partition.freezable])
            if hooked
        ]
        if self.policy is not None:
            self.stage = "guided"
            self.policy.bind(self.model, partition)
        if self._link is not None:
            self._link.close()
        self._link = None
        if self.policy is None:
            self._link = ControllerLink(
                self.config.executor,
                self._controller_spec,
                ModuleKeys(self.model, partition),
                partition.freezable,
                self.window,
                max_in_flight=self.config.max_in_flight,
                timeout=self.config.controller_timeout,
                start_method=self.config.start_method,
            )
        logger.info(
            "Egeria: %d layer modules %s, policy %s, eval interval n=%s",
            len(partition),
            partition.names,
            "egeria" if self.policy is None else self.policy.name,
            self._eval_interval,
        )
        self._arm_next()

    def _controller_spec(self) -> ControllerSpec:
        """What the controller is built from: a CPU snapshot of the model as it is now."""
        return ControllerSpec(
            self._require_partition("controller"),
            cpu_snapshot(self.model, self._hook_ids()),
            self.config.reference_precision,
            self.window,
            self.config.tolerance_ratio,
            self.config.reference_refresh,
            self.config.reference_threads,
            self.config.cpu_threshold,
        )

    def _hook_ids(self) -> list[int]:
        handles = self._handles + self._output_handles
        return [h.id for h in handles] + [lock._handle.id for lock in self._locks if lock._handle is not None]

    # -- checkpointing -------------------------------------------------------------

    def state_dict(self) -> dict:
        """Egeria's state as a JSON-safe dict.

        Together with the model's and optimizer's state it reproduces the same frozen
        set and the same later decisions. It includes the reference model's snapshot
        tensors that differ from the model's current weights (those of the watched module,
        base64-encoded) and its int8 calibration, so it is larger than a few numbers.
        """
        partition = self._require_partition("Egeria.state_dict()")
        return {
            "format": _STATE_FORMAT,
            "config": self.config.to_dict(),
            "partition": partition.to_state(),
            "eval_interval": self._eval_interval,
            "stage": self.stage,
            "steps": self.steps,
            "window": self.window,
            "frozen": self._frozen,
            "lr_at_freeze": self._lr_at_freeze,
            "freeze_step": self._freeze_step,
            "bootstrap": self._bootstrap.state_dict(),
            "losses": [v for v in map(float, self._losses) if math.isfinite(v)],
            "events": [d.to_dict() for d in self.events],
            "link": None if self._link is None else self._link.state_dict(self.model.state_dict(), self._frozen),
            "policy": None if self.policy is None else self.policy.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output. Load the model's and optimizer's checkpoint
        first: the frozen modules and the reference are rebuilt from the model's weights.

        Raises:
            ValueError: when the state does not fit this model or was made by another format.
        """
        self._check_open()
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"Egeria state format {state.get('format')!r} is not {_STATE_FORMAT}")
        changed = {k: (v, state["config"].get(k)) for k, v in self.config.to_dict().items() if state["config"].get(k) != v}
        if changed:
            logger.warning("Egeria config differs from the saved one (now, saved): %s", changed)
        partition = Partition.from_state(self.model, state["partition"])
        if self._partition is not None:
            if partition.names != self._partition.names:
                raise ValueError(f"saved layer modules {partition.names} differ from {self._partition.names}")
            self._unfreeze_all()
            for handle in self._output_handles:
                handle.remove()
            if self.policy is not None:
                self.policy.unbind()
        if self._trace is not None:
            self._trace.remove()
            self._trace = None
        self._eval_interval = self.config.eval_interval or state["eval_interval"]
        self._install_partition(partition)
        self.stage = state["stage"]
        self.steps = int(state["steps"])
        self.window = int(state["window"])
        self._bootstrap = BootstrapMonitor.from_state(state["bootstrap"])
        self._losses = list(state["losses"])
        self.events = [Decision.from_dict(e) for e in state["events"]]
        for _ in range(int(state["frozen"])):
            self._freeze_front_module()
        self._lr_at_freeze = state["lr_at_freeze"]
        self._freeze_step = state["freeze_step"]
        if self._link is not None and state["link"] is not None:
            self._link.load_state_dict(state["link"], self.model.state_dict(), self._frozen, self.window)
        if self.policy is not None and state.get("policy") is not None:
            self.policy.load_state_dict(state["policy"])
        self._arm_next()

    # -- life cycle ----------------------------------------------------------------

    def close(self, *, unfreeze: bool = True) -> None:
        """Removes every hook and drops the reference model.

        Args:
            unfreeze: make frozen modules trainable again (default), so the model trains
                as plain PyTorch afterwards; False keeps their parameters frozen (their
                BatchNorm and dropout stay in eval mode until the next ``model.train()``).
        """
        if self._closed:
            return
        if unfreeze and self._partition is not None:
            self._unfreeze_all()
        for lock in self._locks:  # frozen modules stay in eval mode until the user's next train()
            lock.release(False)
        self._locks = []
        for handle in self._handles + self._output_handles:
            handle.remove()
        self._handles, self._output_handles = [], []
        if self._trace is not None:
            self._trace.remove()
            self._trace = None
        if self._link is not None:
            self._link.close()
        if self._cache is not None:
            self._cache.close()
        if self.policy is not None:
            self.policy.unbind()
        self._captured_batch = self._captured_activation = None
        self._closed = True

    def __enter__(self) -> Egeria:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Egeria was closed; create a new one to keep freezing")

    def _require_partition(self, what: str) -> Partition:
        if self._partition_error is not None:
            raise ValueError(str(self._partition_error)) from self._partition_error
        if self._partition is None:
            raise RuntimeError(
                f"{what} needs the layer modules, which Egeria learns from the model's first forward "
                "pass: call it after a forward pass (or pass example_inputs= to Egeria)"
            )
        return self._partition


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


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
