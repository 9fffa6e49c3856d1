"""The freezing rule over the front modules being watched (paper Algorithm 1, and Egeria's
own criterion: the movement still to come).

It holds no model and no reference: it takes plasticity readings, with what the run's
learning-rate schedule says of them, and says which front modules may freeze; the
controller feeds it live readings and a study can feed it the readings a run recorded
(``benchmarks/studies/movement_ahead.py``).

Egeria's criterion (``horizon`` set). A reading measures how far a module drifted since
the reference was last refreshed, that is its drift *rate*, not the distance it still has
to go (docs/decisions/007-readings-measure-rate.md); and a freeze costs what the later
learning rate would still have moved the module (docs/decisions/006-never-unfreeze.md).
The criterion is docs/decisions/008-horizon.md. Both are read from the
schedule, whatever scheduler built it (:mod:`egeria.lr_schedule`):

- the module's *pace*: its drift per unit of learning-rate mass, a reading over the sum
  of the learning rates of its interval's steps (the median of the last W such values, so
  that one heavy-tailed reading moves nothing);
- its *outlook*: the pace times the mass still ahead (the sum of the learning rates of the
  steps to come), the drift still to come if it goes on as it does now; and the outlook's
  share of the largest it has had in the run.

A module freezes when its readings say it has settled, by the paper's test (the slope of
its smoothed readings within tolerance for W readings), and its outlook has fallen to at
most ``horizon`` of its largest: a module settled at a high learning rate still has most
of its movement ahead, one settled after the schedule has spent its mass has not, whether
the schedule steps, decays smoothly or warms up first. A module whose readings sit within
``floor_ratio`` of the reference's own error for W readings (*quiet*: its drift cannot be
told from none, as a pretrained front's in fine-tuning) freezes on that alone, however
much mass is ahead. So does a module whose smoothed plasticity stays at most
``idle_share`` (1/100) of the most active watched module's for W readings (*idle*: a
pretrained layer being adapted, whose outputs move a hundredth as much as the layers the
network is learning with; docs/decisions/032-idle-modules.md). Without a known schedule
(``ReduceLROnPlateau``, an unknown length) no outlook exists, and only quiet and idle
modules freeze.

And a module that is neither quiet nor idle freezes only once the learning rate has come down to
``low_lr`` of the run's peak (``EgeriaConfig.speed``: 1/100 by default): a
frozen module keeps the iterate it had, and under a schedule that decays continuously the
end of training lowers the loss by annealing the weights while they hardly move, which the
drift still to come does not see. Every freeze measured at 1/100 of the peak or lower
(after a step schedule's two tenfold decays) cost nothing, those at 1/10 and above cost
accuracy (docs/decisions/030-freeze-at-low-lr.md). The peak is the highest learning rate
the rule has been told of: the schedule's, and every reading's. Unless it is *spent*: settled
by the slope test with its pace at most ``spent_share`` (1/100) of the fastest it has had
times the learning rate's share of its peak, fallen a hundredfold beyond what the rate's own
fall explains (a pretrained layer done adapting while the rate is still high). A spent module
freezes whatever its outlook and the learning rate: both multiply the mass ahead by a pace
that no longer follows the rate. Only at ``speed="fast"``, where a cost is accepted
(docs/decisions/034-spent-modules.md).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from ..checkpoint.statecheck import Spec, index_keys, integer, items, mapping, number, optional, record
from .plasticity import ModuleWatch, Reading

__all__ = ["FrontRule", "IDLE_SHARE", "Outlook", "RuleSettings", "SPENT_SHARE", "at_most"]

# Learning rates are products of factors (0.1 * 0.1 * lr is not 0.01 * lr in floats): a
# rate this close above the bound is at it.
_LR_SLACK = 1e-6


#: A module reading at most this share of the most active watched module's plasticity is
#: idle (docs/decisions/032-idle-modules.md): two orders of magnitude on the readings' own
#: scale (the SP loss is scale-free, so modules' readings compare), where no module of the
#: suite's runs trained from scratch, nor of its weakly pretrained GPT, reads idle (at 3/100
#: the GPT's front does, and freezing it early costs).
IDLE_SHARE = 0.01

#: A settled module whose pace (drift per unit of learning-rate mass) is at most this share of
#: the fastest it has had, times the learning rate's share of its peak, is spent and freezes
#: whatever its outlook and the learning rate (docs/decisions/034-spent-modules.md): the same
#: two orders of magnitude, beyond what the rate's fall explains. On the suite's committed
#: readings only (f)'s layer 3 reads spent, at 25-29% of the run; frozen there after layer 2's
#: early idle freeze it cost up to 0.5 points, so the test is part of speed="fast" only.
SPENT_SHARE = 0.01


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
        window: W, the readings a module must stay settled for, at the start (the rule
            holds the current one: the policy halves it at an unfreeze).
        tolerance_ratio: the slope test's tolerance as a share of the largest of the
            first three slope magnitudes (:class:`~egeria.knowledge.plasticity.ModuleWatch`).
        horizon: Egeria's criterion: a settled module freezes once its outlook is at most
            this share of its largest (None or 1.0: the slope test alone, as in the paper).
        regimes: a reading whose learning rate differs 2x or more from the module's
            previous one restarts that module's moving average, stale count and paces, and
            is itself left out of them (:meth:`ModuleWatch.new_regime`).
        floor_ratio: a module also settles after W consecutive readings whose smoothed
            plasticity is at most this many times its smoothed floor (what it reads when it
            has not moved). None: floors are not compared (nor measured).
        low_lr: a module that is neither quiet nor idle freezes only at a learning rate at
            most this share of the run's peak (None: any learning rate, as in the paper).
        idle_share: a module also settles after W consecutive evaluations whose smoothed
            plasticity is at most this share of the largest smoothed plasticity among the
            modules watched with it (:meth:`FrontRule.compare`; None: not compared).
        spent_share: a settled module (W stale readings) whose pace is at most this share of
            its fastest times the learning rate's share of its peak freezes whatever its
            outlook and ``low_lr`` (:meth:`FrontRule.spent`; None: never).
    """

    window: int
    tolerance_ratio: float
    horizon: float | None = None
    regimes: bool = False
    floor_ratio: float | None = None
    low_lr: float | None = None
    idle_share: float | None = None
    spent_share: float | None = None


