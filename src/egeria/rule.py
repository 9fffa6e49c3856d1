"""The freezing rule over the front modules being watched: each module's
:class:`~egeria.plasticity.ModuleWatch`, the highest level its plasticity has had, and how
many of the front modules have settled (paper Algorithm 1, with Egeria's own additions).

It holds no model and no reference: it takes plasticity values and says which front
modules may freeze, so the controller feeds it live readings and a study can feed it the
readings a run recorded (``benchmarks/rule_replay.py``).
"""

from __future__ import annotations

import statistics
from typing import Sequence

from .plasticity import ModuleWatch, Reading
from .statecheck import Spec, index_keys, integer, items, mapping, number

__all__ = ["FrontRule"]


class FrontRule:
    """The rule's state for the watched modules.

    Args:
        window: W, as in :class:`ModuleWatch`.
        tolerance_ratio: as in :class:`ModuleWatch`.
        settle_ratio: a module settles only once its plasticity *level* (the median of
            its last W counted readings) is at most this share of the highest level it has
            had in the run (None: no such condition). The median, not the moving average
            the slope is fitted to: readings are heavy-tailed (one reading 10-30x its
            neighbours at a low learning rate is common), and one such reading lifts a mean
            of three for W readings, moving the test by more than the settle ratio's
            margin (benchmarks/README.md, "The settle test's level").
        regimes: a reading whose learning rate differs 2x or more from the module's
            previous one restarts that module's moving average and stale count, and is
            itself left out (:meth:`ModuleWatch.new_regime`; ``rule="egeria"``). A module
            that settled by its own readings at any point of the phase the rate's fall
            ends (W stale readings at that rate within ``settle_ratio`` of its peak, or W
            quiet ones) is *carried* across the fall: it settles again at the first
            reading after the one spanning the change whose level is within
            ``settle_ratio`` of its peak (and, with ``ceiling_ratio``, under the ceiling).
            Its drift was flat at the higher rate and a lower rate only lowers it; noisy
            readings late in the phase do not undo W readings of evidence. The
            rule holds freezes until a schedule's last decay, and this lets the modules it
            held freeze one interval after it (the policy reads at the first step after
            that decay, so the next reading spans n steps at the last rate). Freezing at
            the spanning reading itself, right at the decay, cost accuracy: the front had
            not yet settled at the lower rate (benchmarks/README.md, "Freezing right after
            the last decay").
        floor_ratio: a module also settles after W consecutive readings whose smoothed
            plasticity is at most this many times its smoothed floor (what it reads when it
            has not moved): a module that starts converged (a fine-tuned front) never sees
            its drift fall far below its first readings, so neither the slope nor
            ``settle_ratio`` can tell. None: floors are not compared.
        ceiling_ratio: no module settles, by any test, while its smoothed plasticity is
            more than this many times its smoothed floor: a drift thousands of times the
            reference's own error is a module still learning, however flat its slope or far
            below its peak (a language model under a schedule that states no decays). None:
            no ceiling; a module whose floor is not known is not held by it.
    """

    def __init__(self, window: int, tolerance_ratio: float, *, settle_ratio: float | None = None,
                 regimes: bool = False, floor_ratio: float | None = None,
                 ceiling_ratio: float | None = None) -> None:
        self.window = window
        self.tolerance_ratio = tolerance_ratio
        self.settle_ratio = settle_ratio
        self.regimes = regimes
        self.floor_ratio = floor_ratio
        self.ceiling_ratio = ceiling_ratio
        self.watches: dict[int, ModuleWatch] = {}
        self.peaks: dict[int, float] = {}  # each module's highest level, kept across restarts
        self.carried: set[int] = set()  # modules that settled in the phase the last fall of the rate ended
        self.settled_in_phase: set[int] = set()  # settled by their own readings at the current rate

    def read(self, index: int, plasticity: float, lr: float | None = None, floor: float | None = None) -> Reading:
        """Module ``index``'s plasticity at a step trained at learning rate ``lr`` (None:
        not known), with its floor where measured, through its watch.

        Raises:
            ValueError: for a value that is not a finite number.
        """
        watch = self.watches.get(index)
        if watch is None:
            watch = self.watches[index] = ModuleWatch(self.window, self.tolerance_ratio, self.floor_ratio)
        if self.regimes and lr is not None:
            previous = watch.lr
            if watch.new_regime(lr):
                self.carried.discard(index)
                # Settled by its own readings, not only by a carry: a carry does not chain.
                if index in self.settled_in_phase and previous is not None and lr < previous:
                    self.carried.add(index)
                self.settled_in_phase.discard(index)
        reading = watch.update(plasticity, floor)
        if not reading.counted:
            return reading
        self.peaks[index] = max(self.peaks.get(index, 0.0), self.level(index))
        if self._settled_by_own_readings(index):
            self.settled_in_phase.add(index)
        return reading

    def _settled_by_own_readings(self, index: int) -> bool:
        """Settled at this rate by W stale or quiet readings, not by a carry alone."""
        return self.settled(index) and (self.quiet(index) or not self.carried_over(index))

    def level(self, index: int) -> float:
        """Module ``index``'s plasticity level: the median of its last W counted readings
        (0.0 before its first)."""
        watch = self.watches.get(index)
        return statistics.median(watch.raw) if watch is not None and watch.raw else 0.0

    def peak(self, index: int) -> float:
        return self.peaks.get(index, 0.0)

    def settled(self, index: int) -> bool:
        """The rule says freeze: W stale readings (or, for a module carried across a fall
        of the learning rate, one counted reading since), and (with ``settle_ratio``) a
        level at most that share of the module's peak; or W quiet readings (at the floor);
        and in either case (with ``ceiling_ratio``) a level not above the ceiling."""
        watch = self.watches.get(index)
        if watch is None or not watch.smoothed or self.above_ceiling(index):
            return False
        if self.quiet(index):
            return True
        if watch.stale < self.window and index not in self.carried:
            return False
        return self.settle_ratio is None or self.level(index) <= self.settle_ratio * self.peak(index)

    def above_ceiling(self, index: int) -> bool:
        """Whether module ``index``'s smoothed plasticity is above ``ceiling_ratio`` x its
        smoothed floor (False without a ceiling or a known floor)."""
        watch = self.watches.get(index)
        if self.ceiling_ratio is None or watch is None or not watch.smoothed:
            return False
        level = watch.floor_level
        return level is not None and watch.smoothed[-1] > self.ceiling_ratio * level

    def quiet(self, index: int) -> bool:
        """Whether module ``index`` has read at its floor for W readings."""
        watch = self.watches.get(index)
        return watch is not None and watch.quiet >= self.window

    def carried_over(self, index: int) -> bool:
        """Whether module ``index`` counts as stale only because it settled in the phase
        the last fall of the learning rate ended (it has fewer than W stale readings since)."""
        watch = self.watches.get(index)
        return index in self.carried and watch is not None and watch.stale < self.window

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
        """Modules before ``index`` froze: their watches go (their peaks stay)."""
        self.watches = {i: w for i, w in self.watches.items() if i >= index}
        self.carried = {i for i in self.carried if i >= index}
        self.settled_in_phase = {i for i in self.settled_in_phase if i >= index}

    def restart(self, window: int) -> None:
        """Every watch starts afresh with window ``window`` (the peaks stay)."""
        self.window = window
        self.watches = {}
        self.carried = set()
        self.settled_in_phase = set()

    def state_dict(self) -> dict:
        return {
            "window": self.window,
            "watches": {str(i): w.state_dict() for i, w in self.watches.items()},
            "peaks": {str(i): v for i, v in self.peaks.items()},
            "carried": sorted(self.carried),
            "settled_in_phase": sorted(self.settled_in_phase),
        }

    @staticmethod
    def state_fields(modules: int) -> dict[str, Spec]:
        """The fields :meth:`state_dict` writes, for a partition of ``modules`` modules."""
        index = index_keys(0, modules - 1)
        indices = items(integer(0, modules - 1), unique=True)
        return {
            "window": integer(1, 10**6),
            "watches": mapping(ModuleWatch.state_spec(), keys=index),
            "peaks": mapping(number(0), keys=index),
            "carried": indices,
            "settled_in_phase": indices,
        }

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state["window"])
        self.watches = {int(i): ModuleWatch.from_state(w) for i, w in state["watches"].items()}
        self.peaks = {int(i): float(v) for i, v in state["peaks"].items()}
        self.carried = {int(i) for i in state.get("carried", ())}  # absent in checkpoints before it
        if "settled_in_phase" in state:
            self.settled_in_phase = {int(i) for i in state["settled_in_phase"]}
        else:  # a checkpoint from before it: the modules settled by their own readings now
            self.settled_in_phase = {i for i in self.watches if self._settled_by_own_readings(i)}
