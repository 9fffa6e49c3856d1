"""The freezing rule: when a module's plasticity has become stationary (paper 4.2.2, Algorithm 1).

Each reading of a module's plasticity is smoothed by a moving average over the readings of
the rule's span (Equation 2; W readings at one every ``lag`` steps); a straight line is
fitted by least squares, against the step, to the smoothed values of the span; the module
is *stale* at a reading whose slope magnitude is within its tolerance T, and it freezes
once it has been stale at every reading of a whole span (the paper's W consecutive stale
readings). T is set per module from its slopes of its first 3 x ``lag`` steps (the paper's first
three): ``tolerance_ratio`` x the largest of their magnitudes. Spans are counted in optimizer steps, so how densely
readings are taken does not move them (docs/decisions/038-steps-not-readings.md).

A reading can also come with the module's *floor*: what a reading reads when the module has
not moved at all (the reference's own error against the training side, measured right after
a refresh). With ``floor_ratio``, a module is *quiet* at a reading where the median of its
readings of the last three spans (at least one span of them, since the schedule's latest
jump) is at most ``floor_ratio`` x its smoothed floor (the median of the floors of the last
span: docs/decisions/043-floor-median.md): its drift is within a few times the
reference's own error, where the slope is mostly noise (``rule="egeria"``; how far above
its floor a fine-tuned front and a front trained from scratch read:
docs/decisions/012-floor-ratio.md). Near its floor a module's readings swing tenfold from
one to the next, so the verdict is taken on their middle: no single reading makes or breaks
it, and how densely the spans are sampled moves it less
(docs/decisions/042-quiet-on-the-median.md).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from ..checkpoint.statecheck import Spec, boolean, integer, items, number, optional, record

__all__ = ["Reading", "ModuleWatch", "least_squares_slope"]

# Slopes this small next to the plasticity itself are rounding noise of the moving
# average, not movement: they count as flat even when the tolerance is 0.
_RELATIVE_FLAT = 1e-9
# The tolerance is set from the slopes of a module's first this many lags of steps (the
# paper's first three slopes, at one reading every lag).
TOLERANCE_LAGS = 3
# A learning rate this many times higher or lower than at a module's previous reading
# starts a new regime of its plasticity (rule="egeria").
REGIME_CHANGE = 2.0
# The quiet test takes the median of a module's readings of this many spans (at least one
# span of them): docs/decisions/042-quiet-on-the-median.md.
QUIET_SPANS = 3


def least_squares_slope(values: list[float], steps: Sequence[int] | None = None, unit: int = 1) -> float:
    """Slope of the least-squares line through ``values`` at x = ``steps`` / ``unit``
    (None: x = 0, 1, 2, ...), per ``unit`` steps; 0 for fewer than two values."""
    count = len(values)
    if count < 2:
        return 0.0
    xs = [float(i) for i in range(count)] if steps is None else [s / unit for s in steps]
    x_mean = math.fsum(xs) / count
    y_mean = math.fsum(values) / count
    num = math.fsum((x - x_mean) * (v - y_mean) for x, v in zip(xs, values))
    den = math.fsum((x - x_mean) ** 2 for x in xs)
    return num / den


def _appended(steps: list[int], values: list[float], step: int, value: float, since: int) -> tuple[list[int], list[float]]:
    """``steps`` and ``values`` kept from step ``since`` on, with ``value`` read at ``step`` added."""
    kept = [(s, v) for s, v in zip(steps, values) if s >= since]
    return [s for s, _ in kept] + [step], [v for _, v in kept] + [float(value)]


@dataclass(frozen=True)
class Reading:
    """What the rule made of one plasticity value."""

    plasticity: float
    smoothed: float
    slope: float | None  # None until two smoothed values exist
    tolerance: float | None  # None until the module's first three slopes are known
    stale: int  # consecutive readings with |slope| <= tolerance, this one included
    freeze: bool  # the module should freeze now
    counted: bool = True  # False: it straddled a learning-rate change and joined no average
    floor: float | None = None  # the smoothed floor, the median of the span's (None: no floor known)
    quiet: int = 0  # consecutive quiet verdicts (docs/decisions/042-quiet-on-the-median.md), this one included
    median: float | None = None  # the median of the readings the quiet verdict takes (None: not counted)


@dataclass
class ModuleWatch:
    """Running state of the freezing rule for the module being watched.

    Its timing is in optimizer steps (docs/decisions/038-steps-not-readings.md). A reading
    at step t measures the drift of the ``lag`` steps before it (the reference was refreshed
    at t - lag), so it *covers* (t - lag, t]. The rule's one span is ``window x lag`` steps
    (S): the moving average, the slope fit, the paces and the floors take the readings that
    cover steps within the last S; a module is stale, quiet or idle once every reading
    covering the last S steps was. How densely readings are taken within a span does not
    change it: at one reading every ``lag`` steps a span holds W readings, as in the paper;
    sparser readings hold fewer, and the interval is kept to at most ``(W - 1) x lag`` so
    that a span holds two at least (a slope needs two smoothed values).

    Without ``step`` a reading is taken ``lag`` steps after the previous one, so a watch fed
    readings alone counts them as the paper's Algorithm 1 does.

    Args:
        window: W, the span in readings at one reading every ``lag`` steps.
        tolerance_ratio: T as a share of the largest of the slope magnitudes of the module's
            first 3 x ``lag`` steps of slopes (the paper's first three slopes).
        floor_ratio: a reading is quiet when its smoothed plasticity is at most this many
            times the smoothed floor (None: floors are not compared).
        lag: the steps each reading's drift covers (D).
    """

    window: int
    tolerance_ratio: float
    floor_ratio: float | None = None
    lag: int = 1
    quiet_spans: ClassVar[int] = QUIET_SPANS  # the spans of readings the quiet verdict takes
    raw: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # the steps of raw and smoothed, alike
    first_slopes: list[float] = field(default_factory=list)
    first_slope_step: int | None = None
    tolerance: float | None = None
    stale: int = 0  # consecutive stale readings (for the record; decisions use stale_from)
    stale_from: int | None = None  # the step of the first reading of the current stale run
    readings: int = 0
    step: int | None = None  # the step of the latest reading
    lr: float | None = None  # the learning rate of the latest reading, where known
    regime: int | None = None  # the schedule's latest jump at the latest reading, where known
    straddling: bool = False  # the coming reading spans a learning-rate change
    floors: list[float] = field(default_factory=list)  # the floors of the span
    floor_steps: list[int] = field(default_factory=list)
    quiet: int = 0  # consecutive quiet verdicts
    quiet_from: int | None = None  # the first reading of the evidence the latest quiet verdict holds
    evidence: list[float] = field(default_factory=list)  # the raw readings of the last quiet_spans spans
    evidence_steps: list[int] = field(default_factory=list)
    idle: int = 0  # consecutive evaluations it read idle (counted by FrontRule.compare)
    idle_from: int | None = None

    @property
    def span(self) -> int:
        """S: the rule's span in steps (``window x lag``)."""
        return self.window * self.lag

    def within(self, step: int, now: int) -> bool:
        """Whether a reading at ``step`` covers only steps of the span ending at ``now``."""
        return step >= now - self.span + self.lag

    def covered(self, since: int | None, now: int | None = None) -> int:
        """The steps covered by a run of readings from the one at ``since`` to the latest
        (0: no run)."""
        now = self.step if now is None else now
        return 0 if since is None or now is None else now - since + self.lag

    def holds(self, since: int | None) -> bool:
        """Whether a run of readings from ``since`` covers a whole span."""
        return self.covered(since) >= self.span

    def new_regime(self, lr: float, regime: int | None = None, straddles: bool = True) -> bool:
        """Notes the learning rate of the coming reading and, where the schedule is known,
        its ``regime`` (the step of the schedule's latest jump of ``REGIME_CHANGE``x or more
        from one step to the next). At a new regime the moving average, its slope and the
        stale, quiet and idle runs start afresh (the tolerance stays): a span never holds
        readings of two regimes. A large LR drop moves the plasticity level within a few
        readings, and an average straddling the drop reads as a steep slope for a span after
        it (docs/decisions/014-lr-regimes.md). When ``straddles`` (the reading's own drift
        spans the jump: it compares the model after it with a reference from before it), the
        coming reading joins neither regime. A new regime is a jump of the schedule since the
        previous reading; a continuous decay is none, even where it halves the rate between
        two readings, as a cosine does near its end. Without a known schedule, a change of
        ``REGIME_CHANGE``x or more since the previous reading stands for a jump. True at a
        restart."""
        previous, self.lr = self.lr, lr
        previous_regime, self.regime = self.regime, regime
        if regime is not None and previous_regime is not None:
            jumped = regime != previous_regime
        else:
            jumped = not (previous is None or lr <= 0 or previous <= 0
                          or max(lr / previous, previous / lr) < REGIME_CHANGE)
        if not jumped:
            return False
        self.raw, self.smoothed, self.steps = [], [], []
        self.stale, self.stale_from = 0, None
        self.floors, self.floor_steps, self.quiet, self.quiet_from = [], [], 0, None
        self.evidence, self.evidence_steps = [], []
        self.idle, self.idle_from = 0, None
        self.straddling = straddles or regime is None
        return True

    def update(self, plasticity: float, floor: float | None = None, step: int | None = None) -> Reading:
        """Adds one plasticity value read at ``step`` (None: ``lag`` steps after the
        previous reading), and the module's floor where measured, and says whether the
        module should freeze.

        Raises:
            ValueError: for a value that is not a finite number, or a step before the
                previous reading's.
        """
        if not math.isfinite(plasticity):
            raise ValueError(f"plasticity reading {plasticity!r} is not finite")
        if floor is not None and not (math.isfinite(floor) and floor >= 0):
            raise ValueError(f"plasticity floor {floor!r} is not a finite number >= 0")
        if step is None:
            step = self.lag if self.step is None else self.step + self.lag
        if self.step is not None and step < self.step:
            raise ValueError(f"reading at step {step} comes before the previous one, at step {self.step}")
        self.readings += 1
        self.step = step
        if self.straddling:
            self.straddling = False
            return Reading(float(plasticity), float(plasticity), None, self.tolerance, 0, False, counted=False)
        self.raw.append(float(plasticity))
        self.steps.append(step)
        kept = [i for i, s in enumerate(self.steps) if self.within(s, step)]
        self.raw = [self.raw[i] for i in kept]
        smoothed = math.fsum(self.raw) / len(self.raw)
        self.smoothed = [self.smoothed[i] for i in kept[:-1]] + [smoothed]
        self.steps = [self.steps[i] for i in kept]
        slope = least_squares_slope(self.smoothed, self.steps, self.lag) if len(self.smoothed) >= 2 else None
        if slope is not None and self.tolerance is None:
            if self.first_slope_step is None:
                self.first_slope_step = step
            self.first_slopes.append(slope)
            if self.covered(self.first_slope_step) >= TOLERANCE_LAGS * self.lag:
                self.tolerance = self.tolerance_ratio * max(abs(s) for s in self.first_slopes)
        if slope is not None and self.tolerance is not None:
            flat_floor = _RELATIVE_FLAT * max(abs(v) for v in self.smoothed)
            stale = abs(slope) <= max(self.tolerance, flat_floor)
            self.stale, self.stale_from = (self.stale + 1, self.stale_from if self.stale else step) if stale else (0, None)
        if floor is not None:
            self.floor_steps, self.floors = _appended(self.floor_steps, self.floors, step, floor,
                                                      since=step - self.span + self.lag)
        self.evidence_steps, self.evidence = _appended(self.evidence_steps, self.evidence, step, plasticity,
                                                       since=step - self.quiet_spans * self.span + self.lag)
        level, median = self.floor_level, statistics.median(self.evidence)
        quiet = (self.floor_ratio is not None and level is not None and self.covered(self.evidence_steps[0]) >= self.span
                 and median <= self.floor_ratio * level)
        self.quiet, self.quiet_from = (self.quiet + 1, self.evidence_steps[0]) if quiet else (0, None)
        freeze = self.holds(self.stale_from) or self.holds(self.quiet_from)
        return Reading(float(plasticity), smoothed, slope, self.tolerance, self.stale, freeze, floor=level, quiet=self.quiet,
                       median=median)

    def mark_idle(self, idle: bool) -> None:
        """Notes whether the latest reading was idle (:meth:`FrontRule.compare`)."""
        self.idle, self.idle_from = (self.idle + 1, self.idle_from if self.idle else self.step) if idle else (0, None)

    @property
    def floor_level(self) -> float | None:
        """The smoothed floor: the median of the floors of the span (None: none known). A
        module's floor swings up to tenfold from one reading to the next, and a mean of the
        two or three floors a span holds after a schedule jump follows one stray floor; the
        median does not (docs/decisions/043-floor-median.md)."""
        return statistics.median(self.floors) if self.floors else None

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "tolerance_ratio": self.tolerance_ratio,
            "lag": self.lag,
            "raw": list(self.raw),
            "smoothed": list(self.smoothed),
            "steps": list(self.steps),
            "first_slopes": list(self.first_slopes),
            "first_slope_step": self.first_slope_step,
            "tolerance": self.tolerance,
            "stale": self.stale,
            "stale_from": self.stale_from,
            "readings": self.readings,
            "step": self.step,
            "lr": self.lr,
            "regime": self.regime,
            "straddling": self.straddling,
            "floor_ratio": self.floor_ratio,
            "floors": list(self.floors),
            "floor_steps": list(self.floor_steps),
            "quiet": self.quiet,
            "quiet_from": self.quiet_from,
            "evidence": list(self.evidence),
            "evidence_steps": list(self.evidence_steps),
            "idle": self.idle,
            "idle_from": self.idle_from,
        }

    @classmethod
    def from_state(cls, state: dict) -> ModuleWatch:
        """The watch a :meth:`state_dict` saved. One saved before the rule's timing was in
        steps (no ``steps``) counted readings: its runs and averages cannot be placed on
        steps, so they start afresh (its tolerance, learning rate and regime stay). One saved
        before the quiet test took the median holds the readings of one span: they
        are its evidence."""
        if "steps" not in state:
            kept = ("window", "tolerance_ratio", "floor_ratio", "first_slopes", "tolerance", "readings", "lr", "regime")
            watch = cls(**{k: state[k] for k in kept if k in state})
            if watch.tolerance is None:
                watch.first_slopes = []
            return watch
        watch = cls(**state)
        if "evidence" not in state:  # saved before the quiet test took the median: its span's readings
            watch.evidence, watch.evidence_steps = list(watch.raw), list(watch.steps)
        return watch

    @staticmethod
    def state_spec() -> Spec:
        """What :meth:`state_dict` output holds (fields added later may be absent)."""
        values = items(number())
        steps = items(integer(0))
        return record(
            {
                "window": integer(1, 10**6),
                "tolerance_ratio": number(0),
                "floor_ratio": optional(number(0)),
                "lag": integer(1, 10**9),
                "raw": values,
                "smoothed": values,
                "steps": steps,
                "first_slopes": values,
                "first_slope_step": optional(integer(0)),
                "tolerance": optional(number(0)),
                "stale": integer(0),
                "stale_from": optional(integer(0)),
                "readings": integer(0),
                "step": optional(integer(0)),
                "lr": optional(number(0)),
                "regime": optional(integer(-1)),
                "straddling": boolean,
                "floors": items(number(0)),
                "floor_steps": steps,
                "quiet": integer(0),
                "quiet_from": optional(integer(0)),
                "evidence": values,
                "evidence_steps": steps,
                "idle": integer(0),
                "idle_from": optional(integer(0)),
            },
            optional=("floor_ratio", "lag", "raw", "smoothed", "steps", "first_slopes", "first_slope_step", "tolerance",
                      "stale", "stale_from", "readings", "step", "lr", "regime", "straddling", "floors", "floor_steps",
                      "quiet", "quiet_from", "evidence", "evidence_steps", "idle", "idle_from"),
        )
