"""The rule's timing: every span it counts, in optimizer steps, in one place.

Egeria's decisions follow the run, not the machine (docs/decisions/038-steps-not-readings.md):
each wait of the rule is a number of optimizer steps fixed by the configuration and the run,
and readings are samples inside those spans, as dense as the cost budget allows. A faster or
slower step, another executor or a busier machine changes how many readings a span holds,
never where it ends.

=========================  ===============  =====================================================
span                       steps (default)  what waits for it
=========================  ===============  =====================================================
lag, D                     20               a reading's drift (the reference is refreshed D steps
                                            before it); a bootstrapping interval of the loss; a
                                            decision applies D steps after its reading, whichever
                                            executor answers it
span, S = W x D            60               a module settled or idle at every reading of S
                                            steps; the moving average, the slope fit, the paces
                                            and the floors take the readings of the last S steps
quiet evidence             3 S = 180        the quiet test takes the median of the readings of
                                            the last three spans, a span of them at least; five
                                            readings at the longest interval
after a schedule jump      S (+ D)          a module's span starts afresh at a jump; the reading
                                            whose drift spans the jump joins neither side
longest interval (W-1) D   40               the cost budget may space readings up to this, so
                                            that a span holds two (a slope needs two smoothed
                                            values); it never lengthens a span
=========================  ===============  =====================================================

Evidence for D = 20: docs/decisions/003-eval-interval.md (readings closer than about 20
steps cannot tell convergence from SGD noise); for W = 3: docs/decisions/009-window-3.md; for
the quiet test's three spans: docs/decisions/042-quiet-on-the-median.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Spans"]


@dataclass(frozen=True)
class Spans:
    """The rule's spans for one run.

    Attributes:
        lag: D, the steps each reading's drift covers.
        window: W: the span is W x D steps.
    """

    lag: int
    window: int

    @property
    def span(self) -> int:
        """S: the steps a module must stay settled, quiet or idle."""
        return self.window * self.lag

    @property
    def longest_interval(self) -> int:
        """The longest reading interval that leaves two readings in a span."""
        return max(1, self.window - 1) * self.lag

    @classmethod
    def for_interval(cls, lag: int, window: int, interval: int | None) -> Spans:
        """The spans for readings every ``interval`` steps (None: every ``lag``): an interval
        below ``lag`` shortens the drift each reading covers to it (one reference, refreshed
        at every reading); one beyond the longest the spans allow lengthens ``lag`` until a
        span holds two readings."""
        if interval is None:
            return cls(lag, window)
        lag = min(lag, interval)
        return cls(max(lag, math.ceil(interval / max(1, window - 1))), window)

    def refresh_step(self, read_step: int) -> int:
        """The step whose weights the reading at ``read_step`` is compared with."""
        return read_step - self.lag

    def clamp(self, interval: int) -> int:
        """``interval`` kept within what the spans allow: at least D (one reference at a
        time), at most :attr:`longest_interval`."""
        return min(max(interval, self.lag), self.longest_interval)
