"""Egeria's own policy: knowledge-guided freezing (paper sections 3 and 4.2).

The training side of the rule, behind the same :class:`FreezePolicy` seam as the
baselines. At every step boundary it

1. records the loss while bootstrapping, and every n steps asks the
   :class:`~egeria.knowledge.bootstrap.BootstrapMonitor` whether the loss has settled;
2. completes the evaluation captured in this step's forward pass (the batch went to the
   controller as the forward started; the weights after the update go now);
3. applies the controller's freeze decisions that are not too old;
4. unfreezes everything when the unfreeze rule fires (a 10x learning-rate drop); the
   paper's rule then halves W, the default rule bootstraps again;
5. arms the capture of the next evaluation step's forward pass.

The controller (reference model and plasticity rule, :mod:`egeria.knowledge.controller`) is
started at the first step boundary, in the executor the config names.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..checkpoint.saved_state import SavedContext
from ..checkpoint.statecheck import Spec, boolean, integer, number, optional, record, text
from ..config import (
    BOOTSTRAP_CHANGE_RATE, CONTROLLER_TIMEOUT, MAX_IN_FLIGHT, MIN_EVAL_INTERVAL, MIN_WINDOW, TOLERANCE_RATIO,
    UNFREEZE_LR_DROP, EgeriaConfig, lr_bound,
)
from ..decision import Decision
from ..hooks import mark
from ..lr_schedule import LRSchedule
from ..nested import first_tensor, leaves, map_tensors
from ..policies.base import Binding, Move, StepInfo
from . import device
from .bootstrap import BootstrapMonitor
from .budget import CostBudget
from .controller import Controller
from .device import HostCopy, LocalCopy, handoff
from .executors import Executor, make_executor
from .link import ControllerLink
from .plasticity import REGIME_CHANGE, TOLERANCE_LAGS
from .placement import controller_threads, reference_home, resolve_executor, resolve_precision
from .rule import IDLE_SHARE, RuleSettings, at_most
from .service import ControllerSpec
from .spans import Spans
from .similarity import gram_of
from .unfreezing import LRDropRule, UnfreezeContext, UnfreezeRule, current_lr, rises_again
from .weights import ModuleKeys, float_snapshot

__all__ = ["KnowledgeGuided", "derive_eval_interval", "rule_settings"]

logger = logging.getLogger(__name__)

# The paper's guideline (4.2.2): n = total / (2 W) / modules / (1 + 0.5 + 0.25), the last
# factor covering bootstrapping, smoothing delay and window halving.
_GUIDELINE_FACTOR = 1.75

#: Builds the executor the controller runs in from its spec (tests pass a fake one).
ExecutorFactory = Callable[[ControllerSpec], Executor]


def derive_eval_interval(total_steps: int, window: int, num_modules: int) -> int:
    """n from the paper's guideline, at least 1 (the policy raises it to ``MIN_EVAL_INTERVAL``)."""
    return max(1, int(total_steps / (2 * window) / num_modules / _GUIDELINE_FACTOR))


def rule_settings(config: EgeriaConfig) -> RuleSettings:
    """The freezing rule's settings from ``config`` and the paper's slope tolerance
    (``TOLERANCE_RATIO``, read now); Egeria's rule (``rule="egeria"``) adds regimes.

    ``floor_ratio=0`` turns floors off: none is measured."""
    return RuleSettings(
        window=config.window,
        tolerance_ratio=TOLERANCE_RATIO,
        horizon=config.horizon,
        regimes=config.rule == "egeria",
        floor_ratio=config.floor_ratio or None,
        low_lr=lr_bound(config.speed) if config.rule == "egeria" else None,
        idle_share=IDLE_SHARE if config.rule == "egeria" else None,
    )


