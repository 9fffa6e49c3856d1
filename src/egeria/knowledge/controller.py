"""The controller: turns evaluations into freezing decisions (paper 4.1.1, 4.2).

It owns the reference model's life cycle (generation, refresh, quantization, execution)
and feeds each reading to the freezing rule (:class:`~egeria.knowledge.rule.FrontRule`). It knows
nothing of queues, threads or clocks: the executors in :mod:`egeria.knowledge.executors` feed it the
same messages inline, in a thread or in a process, so the same sequence of evaluations
gives the same decisions in all three.

One evaluation, in two halves:

1. :meth:`Controller.reference_activation` (when the request arrives): the reference's
   activation at the watched module for the batch. The reference was refreshed at the
   previous evaluation, so the reading measures how far the module moved since then.
2. :meth:`Controller.finish` (when the readout arrives): the training activation (sent by
   the worker, or computed here by an fp32 copy of the model's front loaded with the
   weights the readout carries, the reference's running statistics and its copy of the
   modules held frozen, in eval mode), the SP loss between the two, the rule, then the
   refresh of the reference from those weights. Both sides normalize with the same running
   statistics (batch norm's) and run the same frozen front, so a reading is the watched
   weights' motion alone (docs/decisions/040-readings-hold-running-statistics.md,
   docs/decisions/041-quiet-modules-pass-the-cap.md).

The controller watches ``span`` modules at once, from the frontmost active one: one
forward pass of the reference and one of the training side, stopped at the deepest watched
module, give a reading for each (``span=1`` is the paper's one module at a time). The
front module freezes when its rule says so, and with it every module right behind it whose
own rule already says so.

With ``floor_ratio`` the controller also measures each watched module's *floor* right
after a refresh: the SP loss between the refreshed reference and the training activations
of the same weights and batch, i.e. what a reading reads when the module has not moved.
The next reading is compared with it (:class:`~egeria.knowledge.rule.FrontRule`); it costs one more
reference forward pass per refresh.

The controller keeps its own view of the frozen set: after deciding to freeze modules up to
k it watches k + 1, also on requests the worker sent before it applied that decision (which
it does D steps after the reading), until a restart (an unfreeze, or a controller replaced)
says otherwise. A request may also only refresh the reference (D steps before a reading, when
readings are further apart than D) or only read (then the refresh before the next one does).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Mapping

import torch
from torch import nn

from ..checkpoint.statecheck import Spec, index_keys, integer, mapping, number, optional, record
from ..decision import Decision
from ..partition import Partition
from .protocol import Readout, Request, Result
from .reference import ReferenceModel
from .rule import FrontRule, RuleSettings
from .similarity import Gram, sp_loss
from .threads import limited_threads
from .truncated import outputs_until
from .weights import as_mapping

__all__ = ["Controller"]

logger = logging.getLogger(__name__)


class Controller:
    """Reference model plus freezing rule for the frontmost active modules.

    Args:
        partition: the model's layer modules.
        template: a CPU fp32 copy of the model (without Egeria's hooks); kept as the fp32
            front that computes eval-mode training activations, and copied for the reference.
        precision: reference precision.
        rule: the freezing rule's settings (:class:`~egeria.knowledge.rule.RuleSettings`;
            its window is W now).
        threads: torch threads for the controller's work (None: leave torch's setting).
        span: how many modules are watched at once (1: the paper's rule).
    """

    def __init__(
        self,
        partition: Partition,
        template: nn.Module,
        *,
        precision: str,
        rule: RuleSettings,
        threads: int | None = 1,
        span: int = 1,
    ) -> None:
        self.partition = partition
        self.current = template.eval()
        self.precision = precision
        self.threads = threads
        self.span = span
        self.rule = FrontRule(rule)
        self.floors: dict[int, float] = {}  # each watched module's floor at the latest refresh
        self.reference: ReferenceModel | None = None
        self.restart(generation=0, frozen=0, window=rule.window)

    @property
    def window(self) -> int:
        return self.rule.window

    @property
    def watched(self) -> list[int]:
        """Indices of the modules read at each evaluation, front first."""
        return list(range(self.frozen, min(self.frozen + self.span, self.partition.freezable)))

    # -- one evaluation ------------------------------------------------------------

    def is_current(self, request: Request) -> bool:
        """Whether the request is about this generation's watch: its front module, or one
        before it that the controller decided to freeze and the training side has not yet
        frozen (decisions apply a fixed number of steps after their reading; the watched
        modules' activations are computed here)."""
        return (
            request.generation == self.generation
            and request.module <= self.frozen < self.partition.freezable
        )

    @torch.no_grad()
    def reference_activation(self, request: Request) -> list[torch.Tensor] | None:
        """The reference's activations at the watched modules for the reading's batch
        (None: stale, no reading asked, or no reference yet)."""
        if not self.is_current(request):
            return None
        batch = request.batch
        if request.final_weights is not None and self.reference is not None:
            self.reference.refinalize(as_mapping(request.final_weights), request.final_modules, batch)
        if self.reference is None or not request.read:
            return None
        return self.reference.activations(batch, self.watched)

    @torch.no_grad()
    def finish(self, request: Request, reference: list[torch.Tensor] | None, readout: Readout) -> Result:
        """Pairs the training activations with the reference's and runs the freezing rule."""
        started = time.perf_counter()
        result = self._finish(request, reference, readout)
        result.seconds = time.perf_counter() - started
        return result

    def _finish(self, request: Request, reference: list[torch.Tensor] | None, readout: Readout) -> Result:
        def answer(**kw) -> Result:
            return Result(request.seq, request.generation, request.step, self.frozen, **kw)

        if readout.weights is None:
            return answer(note="cancelled")
        if not self.is_current(request) or (readout.activation is not None and request.module != self.frozen):
            return answer(note="stale")  # a hooked activation is of the modules it was captured for
        if request.lag is not None and request.lag != self.rule.lag:
            self.rule.relag(request.lag)
        weights = as_mapping(readout.weights)
        watched = self.watched
        if self.reference is None or reference is None:
            note = "refreshed" if self.reference is not None else "building"
            if self.reference is None:
                self.reference = ReferenceModel(self.current, self.partition, self.precision, threads=self.threads)
            floors = note == "refreshed"  # a reference built just now has nothing to compare yet
            self._refresh(weights, request, upto=watched[-1], readout=readout, floors=floors)
            return answer(note=note)
        training = self._training(readout, weights, request, watched)
        values = [float(sp_loss(t, r)) for t, r in zip(training, reference)]
        if not all(math.isfinite(v) for v in values):
            logger.warning("non-finite plasticity at step %d (modules from %s); reading ignored", request.step, self._name(watched[0]))
            return answer(note="non-finite")
        mass = self._mass_since_refresh(request)
        straddles = request.regime is None or self.refreshed_regime is None or request.regime != self.refreshed_regime
        rows = [self._read(index, value, request, mass, straddles) for index, value in zip(watched, values)]
        shares = self.rule.compare(self._moving(watched))
        for index, row in zip(watched, rows):
            watch = self.rule.watches.get(index)
            row["active_share"] = shares.get(index)  # its smoothed reading over the most active module's
            row["idle"] = 0 if watch is None else watch.idle
        by_module = dict(zip(watched, training))
        count = self.rule.settled_front(watched, cap=self.partition.cap)
        if count:
            names = tuple(self._name(i) for i in watched[:count])
            decision = Decision(request.step, "freeze", names, self._reason(watched[0]), evaluated_at=request.step)
            result = answer(readings=rows, decision=decision)
            self._froze(count, weights, request, readout, by_module)
            return result
        if request.refresh:
            self._refresh(weights, request, watched[-1], readout, training=by_module)
        return answer(readings=rows)

    def _moving(self, watched: list[int]) -> list[int]:
        """The watched modules that may freeze while they still move: those within the cap
        (past it a module freezes only once quiet, and is no yardstick of idleness either:
        docs/decisions/041-quiet-modules-pass-the-cap.md)."""
        cap = self.partition.cap
        return watched if cap is None else [i for i in watched if i < cap]

    def _training(self, readout: Readout, weights: Mapping[str, torch.Tensor], request: Request,
                  watched: list[int]) -> list[torch.Tensor | Gram]:
        """The watched modules' training activations: the hooked ones the readout carries,
        else computed here from its weights with the reference's running statistics."""
        training = readout.activation
        if training is None:
            training = self._front(weights, request.batch, watched)
        return [t if isinstance(t, Gram) else t.float() for t in training]

    def _reason(self, index: int) -> str:
        """Why the front module ``index`` freezes, in words."""
        span = f"a span of {self.rule.span} steps"
        if self.rule.quiet(index):
            watch = self.rule.watches[index]
            return (f"the median of its plasticity readings of the last {watch.covered(watch.quiet_from)} steps within "
                    f"{self.rule.floor_ratio:g}x the reference's own error")
        if self.rule.idle(index):
            active = self.rule.active
            return (
                f"plasticity at most {self.rule.idle_share:g} of the most active watched module's "
                f"({self._name(active) if active is not None else 'unknown'}) for {span}"
            )
        tolerance = self.rule.tolerance(index) or 0.0
        why = f"plasticity slope within tolerance {tolerance:.3g} for {span}"
        outlook = self.rule.outlook(index)
        if self.rule.horizon is None or self.rule.horizon >= 1 or outlook is None or outlook.share is None:
            return why  # the condition is off: the slope decided
        why = f"{why}; drift still to come {outlook.share:.2g} of its largest"
        share = self.rule.lr_share
        return why if self.rule.low_lr is None or share is None else f"{why}; learning rate {share:.2g} of its peak"

    def _mass_since_refresh(self, request: Request) -> float | None:
        """The learning-rate mass the reading's interval held: from the reference's refresh
        to the evaluated step, what was ahead then less what is ahead now (None: the
        schedule is not known)."""
        if request.mass_ahead is None or self.refreshed_ahead is None:
            return None
        return max(self.refreshed_ahead - request.mass_ahead, 0.0)

    def _read(self, index: int, plasticity: float, request: Request, mass: float | None, straddles: bool) -> dict:
        """One module's reading through its rule; the history row."""
        lr, floor = request.lr, self.floors.get(index)
        reading = self.rule.read(index, plasticity, lr, floor, mass=mass, ahead=request.mass_ahead,
                                 peak=request.lr_peak, regime=request.regime, step=request.step, straddles=straddles)
        if not reading.counted:
            logger.debug("step %d: learning rate %.3g, a new regime: %s's average restarts", request.step, lr,
                         self._name(index))
        outlook = self.rule.outlook(index)
        return {
            "step": request.step,
            "module": self._name(index),
            "plasticity": reading.plasticity,
            "smoothed": reading.smoothed,
            "slope": reading.slope,
            "tolerance": reading.tolerance,
            "stale": reading.stale,  # consecutive stale readings
            "stale_steps": self.rule.watches[index].covered(self.rule.watches[index].stale_from),  # steps they cover
            "counted": reading.counted,  # False: it straddled a learning-rate change
            "lr": lr,  # the learning rate the evaluated step trained at (None: not known)
            "mass": mass,  # the learning-rate mass (sum of learning rates) the reading's interval held
            "mass_ahead": request.mass_ahead,  # the learning-rate mass still to come after the step
            "lr_share": self.rule.lr_share,  # the learning rate as a share of the run's peak so far
            "pace": None if outlook is None else outlook.pace,  # drift per unit of mass, median over the span
            "outlook_share": None if outlook is None else outlook.share,  # drift still to come / its largest
            "floor": reading.floor,  # the smoothed floor (None: not measured)
            "raw_floor": floor,  # the floor measured at the reading's refresh (None: not measured)
            "quiet": reading.quiet,
            "median": reading.median,  # the median of the readings the quiet verdict takes
        }

    def _front(self, weights: Mapping[str, torch.Tensor], batch: tuple, watched: list[int]) -> list[torch.Tensor]:
        """The watched modules' fp32 eval-mode outputs for the batch, with the sent weights,
        the reference's running statistics (:meth:`_statistics`) and the reference's own
        copy of the modules it holds frozen (:meth:`_held_front`)."""
        own = self.current.state_dict()
        for key, value in weights.items():
            own[key].copy_(value)
        for key, value in self._statistics().items():
            own[key].copy_(value)
        for key, value in self._held_front().items():
            own[key].copy_(value)
        blocks = [self.partition.modules[i].output_block for i in watched]
        args, kwargs = batch
        with limited_threads(self.threads):
            return outputs_until(self.current, blocks, args, kwargs)

    def _statistics(self) -> dict[str, torch.Tensor]:
        """The running statistics a training activation is computed with: the reference's,
        those of its latest refresh (none before the first).

        A reading measures how far the weights moved, so both sides of it normalize with
        one set of running statistics. Batch norm's running mean and variance are not
        trained: they track the batches the forward pass saw, and late in a run their wander
        over D steps outweighs the weights' motion (at 1/100 of the peak learning rate they
        made 96% of the demo's stem's drift: docs/decisions/040-readings-hold-running-statistics.md).
        """
        return {} if self.reference is None else self.reference.statistics()

    def _held_front(self) -> dict[str, torch.Tensor]:
        """The modules the controller holds frozen, as the reference runs them.

        A reading measures the watched modules' motion, so both sides of it run one frozen
        front. A module the controller decided to freeze trains on for D steps until the
        training side applies the decision, and its final weights reach the reference only
        with the request after that; a training side computed from the sent weights in
        between carried that module's last steps into every watched module's reading and
        into the floors measured then (a floor a thousandfold too high made (f)'s layers 2-4
        read quiet at 15% of the run: docs/decisions/041-quiet-modules-pass-the-cap.md).
        """
        return {} if self.reference is None else self.reference.final_state()

    def _froze(self, count: int, weights: Mapping[str, torch.Tensor], request: Request, readout: Readout,
               training: Mapping[int, torch.Tensor | Gram]) -> None:
        """The front ``count`` modules froze: watch the ones after them."""
        self.frozen += count
        self.rule.forget_before(self.frozen)
        self.floors = {i: v for i, v in self.floors.items() if i >= self.frozen}
        if self.frozen < self.partition.freezable:
            self._refresh(weights, request, self.watched[-1], readout, training=training)

    def _refresh(self, weights: Mapping[str, torch.Tensor], request: Request, upto: int, readout: Readout, *,
                 training: Mapping[int, torch.Tensor | Gram] | None = None, floors: bool = True) -> None:
        """Refreshes the reference from ``weights`` (``readout``'s); with ``floors`` and a
        ``floor_ratio``, measures the floors of the watched modules: of those in
        ``training`` (their training activations for these weights and the request's batch,
        just taken for a reading), or of every one when it is None."""
        assert self.reference is not None
        batch = request.batch
        floors = floors and self.rule.floor_ratio is not None
        # the reading's training activations hold the statistics the refresh replaces
        stale = floors and training is not None and readout.activation is None and _moved(self._statistics(), weights)
        self.reference.refresh(weights, self.frozen, upto, batch)
        self.readings_since_refresh = 0
        self.refreshed_ahead = request.mass_ahead
        self.refreshed_regime = request.regime
        if not floors:
            return
        indices = [i for i in self.watched if training is None or i in training]
        if not indices:
            return
        if training is None or stale:
            # (again) with the statistics the refreshed reference holds: a floor compares
            # the two sides at the same weights and the same statistics
            training = dict(zip(indices, self._training(readout, weights, request, indices)))
        for index, ref in zip(indices, self.reference.activations(batch, indices)):
            floor = float(sp_loss(training[index], ref))
            if math.isfinite(floor):
                self.floors[index] = floor

    # -- control -------------------------------------------------------------------

    def restart(self, generation: int, frozen: int, window: int) -> None:
        """Forget the reference and the watches; watch from module ``frozen`` with window
        ``window`` (the outlooks' largest values are kept).

        Sent after an unfreeze (``frozen=0``) or to a controller that replaced a failed one
        (the frozen set the worker actually has).
        """
        self.generation = generation
        self.frozen = frozen
        self.rule.restart(window)
        self.reference = None
        self.floors = {}
        self.readings_since_refresh = 0
        self.refreshed_ahead: float | None = None  # the learning-rate mass ahead at the reference's refresh
        self.refreshed_regime: int | None = None  # the schedule's latest jump at the reference's refresh

    def state_dict(self, live: Mapping[str, torch.Tensor]) -> dict:
        """JSON-safe state; ``live`` is the training model's state now."""
        return {
            "generation": self.generation,
            "frozen": self.frozen,
            **self.rule.state_dict(),  # window, watches, outlooks
            "readings_since_refresh": self.readings_since_refresh,
            "refreshed_ahead": self.refreshed_ahead,
            "refreshed_regime": self.refreshed_regime,
            "floors": {str(i): v for i, v in self.floors.items()},
            "reference": None if self.reference is None else self.reference.state_dict(live),
        }

    @staticmethod
    def state_spec(partition: Partition, weights: Mapping[str, torch.Tensor], generation: int) -> Spec:
        """What :meth:`state_dict` output holds, saved beside a link at ``generation``
        (the controller had taken every restart the link sent: the same generation), for
        ``partition`` of a model whose state is ``weights``."""
        modules = len(partition)
        return record(
            {
                "generation": integer(generation, generation),
                "frozen": integer(0, partition.freezable),
                **FrontRule.state_fields(modules),
                "readings_since_refresh": integer(0),
                "refreshed_ahead": optional(number(0)),
                "refreshed_regime": optional(integer(-1)),
                "floors": mapping(number(0), keys=index_keys(0, modules - 1)),
                "reference": optional(ReferenceModel.state_spec(partition, weights)),
            },
            optional=("floors", "refreshed_regime", *FrontRule.OPTIONAL_FIELDS),
        )

    def load_state_dict(self, state: dict, weights: Mapping[str, torch.Tensor]) -> None:
        self.generation = int(state["generation"])
        self.frozen = int(state["frozen"])
        self.rule.load_state_dict(state)
        self.readings_since_refresh = int(state["readings_since_refresh"])
        self.refreshed_ahead = state["refreshed_ahead"]
        self.refreshed_regime = state.get("refreshed_regime")  # absent before the rule's steps
        self.floors = {int(i): float(v) for i, v in state.get("floors", {}).items()}  # absent before floors
        self.reference = None
        saved = state["reference"]
        if saved is not None and saved["precision"] != self.precision:
            # Readings and floors of another precision are on another scale (an int8
            # reference's floor is far above a bf16 one's: docs/decisions/002-reference-precision.md):
            # the watches start afresh.
            logger.warning(
                "the saved reference is %s, this controller's is %s (the default changed, or another machine): "
                "it is rebuilt at the next evaluation and the modules' readings start afresh",
                saved["precision"], self.precision,
            )
            self.restart(self.generation, self.frozen, self.rule.window)
        elif saved is not None:
            try:
                reference = ReferenceModel(self.current, self.partition, self.precision, threads=self.threads)
                reference.load_state_dict(saved, weights)
            except (ValueError, RuntimeError) as err:  # a calibration that fits no block of this model
                logger.warning(
                    "the saved reference cannot be rebuilt (%s): it is rebuilt at the next evaluation and "
                    "the modules' readings start afresh", err,
                )
                self.restart(self.generation, self.frozen, self.rule.window)
            else:
                self.reference = reference

    def _name(self, index: int) -> str:
        return self.partition.modules[index].name


def _moved(held: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether any of the ``held`` running statistics differs from its value in ``weights``."""
    return any(key in weights and not torch.equal(value, weights[key].to(value.device)) for key, value in held.items())

