"""The freezing rule over the front modules being watched (paper Algorithm 1, and Egeria's
own criterion: the movement still to come).

It holds no model and no reference: it takes plasticity readings, with what the run's
learning-rate schedule says of them, and says which front modules may freeze; the
controller feeds it live readings and a study can feed it the readings a run recorded
(``benchmarks/studies/span_replay.py``).

**Its timing is in optimizer steps** (docs/decisions/038-steps-not-readings.md). A reading at
step t measures how far a module drifted in the ``lag`` steps since the reference was
refreshed (D, 20 by default): its drift *rate*, not the distance it still has to go
(docs/decisions/007-readings-measure-rate.md). The rule's one span is S = W x D steps (60 by
default); readings are samples within it, as dense as the cost budget allows, at most
(W - 1) x D apart so that a span holds two. No span grows with the reading interval, so a
faster or slower machine samples the same spans more or less densely and freezes the same
modules within one reading interval.

**The rule, whole** (each part a general principle, stated once here):

1. *Settled*: the slope of the module's smoothed readings, fitted against the step, stayed
   within its tolerance at every reading of a span (the paper's test: its drift stopped
   falling).
2. *Still*: it no longer moves at all, by either scale: *quiet*, the median of its readings
   of the last three spans (a span of them at least) within ``floor_ratio`` of the
   reference's own error (a pretrained front in fine-tuning: docs/decisions/012-floor-ratio.md;
   the median, so that no single reading makes or breaks the verdict:
   docs/decisions/042-quiet-on-the-median.md), or *idle* for a span, at most ``idle_share`` (1/100) of the most
   active watched module's within the cap (a pretrained layer being adapted while the layers
   the network learns with move a hundredfold more: docs/decisions/032-idle-modules.md). A
   still module freezes on that alone, however much of the schedule is ahead.
3. *Little still to come* (Egeria's criterion, ``horizon`` set): a settled module freezes
   only once what the rest of the run would still change in it is small, bounded two ways:
   its *outlook*, its pace (drift per unit of learning-rate mass, the median over the span)
   times the learning-rate mass still ahead, at most ``horizon`` of the largest it has had
   (docs/decisions/008-horizon.md); and the learning rate, at most ``low_lr`` of the run's
   peak (``EgeriaConfig.speed``), since the end of a decaying schedule lowers the loss by
   annealing weights that hardly move, which the pace does not see
   (docs/decisions/030-freeze-at-low-lr.md). Without a known schedule there is no outlook and
   only still modules freeze.

A span never holds readings of two regimes of the schedule: at a jump of the learning rate
(2x or more from one step to the next) each module's span starts afresh, and a reading whose
own drift spans the jump joins neither (docs/decisions/014-lr-regimes.md).

*The cap* bounds what freezes while it still moves: past ``max_frozen_flops`` of the weight
computation a module freezes only once quiet, the one test on an absolute scale, which no
other module sets (:meth:`FrontRule.settled_front`; the idle test's yardstick is the most
active module within the cap: docs/decisions/041-quiet-modules-pass-the-cap.md). Outside this
module the policy adds the other parts of the whole rule: bootstrapping (no reading before
the training loss settles) and the frozen set growing as a prefix.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from ..checkpoint.statecheck import Spec, index_keys, integer, items, mapping, number, optional, record
from .plasticity import ModuleWatch, Reading

__all__ = ["FrontRule", "IDLE_SHARE", "Outlook", "RuleSettings", "at_most"]

# Learning rates are products of factors (0.1 * 0.1 * lr is not 0.01 * lr in floats): a
# rate this close above the bound is at it.
_LR_SLACK = 1e-6


#: A module reading at most this share of the most active watched module's plasticity is
#: idle (docs/decisions/032-idle-modules.md): two orders of magnitude on the readings' own
#: scale (the SP loss is scale-free, so modules' readings compare), where no module of the
#: suite's runs trained from scratch, nor of its weakly pretrained GPT, reads idle (at 3/100
#: the GPT's front does, and freezing it early costs).
IDLE_SHARE = 0.01


def at_most(share: float, bound: float) -> bool:
    """Whether a learning rate ``share`` of the peak is at most ``bound`` of it (within the
    float slack of a rate built as a product of factors)."""
    return share <= bound * (1 + _LR_SLACK)


@dataclass(frozen=True)
class RuleSettings:
    """The freezing rule's settings: built once from the config, where the policy is
    built (:func:`egeria.knowledge.policy.rule_settings`), and carried whole to the
    controller (:class:`~egeria.knowledge.service.ControllerSpec`) and the rule. A new
    setting is a field here and a line there.

    Attributes:
        window: W: the span is W x ``lag`` steps (the policy halves W at an unfreeze under
            the paper's rule; the rule holds the current one).
        tolerance_ratio: the slope test's tolerance as a share of the largest slope
            magnitude of a module's first span
            (:class:`~egeria.knowledge.plasticity.ModuleWatch`).
        horizon: Egeria's criterion: a settled module freezes once its outlook is at most
            this share of its largest (None or 1.0: the slope test alone, as in the paper).
        regimes: a jump of the schedule (or, without one known, a 2x change of the learning
            rate between readings) starts each module's span afresh
            (:meth:`ModuleWatch.new_regime`).
        floor_ratio: a module is quiet at readings where the median of its readings of the
            last three spans is at most this many times its floor (what it reads when it
            has not moved; the median of the floors of the last span). None: floors are not
            compared (nor measured).
        low_lr: a module that is not still freezes only at a learning rate at most this
            share of the run's peak (None: any learning rate, as in the paper).
        idle_share: a module is idle at evaluations where its smoothed plasticity is at
            most this share of the largest among the modules watched with it
            (:meth:`FrontRule.compare`; None: not compared).
        lag: D, the steps each reading's drift covers (from the reference's refresh to the
            reading); the span is W x D steps.
    """

    window: int
    tolerance_ratio: float
    horizon: float | None = None
    regimes: bool = False
    floor_ratio: float | None = None
    low_lr: float | None = None
    idle_share: float | None = None
    lag: int = 1


class Outlook:
    """One module's pace (drift per unit of learning-rate mass) and outlook.

    Args:
        window: W, so that the span is ``window x lag`` steps.
        lag: the steps each reading's drift covers (the pace is the median over the
            readings of the span).
    """

    def __init__(self, window: int, lag: int = 1) -> None:
        self.window = window
        self.lag = lag
        self.paces: list[float] = []  # the span's readings' drift per unit of mass
        self.steps: list[int] = []  # their steps
        self.ahead: float | None = None  # the learning-rate mass ahead at the latest reading
        self.largest = 0.0  # the largest outlook the module has had in the run

    def add(self, plasticity: float, mass: float | None, ahead: float | None, step: int | None = None) -> None:
        """A reading at ``step`` (None: ``lag`` steps after the previous one) over an interval
        holding learning-rate mass ``mass`` (the sum of its steps' learning rates), with
        ``ahead`` still to come (None: not known)."""
        self.ahead = ahead
        if mass is not None and mass > 0:
            if step is None:
                step = self.steps[-1] + self.lag if self.steps else self.lag
            kept = [(s, p) for s, p in zip(self.steps, self.paces) if s >= step - self.window * self.lag + self.lag]
            self.steps = [s for s, _ in kept] + [step]
            self.paces = [p for _, p in kept] + [plasticity / mass]
        value = self.value
        if value is not None:
            self.largest = max(self.largest, value)

    def restart(self) -> None:
        """A new regime of the learning rate: the paces start afresh (the largest stays)."""
        self.paces, self.steps = [], []

    @property
    def pace(self) -> float | None:
        return statistics.median(self.paces) if self.paces else None

    @property
    def value(self) -> float | None:
        """The drift still to come at the current pace (None: pace or mass ahead unknown)."""
        pace = self.pace
        return None if pace is None or self.ahead is None else pace * self.ahead

    @property
    def share(self) -> float | None:
        """The outlook as a share of the largest it has had (None: not known)."""
        value = self.value
        if value is None or self.largest <= 0:
            return None
        return value / self.largest

    def state_dict(self) -> dict:
        return {"paces": list(self.paces), "steps": list(self.steps), "ahead": self.ahead, "largest": self.largest}

    @classmethod
    def from_state(cls, window: int, state: dict, lag: int = 1) -> Outlook:
        """The outlook a :meth:`state_dict` saved; one saved before the rule's timing was in
        steps (no ``steps``) keeps its largest and starts its paces afresh."""
        outlook = cls(window, lag)
        if "steps" in state:
            outlook.paces = [float(p) for p in state["paces"]]
            outlook.steps = [int(s) for s in state["steps"]]
        outlook.ahead = None if state["ahead"] is None else float(state["ahead"])
        outlook.largest = float(state["largest"])
        return outlook

    @staticmethod
    def state_spec() -> Spec:
        return record({"paces": items(number(0)), "steps": items(integer(0)), "ahead": optional(number(0)),
                       "largest": number(0), "fastest": number(0)}, optional=("steps", "fastest"))


class FrontRule:
    """The rule's state for the watched modules.

    Args:
        settings: the rule's settings (:class:`RuleSettings`); W starts at its window.
    """

    def __init__(self, settings: RuleSettings) -> None:
        self.settings = settings
        self.window = settings.window  # the current W (restart() sets it)
        self.lag = settings.lag
        self.tolerance_ratio = settings.tolerance_ratio
        self.horizon = settings.horizon
        self.regimes = settings.regimes
        self.floor_ratio = settings.floor_ratio
        self.low_lr = settings.low_lr
        self.idle_share = settings.idle_share
        self.active: int | None = None  # the most active module at the latest compare()
        self.lr: float | None = None  # the learning rate of the latest reading
        self.peak: float | None = None  # the highest learning rate of the run known so far
        self.watches: dict[int, ModuleWatch] = {}
        self.outlooks: dict[int, Outlook] = {}  # kept across restarts: their largest is the run's

    @property
    def span(self) -> int:
        """S: the steps a module must stay settled, quiet or idle (``window x lag``)."""
        return self.window * self.lag

    def read(self, index: int, plasticity: float, lr: float | None = None, floor: float | None = None, *,
             mass: float | None = None, ahead: float | None = None, peak: float | None = None,
             regime: int | None = None, step: int | None = None, straddles: bool = True) -> Reading:
        """Module ``index``'s plasticity at ``step`` (None: ``lag`` steps after its previous
        reading), trained at learning rate ``lr`` (None: not known), with its floor where
        measured, through its watch; ``mass`` is the learning-rate mass the reading's interval
        held (the sum of its steps' learning rates), ``ahead`` the mass still to come after
        it, ``peak`` the schedule's highest learning rate and ``regime`` the step of the
        schedule's latest jump (:meth:`egeria.lr_schedule.LRSchedule.last_jump`; each None:
        the schedule is not known, and a 2x change of ``lr`` since the previous reading
        marks a new regime); ``straddles``: the reading's own drift spans that jump.

        Raises:
            ValueError: for a value that is not a finite number.
        """
        watch = self.watches.get(index)
        if watch is None:
            watch = self.watches[index] = ModuleWatch(self.window, self.tolerance_ratio, self.floor_ratio, self.lag)
        outlook = self.outlooks.get(index)
        if outlook is None:
            outlook = self.outlooks[index] = Outlook(self.window, self.lag)
        if self.regimes and lr is not None and watch.new_regime(lr, regime, straddles):
            outlook.restart()
        self.lr = lr
        for known in (lr, peak):
            if known is not None and (self.peak is None or known > self.peak):
                self.peak = known
        reading = watch.update(plasticity, floor, step)
        if reading.counted:
            outlook.add(reading.plasticity, mass, ahead, watch.step)
        else:
            outlook.ahead = ahead
        return reading

    def outlook(self, index: int) -> Outlook | None:
        return self.outlooks.get(index)

    def compare(self, indices: Sequence[int]) -> dict[int, float]:
        """An evaluation's readings of ``indices`` are in (each through :meth:`read`): each
        module's smoothed plasticity as a share of the largest among them, and, with
        ``idle_share``, whether each read at most that share (idle). A module alone, or one
        without a smoothed reading since the schedule's last jump, is not idle; nor is any
        module while the most active one reads at its floor (a share of readings that are
        all noise says nothing).

        Returns:
            module index -> its share of the most active module's smoothed plasticity.
        """
        latest = {i: self.watches[i].smoothed[-1] for i in indices if i in self.watches and self.watches[i].smoothed}
        top = max(latest.values(), default=0.0)
        self.active = max(latest, key=latest.__getitem__) if latest else None
        shares = {i: value / top for i, value in latest.items()} if top > 0 else {}
        moving = self.active is not None and self.watches[self.active].quiet == 0
        if self.idle_share is not None:
            for index in indices:
                watch = self.watches.get(index)
                if watch is None:
                    continue
                watch.mark_idle(moving and len(shares) > 1 and index in shares and shares[index] <= self.idle_share)
        return shares

    def settled(self, index: int) -> bool:
        """The rule says freeze: the module is still (:meth:`still`) for a span, or it has
        settled (stale at every reading of a span) and little movement is still to come
        (:meth:`little_to_come`)."""
        watch = self.watches.get(index)
        if watch is None or not watch.smoothed:
            return False
        if self.still(index):
            return True
        return watch.holds(watch.stale_from) and self.little_to_come(index)

    def still(self, index: int) -> bool:
        """Whether module ``index`` no longer moves at all, by either scale, for a span:
        quiet (its drift within ``floor_ratio`` of the reference's own error) or idle (at
        most ``idle_share`` of the most active watched module's drift)."""
        return self.quiet(index) or self.idle(index)

    def little_to_come(self, index: int) -> bool:
        """Whether little movement is still to come for module ``index`` (Egeria's criterion;
        always, with ``horizon`` None or 1): its outlook is at most ``horizon`` of its
        largest and the learning rate at most ``low_lr`` of the peak. The two bound one
        quantity, what the rest of the run would still change in the module: the outlook
        the drift it would still make at its pace, the learning rate what annealing at a
        low rate still gives, which its pace does not see (docs/decisions/030-freeze-at-low-lr.md)."""
        if self.horizon is None or self.horizon >= 1:
            return True
        outlook = self.outlooks.get(index)
        share = outlook.share if outlook is not None else None
        return share is not None and share <= self.horizon and self.lr_low()

    @property
    def lr_share(self) -> float | None:
        """The latest reading's learning rate as a share of the peak (None: not known)."""
        if self.lr is None or not self.peak:
            return None
        return self.lr / self.peak

    def lr_low(self) -> bool:
        """Whether the learning rate is low enough for a module that is not still to freeze."""
        if self.low_lr is None:
            return True
        share = self.lr_share
        return share is not None and at_most(share, self.low_lr)

    def quiet(self, index: int) -> bool:
        """Whether module ``index`` reads at its floor: the median of its readings of the last
        three spans, a span of them at least."""
        watch = self.watches.get(index)
        return watch is not None and watch.holds(watch.quiet_from)

    def idle(self, index: int) -> bool:
        """Whether module ``index`` has read idle for a span."""
        watch = self.watches.get(index)
        return watch is not None and watch.holds(watch.idle_from)

    def settled_front(self, indices: Sequence[int], cap: int | None = None) -> int:
        """How many of ``indices`` (front first) have settled, counted from the front up to
        the first that has not; a module from index ``cap`` on (past the FLOPs cap) counts
        only once quiet."""
        count = 0
        while count < len(indices):
            index = indices[count]
            if not (self.quiet(index) if cap is not None and index >= cap else self.settled(index)):
                break
            count += 1
        return count

    def tolerance(self, index: int) -> float | None:
        watch = self.watches.get(index)
        return None if watch is None else watch.tolerance

    def forget_before(self, index: int) -> None:
        """Modules before ``index`` froze: their watches and outlooks go."""
        self.watches = {i: w for i, w in self.watches.items() if i >= index}
        self.outlooks = {i: o for i, o in self.outlooks.items() if i >= index}

    def restart(self, window: int) -> None:
        """Every watch starts afresh with window ``window``; the outlooks' paces too (their
        largest stays)."""
        self.window = window
        self.watches = {}
        for outlook in self.outlooks.values():
            outlook.window = window
            outlook.restart()

    def relag(self, lag: int) -> None:
        """Each reading now covers ``lag`` steps (the training side fixed D once it knew
        the run): the watches and outlooks take it."""
        self.lag = lag
        for watch in self.watches.values():
            watch.lag = lag
        for outlook in self.outlooks.values():
            outlook.lag = lag

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "lag": self.lag,
            "lr": self.lr,
            "peak": self.peak,
            "watches": {str(i): w.state_dict() for i, w in self.watches.items()},
            "outlooks": {str(i): o.state_dict() for i, o in self.outlooks.items()},
        }

    # fields a state written before they existed lacks
    OPTIONAL_FIELDS = ("lr", "peak", "lag")

    @staticmethod
    def state_fields(modules: int) -> dict[str, Spec]:
        """The fields :meth:`state_dict` writes, for a partition of ``modules`` modules."""
        index = index_keys(0, modules - 1)
        return {
            "window": integer(1, 10**6),
            "lag": integer(1, 10**9),
            "lr": optional(number(0)),
            "peak": optional(number(0)),
            "watches": mapping(ModuleWatch.state_spec(), keys=index),
            "outlooks": mapping(Outlook.state_spec(), keys=index),
        }

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state["window"])
        self.lag = int(state.get("lag", self.lag))  # absent before the rule's steps
        # a state from before the learning-rate bound: the schedule's peak is told again
        # at the next reading (from the scheduler's position on, at least the rate there)
        self.lr = None if state.get("lr") is None else float(state["lr"])
        self.peak = None if state.get("peak") is None else float(state["peak"])
        self.watches = {int(i): ModuleWatch.from_state({"lag": self.lag, **w}) for i, w in state["watches"].items()}
        for watch in self.watches.values():
            watch.window = self.window
        self.outlooks = {int(i): Outlook.from_state(self.window, o, self.lag) for i, o in state["outlooks"].items()}