class KnowledgeGuided:
    """Freezes the frontmost active module once its plasticity has become stationary.

    Args:
        config: Egeria's hyperparameters.
        unfreeze_rule: replaces the default learning-rate-drop rule (cyclical schedules).
        executor: builds the controller's executor from its spec; by default the one
            ``config.executor`` names.
        clock: seconds for the cost budget (tests pass a fake one).
    """

    name = "egeria"
    #: EgeriaConfig.max_frozen_flops caps the modules it may freeze (:class:`~egeria.policies.PolicyView`).
    capped_by_config = True
    #: It reads the model's weights and activations; under FSDP2 the whole weights, which
    #: the engine gathers where :meth:`reads_weights_now` says (:class:`~egeria.policies.PolicyView`).
    reads_model = True

    def __init__(
        self,
        config: EgeriaConfig | None = None,
        *,
        unfreeze_rule: UnfreezeRule | None = None,
        executor: ExecutorFactory | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config if config is not None else EgeriaConfig()
        self.unfreeze_lr_drop = UNFREEZE_LR_DROP[self.config.rule]
        self.unfreeze_rule: UnfreezeRule = unfreeze_rule or LRDropRule(self.unfreeze_lr_drop)
        self._checked_cycles = unfreeze_rule is not None or self.unfreeze_lr_drop == math.inf
        self._executor_factory = executor
        self.rule_settings = rule_settings(self.config)  # the rule's, built once
        self._checked_low_lr = self.rule_settings.low_lr is None or not self._horizon_on()
        self.stage = "bootstrap"
        self.window = self.config.window
        self.eval_interval: int | None = self.config.eval_interval
        self.spans: Spans | None = None  # the rule's timing, in steps, once the run is known
        self.bootstrap = BootstrapMonitor(BOOTSTRAP_CHANGE_RATE)
        self.lr_at_freeze: float | None = None
        self.freeze_step: int | None = None
        self.link: ControllerLink | None = None
        self.budget = CostBudget(self.config.cost_budget or 1.0, clock)
        self.budget_checked = False  # the cost budget is judged once
        self.guided_at: int | None = None  # the step bootstrapping ended (the latest time)
        self._binding: Binding | None = None
        self._handles: list = []
        self._warned_no_loss = False

    @property
    def quiet_passes_cap(self) -> bool:
        """A module past ``max_frozen_flops`` may freeze once quiet, where the rule measures
        floors (docs/decisions/041-quiet-modules-pass-the-cap.md; :class:`~egeria.policies.PolicyView`)."""
        return self.rule_settings.floor_ratio is not None

    @property
    def requires_total_steps(self) -> bool:
        """Under the paper's rule n is derived from the run's length unless
        ``eval_interval`` is set."""
        return self.config.eval_interval is None and self.config.rule == "paper"

    # -- FreezePolicy -----------------------------------------------------------------

    def bind(self, binding: Binding) -> None:
        self._binding = binding
        model, partition = binding.model, binding.partition
        self._handles = [mark(model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True))]
        self._handles.append(mark(model.register_forward_hook(self._on_forward_end, always_call=True)))
        if self.config.activation_mode == "train":
            for index, module in enumerate(partition.modules[: partition.freezable]):
                block = model.get_submodule(module.output_block)
                self._handles.append(mark(block.register_forward_hook(self._on_block_output(index))))
        spec = self._spec
        factory = self._executor_factory or self._configured_executor
        self.link = ControllerLink(
            factory(spec()),
            spec,
            ModuleKeys(model, partition),
            partition.freezable,
            lambda: (binding.frozen(), self.window),  # what a replacement controller watches
            hooked=self.config.activation_mode == "train",
            span=self.span,
            max_in_flight=MAX_IN_FLIGHT,
            timeout=CONTROLLER_TIMEOUT,
        )

    def target(self, info: StepInfo) -> Move | None:
        assert self.link is not None and self._binding is not None, "bind() first"
        self._interval(info)
        assert self.spans is not None
        lag = self.spans.lag
        move: Move | None = None
        if self.stage == "bootstrap":
            self._record_loss(info.loss)
            if info.step % lag == 0 and self.bootstrap.end_interval():
                self.stage = "guided"
                self.guided_at = info.step
                self._binding.event(Decision(info.step, "guided", (), "training loss settled"))
        with self.budget.spending():
            evaluated = self.link.complete(self.stage == "guided", self._weights)
            accepted = self.link.decisions(info.step, info.frozen, lag)
        if accepted:
            last = accepted[-1]
            assert last.decision is not None
            if info.frozen == 0:  # the unfreeze rule measures the learning-rate drop from here
                self.lr_at_freeze, self.freeze_step = info.lr, info.step
            names = tuple(name for r in accepted if r.decision is not None for name in r.decision.modules)
            move = Move(info.frozen + len(names), last.decision.reason, last.step, names)
        frozen = move.frozen if move is not None else info.frozen
        unfreeze = self._unfreeze(info, frozen)
        move = unfreeze or move
        frozen = move.frozen if move is not None else info.frozen
        if info.step == info.total_steps and info.freezable > 0 and frozen == 0:
            self._say_why_nothing_froze(info.step, frozen)
        self.budget.step_done(evaluated)
        self._keep_budget(info.step)
        self._arm(info.step, frozen, info.freezable)
        return move

    def reads_weights_now(self) -> bool:
        """Whether this step boundary reads the model's weights: an evaluation was captured
        in this step's forward pass (it goes out with the weights after the update)."""
        return self.link is not None and self.link.evaluation is not None

    def unbind(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.link is not None:
            self.link.close()  # kept: its history and counts stay readable

    # -- what the engine reports (egeria.policies.PolicyView) ----------------------------

    def evaluation_interval(self, total_steps: int | None, modules: Callable[[], int], known: bool) -> int | None:
        """n as planned now (:meth:`planned_interval`); None while it is not set and the
        layer modules are not ``known`` yet."""
        if self.eval_interval is None and not known:
            return None
        return self.planned_interval(total_steps, modules())

    def controller_stats(self) -> dict:
        """The controller link's counts and the cost budget's summary (``overhead``);
        empty before the first step boundary."""
        if self.link is None:
            return {}
        return {**self.link.stats(), "overhead": self.budget.summary()}

    def history(self) -> list[dict]:
        """The plasticity readings so far."""
        return [] if self.link is None else list(self.link.history)

    def _say_why_nothing_froze(self, step: int, frozen: int) -> None:
        """One WARNING at the run's last step when it ends with nothing frozen: why, and
        what to change (a model whose cap leaves nothing to freeze was told at its start)."""
        logger.warning("Egeria ends this run (step %d) with nothing frozen: %s", step, self.why_nothing_froze(frozen))

    def why_nothing_froze(self, frozen: int = 0) -> str:
        """Why the module after the ``frozen`` leading ones is not frozen, and what to change."""
        if self.stage == "bootstrap":
            if self._warned_no_loss:
                return "Egeria.step() got no loss, so bootstrapping never ended: pass the loss, eg.step(loss)"
            return (
                f"bootstrapping never ended: the smoothed training loss still changed by more than "
                f"{BOOTSTRAP_CHANGE_RATE:.0%} between intervals of n={self.eval_interval} steps, and readings start "
                "only once it changes less (for a short or noisy run, a larger eval_interval)"
            )
        assert self._binding is not None
        front = self._binding.partition.names[frozen]
        history = [r for r in self.history() if r["module"] == front]
        if not history:
            stats = self.controller_stats()
            failure = stats.get("failure")
            return (
                f"no plasticity reading came back ({stats.get('sent', 0)} sent, {stats.get('dropped', 0)} dropped"
                + (f"; the controller failed: {failure}" if failure else "") + "; eg.controller_stats has the counts)"
            )
        last = history[-1]
        return (
            f"the front module {last['module']!r} had not settled by its last reading (step {last['step']}): "
            + "; ".join(self._blockers(last)) + " (modules settle late in most schedules; a run that ends first gains nothing)"
        )

    def _blockers(self, last: dict) -> list[str]:
        """The conditions of the rule that the front module's last reading ``last`` did not
        meet, each with its figures; those it met are left out."""
        blocked = []
        span = self.spans.span if self.spans is not None else 0
        if last.get("stale_steps", 0) < span:
            blocked.append(f"its readings' slope within tolerance for {last.get('stale_steps', 0)} of the span's {span} steps")
        if self._horizon_on():
            horizon, share = self.config.horizon, last.get("outlook_share")
            if share is None:
                blocked.append(
                    "no drift still to come known (an unknown schedule: pass lr_scheduler= and total_steps=)"
                    if last.get("mass_ahead") is None
                    else "no pace measured since the schedule's last jump (a module's readings start afresh at one)"
                )
            elif share > horizon:
                blocked.append(f"drift still to come {share:.2g} of its largest, against horizon={horizon:g}")
            low, lr_share = self.rule_settings.low_lr, last.get("lr_share")
            if low is not None and lr_share is not None and not at_most(lr_share, low):
                below = self._steps_under_bound()
                blocked.append(
                    f"learning rate {lr_share:.2g} of its peak, above the {low:g} that speed={self.config.speed!r} "
                    "allows a module still learning"
                    + (" (the schedule never comes down that low)" if below == 0 else
                       f" (only the run's last {below} steps are at or under it, fewer than the n={self.eval_interval} "
                       "between two readings)" if below is not None and below < (self.eval_interval or 0) else "")
                    + "; speed='balanced' or 'fast' freeze earlier, at some cost in accuracy"
                )
        if not blocked:
            blocked.append("its last readings met the rule too late for a freeze to be applied before the run ended")
        if self.config.floor_ratio and last.get("floor"):
            middle = last.get("median")
            middle = last["smoothed"] if middle is None else middle  # a row from before the median: its average
            blocked.append(f"nor was it quiet: the median of its plasticity readings {middle / last['floor']:.3g}x its "
                           f"floor, against floor_ratio={self.config.floor_ratio:g}")
        idle, share = self.rule_settings.idle_share, last.get("active_share")
        if idle is not None and share is not None:
            blocked.append(f"nor idle: plasticity {share:.2g} of the most active watched module's, against {idle:g}")
        return blocked

    def _under_bound(self) -> tuple[LRSchedule, list[bool]] | None:
        """The schedule and, for each of its steps, whether its learning rate is at most the
        rule's bound (``speed``): where a module still learning may freeze (None: no
        schedule known, or no bound)."""
        assert self._binding is not None
        schedule, low = self._binding.lr_schedule(), self.rule_settings.low_lr
        if schedule is None or low is None:
            return None
        return schedule, [at_most(lr / schedule.peak, low) for lr in schedule.lrs.tolist()]

    def _steps_under_bound(self) -> int | None:
        """How many of the run's last steps train at or under the rule's bound (None: no
        schedule known, or no bound)."""
        known = self._under_bound()
        if known is None:
            return None
        count = 0
        for under in reversed(known[1]):
            if not under:
                break
            count += 1
        return count

    # -- the steps of target() ----------------------------------------------------------

    def planned_interval(self, total_steps: int | None, num_modules: int) -> int | None:
        """n for a run of ``total_steps`` over ``num_modules`` layer modules: the config's;
        else, under the paper's rule, the guideline's with the ``MIN_EVAL_INTERVAL`` floor
        (None: not known yet); under Egeria's, ``MIN_EVAL_INTERVAL`` (the cost budget may
        space readings further, within the rule's spans: :class:`~egeria.knowledge.spans.Spans`)."""
        if self.eval_interval is not None:
            return self.eval_interval
        return self._planned_lag(total_steps, num_modules)

    def _planned_lag(self, total_steps: int | None, num_modules: int) -> int | None:
        """D, the steps a reading's drift covers, before an explicit interval: under
        Egeria's rule ``MIN_EVAL_INTERVAL``; under the paper's, its guideline's n (with that
        floor), or the config's n (None: not known yet)."""
        if self.config.rule == "egeria":
            return MIN_EVAL_INTERVAL
        if self.config.eval_interval is not None:
            return self.config.eval_interval
        if total_steps is None:
            return None
        return max(derive_eval_interval(total_steps, self.config.window, num_modules), MIN_EVAL_INTERVAL)

    def _interval(self, info: StepInfo) -> int:
        """n, and the rule's spans, planned once the run is known (its length, the modules)."""
        assert self._binding is not None
        modules = len(self._binding.partition)
        if self.spans is None:
            lag = self._planned_lag(info.total_steps, modules)
            assert lag is not None
            self.spans = Spans.for_interval(lag, self.window, self.config.eval_interval)
            if self.spans.lag > min(lag, self.config.eval_interval or lag):
                logger.info(
                    "Egeria: eval_interval=%d leaves a span of W x %d steps fewer than two readings: each reading "
                    "now covers %d steps, so the rule's span is %d steps", self.config.eval_interval, lag,
                    self.spans.lag, self.spans.span,
                )
        if self.eval_interval is None:
            self.eval_interval = self.planned_interval(info.total_steps, modules)
            assert self.eval_interval is not None
            if self.config.rule == "paper" and self.eval_interval > derive_eval_interval(
                info.total_steps or 0, self.config.window, modules
            ):
                logger.info(
                    "the guideline gives a shorter n for %s steps; using n=%d, so fewer "
                    "modules may be evaluated for freezing in this run",
                    info.total_steps, MIN_EVAL_INTERVAL,
                )
        return self.eval_interval

    def _keep_budget(self, step: int) -> None:
        """Once the first evaluations are measured: space the readings of a derived n that
        breaks the cost budget further apart, within the rule's spans (at most
        :attr:`Spans.longest_interval`), or report an explicit one. The budget sets only how
        densely the spans are sampled: they are steps, so the decisions stay where they were
        within one interval (docs/decisions/038-steps-not-readings.md; the budget itself:
        docs/decisions/016-cost-budget.md). It is judged once the first readings have set the
        modules' tolerances, read one every D steps whatever the budget: the tolerance is a
        module's own scale of its early slopes, which sparser first readings would see later
        and flatter."""
        limit = self.config.cost_budget
        if limit is None or self.budget_checked or not self.budget.measured or not self._tolerances_read(step):
            return
        self.budget_checked = True
        assert self.eval_interval is not None and self.link is not None and self.spans is not None
        share = self.budget.share(self.eval_interval)
        if share <= limit:
            return
        cost, step = self.budget.figures()
        needed = self.budget.interval()
        figures = (
            f"a reading costs {cost * 1e3:.1f} ms on the training thread against {step * 1e3:.1f} ms per "
            f"training step: {share:.1%} of training at n={self.eval_interval}, over the cost budget of {limit:.1%}"
        )
        if self.config.eval_interval is not None:
            logger.warning("Egeria: %s; eval_interval=%d is kept as set (n=%d would meet it)", figures, self.eval_interval, needed)
            return
        spaced = self.spans.clamp(needed)
        if spaced < needed:
            logger.info(
                "Egeria: %s; n is now %d, not %d: the rule's span of %d steps must hold two readings, so the readings "
                "take %.1f%% (a cheaper reading: probe_size=..., controller_cpus=...)",
                figures, spaced, needed, self.spans.span, 100 * self.budget.share(spaced),
            )
        else:
            logger.info("Egeria: %s; n is now %d", figures, spaced)
        self.eval_interval = spaced

    def _tolerances_read(self, step: int) -> bool:
        """Whether the readings that set the watched modules' tolerances (the slopes of their
        first ``TOLERANCE_LAGS`` x D steps, from their second reading) are in: a reading at
        guiding's start and ``1 + TOLERANCE_LAGS`` lags of readings after it."""
        assert self.spans is not None
        return self.guided_at is not None and step >= self.guided_at + (1 + TOLERANCE_LAGS) * self.spans.lag

    def _record_loss(self, loss: torch.Tensor | float | None) -> None:
        if loss is None:
            if not self._warned_no_loss:
                logger.warning("Egeria.step() got no loss; bootstrapping cannot end without losses")
                self._warned_no_loss = True
            return
        self.bootstrap.record(loss)

    def _unfreeze(self, info: StepInfo, frozen: int) -> Move | None:
        if frozen == 0 or self.lr_at_freeze is None:
            return None
        assert self._binding is not None
        names = tuple(self._binding.partition.names[:frozen])
        ctx = UnfreezeContext(info.step, info.lr, self.lr_at_freeze, self.freeze_step, names)
        if not self.unfreeze_rule(ctx):
            return None
        if self.config.rule == "paper":  # refreeze soon: halve W, watch again at once
            self.window = max(min(MIN_WINDOW, self.config.window), self.window // 2)
            if self.spans is not None:
                self.spans = dataclasses.replace(self.spans, window=self.window)
        else:  # wait until the loss has settled at the new learning rate
            self.stage = "bootstrap"
            self.bootstrap = BootstrapMonitor(BOOTSTRAP_CHANGE_RATE)
        self.lr_at_freeze = self.freeze_step = None
        assert self.link is not None
        self.link.restart(0, self.window)
        return Move(0, f"learning rate {ctx.lr:.3g} (was {ctx.lr_at_freeze:.3g})")

    def _arm(self, step: int, frozen: int, freezable: int) -> None:
        """Capture the next step's batch when that step takes a reading (every n steps) or
        refreshes the reference for one (D steps before it, where n > D) and a module is
        left to watch; with n = D each reading refreshes the reference for the next."""
        assert self.link is not None and self.eval_interval is not None and self.spans is not None
        n, lag, coming = self.eval_interval, self.spans.lag, step + 1
        read = coming % n == 0
        refresh = read if n <= lag else (coming + lag) % n == 0
        due = (read or refresh) and frozen < freezable
        self.link.arm(coming if due else None, read=read, refresh=refresh, lag=lag)

    # -- hooks: they record, the step boundary acts ---------------------------------------

    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        binding, link = self._binding, self.link
        if link is None or binding is None or binding.own_pass() or not module.training:
            return
        with self.budget.spending():
            link.begin(
                binding.step() + 1,
                binding.frozen(),
                lambda: _probe_copy((args, kwargs), self.config.probe_size, self._to_host),
                # whole weights gathered at step boundaries only (FSDP2): the request goes then
                self.stage == "guided" and binding.weights is None,
                self._weights,
                lambda: current_lr(binding.optimizer),
                self._mass_ahead,
                self._lr_peak,
                self._lr_regime,
            )

    def _mass_ahead(self) -> float | None:
        """The learning-rate mass still ahead after the step being evaluated: the sum of
        the learning rates of the steps after it (None: the schedule is not known)."""
        assert self._binding is not None
        schedule = self._binding.lr_schedule()
        if schedule is None:
            return None
        if not self._checked_cycles:
            self._checked_cycles = True
            restart = rises_again(schedule.lrs.tolist(), self.unfreeze_lr_drop)
            if restart is not None:
                logger.warning(
                    "Egeria: the learning rate rises again at step %d after falling %gx (a cyclical schedule): the "
                    "default unfreeze rule (a %gx learning-rate drop) fits annealing schedules and would unfreeze "
                    "at every cycle; pass unfreeze_rule= for cyclical ones",
                    restart, self.unfreeze_lr_drop, self.unfreeze_lr_drop,
                )
        if not self._checked_low_lr:
            self._checked_low_lr = True
            low = self.rule_settings.low_lr
            lowest = float(schedule.lrs.min()) / schedule.peak
            if not at_most(lowest, low):
                logger.warning(
                    "Egeria: this run's learning rate never falls to %g of its peak (its lowest is %.2g of it), so "
                    "only modules at their floor or idle (a pretrained front) can freeze: a module still "
                    "learning freezes only once the rate is that low. A schedule that decays further (cosine or "
                    "linear to 0, a step schedule's second tenfold drop) lets settled modules freeze in its last "
                    "stretch", low, lowest,
                )
        return schedule.lr_sum(self._binding.step() + 1)  # the evaluated step is the next one taken

    def _lr_regime(self) -> int | None:
        """The step of the schedule's latest jump at or before the evaluated step (-1: none;
        None: the schedule is not known)."""
        assert self._binding is not None
        schedule = self._binding.lr_schedule()
        return None if schedule is None else schedule.last_jump(self._binding.step(), REGIME_CHANGE)  # the step in progress, from 0

    def _horizon_on(self) -> bool:
        """Whether Egeria's criterion (the drift still to come) is on."""
        return self.config.horizon is not None and self.config.horizon < 1

    def _lr_peak(self) -> float | None:
        """The schedule's highest learning rate (None: the schedule is not known)."""
        assert self._binding is not None
        schedule = self._binding.lr_schedule()
        return None if schedule is None else schedule.peak

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.link is not None:
            self.link.forward_ended()

    def _on_block_output(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.link is not None and self.link.wants_activation(index):
                tensor = first_tensor(output)
                if tensor is not None:
                    if device.gram_where_it_lives(tensor):
                        self.link.capture(index, handoff({"gram": gram_of(tensor).matrix}, self._to_host))
                    else:
                        self.link.capture(index, handoff(tensor, self._to_host))

        return hook

    # -- the controller ---------------------------------------------------------------

    def _weights(self) -> Mapping[str, torch.Tensor]:
        """The model's whole state now (under FSDP2, as gathered at this step boundary)."""
        assert self._binding is not None
        return self._binding.weights() if self._binding.weights is not None else self._binding.model.state_dict()

    @property
    def executor_kind(self) -> str:
        """Where the controller runs: the config's executor, ``"auto"`` resolved."""
        assert self._binding is not None
        return resolve_executor(self.config.executor, self._binding.model, self.config.reference_device)

    @property
    def _home(self) -> torch.device:
        """Where the controller's reference and front live (``reference_device``)."""
        assert self._binding is not None
        return reference_home(self.config.reference_device, self._binding.model)

    @property
    def _to_host(self) -> bool:
        """Whether the batch and activations are copied for a controller on the host, or
        stay where they live for one on the model's device."""
        return self.config.reference_device == "cpu"

    def _spec(self) -> ControllerSpec:
        """What the controller is built from: a snapshot of the model as it is now, on the
        CPU or, with ``reference_device="model"``, on the model's device."""
        assert self._binding is not None
        cfg = self.config
        cpus = tuple(cfg.controller_cpus) if cfg.controller_cpus is not None else None
        return ControllerSpec(
            self._binding.partition,
            float_snapshot(self._binding.model, self._home, None if self._binding.weights is None else self._weights()),
            resolve_precision(cfg.reference_precision),
            rule=dataclasses.replace(self.rule_settings, window=self.window,
                                     lag=self.spans.lag if self.spans is not None else self.rule_settings.lag),
            threads=controller_threads(self.executor_kind, cpus),
            cpu_threshold=cfg.cpu_threshold,
            span=self.span,
            cpus=cpus,
        )

    @property
    def span(self) -> int:
        """Modules read at each evaluation: 1 under the paper's rule, else every freezable
        module."""
        assert self._binding is not None
        if self.config.rule == "paper":
            return 1
        return self._binding.partition.freezable

    def _configured_executor(self, spec: ControllerSpec) -> Executor:
        cfg = self.config
        return make_executor(
            self.executor_kind,
            spec,
            max_in_flight=MAX_IN_FLIGHT,
            timeout=CONTROLLER_TIMEOUT,
            start_method=cfg.start_method,
        )

    # -- checkpointing -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """The rule's state, with the controller's (it waits for answers already sent)."""
        assert self._binding is not None and self.link is not None
        return {
            "stage": self.stage,
            "window": self.window,
            "eval_interval": self.eval_interval,
            "lag": None if self.spans is None else self.spans.lag,
            "bootstrap": self.bootstrap.state_dict(),
            "lr_at_freeze": self.lr_at_freeze,
            "freeze_step": self.freeze_step,
            "budget_checked": self.budget_checked,
            "guided_at": self.guided_at,
            "link": self.link.state_dict(self._weights(), self._binding.frozen()),
        }

    def state_spec(self, context: SavedContext) -> Spec:
        """What :meth:`state_dict` output holds for the partition, step and model of
        ``context`` (fields added later may be absent, as in older checkpoints)."""
        partition, steps = context.partition, context.steps

        def controller(generation: int) -> Spec:
            return Controller.state_spec(partition, context.weights, generation)

        return record(
            {
                "stage": text(("bootstrap", "guided")),
                "window": integer(1, 10**6),
                "eval_interval": optional(integer(1, 2**63 - 1)),
                "lag": optional(integer(1, 2**63 - 1)),
                "bootstrap": BootstrapMonitor.state_spec(),
                "lr_at_freeze": optional(number(0)),
                "freeze_step": optional(integer(0, steps)),
                "budget_checked": boolean,
                "guided_at": optional(integer(0, steps)),
                "link": ControllerLink.state_spec(controller, partition.names, steps),
            },
            optional=("lag", "guided_at"),
        )

    def load_state_dict(self, state: dict) -> None:
        assert self._binding is not None and self.link is not None
        self.stage = state["stage"]
        self.window = int(state["window"])
        self.eval_interval = self.config.eval_interval or state["eval_interval"]
        lag = state.get("lag")  # absent before the rule's steps: planned again at the next step
        self.spans = None if lag is None else Spans(int(lag), self.window)
        self.bootstrap = BootstrapMonitor.from_state(state["bootstrap"])
        self.lr_at_freeze = state["lr_at_freeze"]
        self.freeze_step = state["freeze_step"]
        self.budget_checked = bool(state["budget_checked"])
        self.guided_at = state.get("guided_at")  # absent before: the budget waits no longer for it
        if self.guided_at is None and self.stage == "guided":
            self.guided_at = 0
        self.link.load_state_dict(state["link"], self._weights(), self._binding.frozen())
        if self.eval_interval is not None and self.spans is not None:
            self._arm(self._binding.step(), self._binding.frozen(), self._binding.partition.freezable)


def _probe_copy(batch: tuple, size: int | None, to_host: bool) -> HostCopy | LocalCopy:
    """A copy of the call arguments for the controller (the loop may reuse its input
    buffers), on the host or where they live, cut to the first ``size`` samples: tensors
    whose first dimension is the batch's are sliced."""
    tensors = leaves(batch)
    rows = tensors[0].shape[0] if tensors and tensors[0].dim() > 0 else None
    if size is None or rows is None or rows <= size:
        return handoff(batch, to_host)
    return handoff(map_tensors(batch, lambda t: t[:size] if t.dim() > 0 and t.shape[0] == rows else t), to_host)
