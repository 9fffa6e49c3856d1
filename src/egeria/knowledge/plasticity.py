"""The freezing rule: when a module's plasticity has become stationary (paper 4.2.2, Algorithm 1).

Each reading of a module's plasticity is smoothed by a moving average over the last W
readings (Equation 2); a straight line is fitted by least squares to the last W smoothed
values; the module is *stale* at a reading whose slope magnitude is within its tolerance
T, and it freezes at the W-th consecutive stale reading. T is set per module once its
first three slopes are known: ``tolerance_ratio`` x the largest of their magnitudes.

A reading can also come with the module's *floor*: what a reading reads when the module has
not moved at all (the reference's own error against the training side, measured right after
a refresh). With ``floor_ratio``, a module is *quiet* at a reading whose smoothed plasticity
is at most ``floor_ratio`` x its smoothed floor: its drift is within a few times the
reference's own error, where the slope is mostly noise (``rule="egeria"``; how far above
its floor a fine-tuned front and a front trained from scratch read:
docs/decisions/012-floor-ratio.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..checkpoint.statecheck import Spec, boolean, integer, items, number, optional, record

__all__ = ["Reading", "ModuleWatch", "least_squares_slope"]

# Slopes this small next to the plasticity itself are rounding noise of the moving
# average, not movement: they count as flat even when the tolerance is 0.
_RELATIVE_FLAT = 1e-9
_TOLERANCE_READINGS = 3
# A learning rate this many times higher or lower than at a module's previous reading
# starts a new regime of its plasticity (rule="egeria").
REGIME_CHANGE = 2.0


def least_squares_slope(values: list[float]) -> float:
    """Slope of the least-squares line through ``values`` at x = 0, 1, 2, ...; 0 for fewer
    than two values."""
    count = len(values)
    if count < 2:
        return 0.0
    x_mean = (count - 1) / 2
    y_mean = math.fsum(values) / count
    num = math.fsum((i - x_mean) * (v - y_mean) for i, v in enumerate(values))
    den = math.fsum((i - x_mean) ** 2 for i in range(count))
    return num / den


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
    floor: float | None = None  # the smoothed floor (None: no floor known)
    quiet: int = 0  # consecutive readings at most floor_ratio x the floor, this one included


@dataclass
class ModuleWatch:
    """Running state of the freezing rule for the module being watched.

    Args:
        window: W, the moving-average length, slope-fit length and stale count to freeze.
        tolerance_ratio: T as a share of the largest of the first three slope magnitudes.
        floor_ratio: a reading is quiet when its smoothed plasticity is at most this many
            times the smoothed floor (None: floors are not compared).
    """

    window: int
    tolerance_ratio: float
    floor_ratio: float | None = None
    raw: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    first_slopes: list[float] = field(default_factory=list)
    tolerance: float | None = None
    stale: int = 0
    readings: int = 0
    lr: float | None = None  # the learning rate of the latest reading, where known
    regime: int | None = None  # the schedule's latest jump at the latest reading, where known
    straddling: bool = False  # the coming reading spans a learning-rate change
    floors: list[float] = field(default_factory=list)  # the last W floors
    quiet: int = 0
    idle: int = 0  # consecutive evaluations it read idle (counted by FrontRule.compare)

    def new_regime(self, lr: float, regime: int | None = None) -> bool:
        """Notes the learning rate of the coming reading and, where the schedule is known,
        its ``regime`` (the step of the schedule's latest jump of ``REGIME_CHANGE``x or more
        from one step to the next). At a new regime the moving average, its slope and the
        stale count start afresh (the tolerance stays), and the coming reading joins neither
        regime: it compares the model after the jump with a reference from before it. A large
        LR drop moves the plasticity level within a few readings, and an average straddling
        the drop reads as a steep slope for W readings after it
        (docs/decisions/014-lr-regimes.md). A new regime is a jump of the schedule since the
        previous reading; a continuous decay is none, even where it halves the rate between
        two readings, as a cosine does near its end (restarting there kept every watch from
        ever holding W readings). Without a known schedule, a change of ``REGIME_CHANGE``x
        or more since the previous reading stands for a jump. True at a restart."""
        previous, self.lr = self.lr, lr
        previous_regime, self.regime = self.regime, regime
        if regime is not None and previous_regime is not None:
            jumped = regime != previous_regime
        else:
            jumped = not (previous is None or lr <= 0 or previous <= 0
                          or max(lr / previous, previous / lr) < REGIME_CHANGE)
        if not jumped:
            return False
        self.raw, self.smoothed, self.stale = [], [], 0
        self.floors, self.quiet, self.idle = [], 0, 0
        self.straddling = True
        return True

    def update(self, plasticity: float, floor: float | None = None) -> Reading:
        """Adds one plasticity value (and the module's floor, where measured) and says
        whether the module should freeze.

        Raises:
            ValueError: for a value that is not a finite number.
        """
        if not math.isfinite(plasticity):
            raise ValueError(f"plasticity reading {plasticity!r} is not finite")
        if floor is not None and not (math.isfinite(floor) and floor >= 0):
            raise ValueError(f"plasticity floor {floor!r} is not a finite number >= 0")
        self.readings += 1
        if self.straddling:
            self.straddling = False
            return Reading(float(plasticity), float(plasticity), None, self.tolerance, 0, False, counted=False)
        self.raw = (self.raw + [float(plasticity)])[-self.window:]
        smoothed = math.fsum(self.raw) / len(self.raw)
        self.smoothed = (self.smoothed + [smoothed])[-self.window:]
        slope = least_squares_slope(self.smoothed) if len(self.smoothed) >= 2 else None
        if slope is not None and self.tolerance is None:
            self.first_slopes.append(slope)
            if len(self.first_slopes) == _TOLERANCE_READINGS:
                self.tolerance = self.tolerance_ratio * max(abs(s) for s in self.first_slopes)
        if slope is not None and self.tolerance is not None:
            flat_floor = _RELATIVE_FLAT * max(abs(v) for v in self.smoothed)
            self.stale = self.stale + 1 if abs(slope) <= max(self.tolerance, flat_floor) else 0
        if floor is not None:
            self.floors = (self.floors + [float(floor)])[-self.window:]
        level = self.floor_level
        quiet = self.floor_ratio is not None and level is not None and smoothed <= self.floor_ratio * level
        self.quiet = self.quiet + 1 if quiet else 0
        freeze = self.stale >= self.window or self.quiet >= self.window
        return Reading(float(plasticity), smoothed, slope, self.tolerance, self.stale, freeze, floor=level, quiet=self.quiet)

    @property
    def floor_level(self) -> float | None:
        """The smoothed floor: the mean of the last W floors (None: none known)."""
        return math.fsum(self.floors) / len(self.floors) if self.floors else None

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "tolerance_ratio": self.tolerance_ratio,
            "raw": list(self.raw),
            "smoothed": list(self.smoothed),
            "first_slopes": list(self.first_slopes),
            "tolerance": self.tolerance,
            "stale": self.stale,
            "readings": self.readings,
            "lr": self.lr,
            "regime": self.regime,
            "straddling": self.straddling,
            "floor_ratio": self.floor_ratio,
            "floors": list(self.floors),
            "quiet": self.quiet,
            "idle": self.idle,
        }

    @classmethod
    def from_state(cls, state: dict) -> ModuleWatch:
        return cls(**state)

    @staticmethod
    def state_spec() -> Spec:
        """What :meth:`state_dict` output holds (fields added later may be absent)."""
        values = items(number())
        return record(
            {
                "window": integer(1, 10**6),
                "tolerance_ratio": number(0),
                "floor_ratio": optional(number(0)),
                "raw": values,
                "smoothed": values,
                "first_slopes": values,
                "tolerance": optional(number(0)),
                "stale": integer(0),
                "readings": integer(0),
                "lr": optional(number(0)),
                "regime": optional(integer(-1)),
                "straddling": boolean,
                "floors": items(number(0)),
                "quiet": integer(0),
                "idle": integer(0),
            },
            optional=("floor_ratio", "raw", "smoothed", "first_slopes", "tolerance", "stale", "readings",
                      "lr", "regime", "straddling", "floors", "quiet", "idle"),
        )