class Outlook:
    """One module's pace (drift per unit of learning-rate mass) and outlook.

    Args:
        window: how many paces the median is taken over (W).
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.paces: list[float] = []  # the last W readings' drift per unit of mass
        self.ahead: float | None = None  # the learning-rate mass ahead at the latest reading
        self.largest = 0.0  # the largest outlook the module has had in the run
        self.fastest = 0.0  # the largest pace the module has had in the run

    def add(self, plasticity: float, mass: float | None, ahead: float | None) -> None:
        """A reading over an interval holding learning-rate mass ``mass`` (the sum of its
        steps' learning rates), with ``ahead`` still to come (None: not known)."""
        self.ahead = ahead
        if mass is not None and mass > 0:
            self.paces = (self.paces + [plasticity / mass])[-self.window:]
            self.fastest = max(self.fastest, self.pace)
        value = self.value
        if value is not None:
            self.largest = max(self.largest, value)

    def restart(self) -> None:
        """A new regime of the learning rate: the paces start afresh (the largest and the
        fastest stay)."""
        self.paces = []

    @property
    def pace(self) -> float | None:
        return statistics.median(self.paces) if self.paces else None

    @property
    def pace_share(self) -> float | None:
        """The pace as a share of the fastest the module has had (None: no pace yet)."""
        pace = self.pace
        return None if pace is None or self.fastest <= 0 else pace / self.fastest

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
        return {"paces": list(self.paces), "ahead": self.ahead, "largest": self.largest, "fastest": self.fastest}

    @classmethod
    def from_state(cls, window: int, state: dict) -> Outlook:
        outlook = cls(window)
        outlook.paces = [float(p) for p in state["paces"]][-window:]
        outlook.ahead = None if state["ahead"] is None else float(state["ahead"])
        outlook.largest = float(state["largest"])
        # a state from before the spent test: the fastest known is among the paces it kept
        outlook.fastest = float(state.get("fastest", max(outlook.paces, default=0.0)))
        return outlook

    @staticmethod
    def state_spec() -> Spec:
        return record({"paces": items(number(0)), "ahead": optional(number(0)), "largest": number(0),
                       "fastest": number(0)}, optional=("fastest",))


class FrontRule:
    """The rule's state for the watched modules.

    Args:
        settings: the rule's settings (:class:`RuleSettings`); W starts at its window.
    """

    def __init__(self, settings: RuleSettings) -> None:
        self.settings = settings
        self.window = settings.window  # the current W (restart() sets it)
        self.tolerance_ratio = settings.tolerance_ratio
        self.horizon = settings.horizon
        self.regimes = settings.regimes
        self.floor_ratio = settings.floor_ratio
        self.low_lr = settings.low_lr
        self.idle_share = settings.idle_share
        self.spent_share = settings.spent_share
        self.active: int | None = None  # the most active module at the latest compare()
        self.lr: float | None = None  # the learning rate of the latest reading
        self.peak: float | None = None  # the highest learning rate of the run known so far
        self.watches: dict[int, ModuleWatch] = {}
        self.outlooks: dict[int, Outlook] = {}  # kept across restarts: their largest is the run's

    def read(self, index: int, plasticity: float, lr: float | None = None, floor: float | None = None, *,
             mass: float | None = None, ahead: float | None = None, peak: float | None = None,
             regime: int | None = None) -> Reading:
        """Module ``index``'s plasticity at a step trained at learning rate ``lr`` (None:
        not known), with its floor where measured, through its watch; ``mass`` is the
        learning-rate mass the reading's interval held (the sum of its steps' learning
        rates), ``ahead`` the mass still to come after it, ``peak`` the schedule's
        highest learning rate and ``regime`` the step of the schedule's latest jump
        (:meth:`egeria.lr_schedule.LRSchedule.last_jump`; each None: the schedule is not
        known, and a 2x change of ``lr`` since the previous reading marks a new regime).

        Raises:
            ValueError: for a value that is not a finite number.
        """
        watch = self.watches.get(index)
        if watch is None:
            watch = self.watches[index] = ModuleWatch(self.window, self.tolerance_ratio, self.floor_ratio)
        outlook = self.outlooks.get(index)
        if outlook is None:
            outlook = self.outlooks[index] = Outlook(self.window)
        if self.regimes and lr is not None and watch.new_regime(lr, regime):
            outlook.restart()
        self.lr = lr
        for known in (lr, peak):
            if known is not None and (self.peak is None or known > self.peak):
                self.peak = known
        reading = watch.update(plasticity, floor)
        if reading.counted:
            outlook.add(reading.plasticity, mass, ahead)
        else:
            outlook.ahead = ahead
        return reading

    def outlook(self, index: int) -> Outlook | None:
        return self.outlooks.get(index)

    def compare(self, indices: Sequence[int]) -> dict[int, float]:
        """An evaluation's readings of ``indices`` are in (each through :meth:`read`): each
        module's smoothed plasticity as a share of the largest among them, and, with
        ``idle_share``, the count of consecutive evaluations each read at most that share
        (idle). A module alone, or one without a smoothed reading since the schedule's
        last jump, is not idle; nor is any module while the most active one reads at its
        floor (a share of readings that are all noise says nothing).

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
                idle = moving and len(shares) > 1 and index in shares and shares[index] <= self.idle_share
                watch.idle = watch.idle + 1 if idle else 0
        return shares

    def settled(self, index: int) -> bool:
        """The rule says freeze: W quiet readings (at the floor) or W idle ones (at most
        ``idle_share`` of the most active module's); or W stale readings and the module spent
        (:meth:`spent`) or (under Egeria's criterion) an outlook at most ``horizon`` of its
        largest at a learning rate at most ``low_lr`` of the peak."""
        watch = self.watches.get(index)
        if watch is None or not watch.smoothed:
            return False
        if self.quiet(index) or self.idle(index):
            return True
        if watch.stale < self.window:
            return False
        if self.spent(index):
            return True
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
        """Whether the learning rate is low enough for a module that is not quiet to freeze."""
        if self.low_lr is None:
            return True
        share = self.lr_share
        return share is not None and at_most(share, self.low_lr)

    def spent(self, index: int) -> bool:
        """Whether module ``index``'s pace has fallen to at most ``spent_share`` of its fastest
        times the learning rate's share of its peak: a hundredfold beyond what the rate's own
        fall explains (False where either share is not known)."""
        outlook = self.outlooks.get(index)
        pace_share = None if outlook is None else outlook.pace_share
        lr_share = self.lr_share
        if self.spent_share is None or pace_share is None or lr_share is None:
            return False
        return pace_share <= self.spent_share * lr_share

    def quiet(self, index: int) -> bool:
        """Whether module ``index`` has read at its floor for W readings."""
        watch = self.watches.get(index)
        return watch is not None and watch.quiet >= self.window

    def idle(self, index: int) -> bool:
        """Whether module ``index`` has read idle for W evaluations."""
        watch = self.watches.get(index)
        return watch is not None and watch.idle >= self.window

    def settled_front(self, indices: Sequence[int]) -> int:
        """How many of ``indices`` (front first) have settled, counted from the front up to
        the first that has not."""
        count = 0
        while count < len(indices) and self.settled(indices[count]):
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

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "lr": self.lr,
            "peak": self.peak,
            "watches": {str(i): w.state_dict() for i, w in self.watches.items()},
            "outlooks": {str(i): o.state_dict() for i, o in self.outlooks.items()},
        }

    # fields a state written before they existed lacks
    OPTIONAL_FIELDS = ("lr", "peak")

    @staticmethod
    def state_fields(modules: int) -> dict[str, Spec]:
        """The fields :meth:`state_dict` writes, for a partition of ``modules`` modules."""
        index = index_keys(0, modules - 1)
        return {
            "window": integer(1, 10**6),
            "lr": optional(number(0)),
            "peak": optional(number(0)),
            "watches": mapping(ModuleWatch.state_spec(), keys=index),
            "outlooks": mapping(Outlook.state_spec(), keys=index),
        }

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state["window"])
        # a state from before the learning-rate bound: the schedule's peak is told again
        # at the next reading (from the scheduler's position on, at least the rate there)
        self.lr = None if state.get("lr") is None else float(state["lr"])
        self.peak = None if state.get("peak") is None else float(state["peak"])
        self.watches = {int(i): ModuleWatch.from_state(w) for i, w in state["watches"].items()}
        self.outlooks = {int(i): Outlook.from_state(self.window, o) for i, o in state["outlooks"].items()}

