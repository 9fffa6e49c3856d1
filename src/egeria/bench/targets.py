"""The two quality targets a task's time-to-accuracy is measured against, both fixed from
its plain (``policy == "none"``) seeds alone; :mod:`egeria.bench.report` states them.

- :func:`strict_target`: the worst final metric of the plain seeds.
- :func:`mlperf_target`: the worst-case plain curve's quality once 99% of its gain over the
  run is made (``GAIN_LEFT``), just past the knee where the curve turns flat.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["GAIN_LEFT", "strict_target", "worst_curve", "mlperf_target"]

GAIN_LEFT = 0.01
"""The share of the worst-case plain curve's gain still ahead at the MLPerf-style target."""


def strict_target(plain: Sequence[dict], higher_is_better: bool) -> float | None:
    """The worst ``final.metric`` of the plain runs (None without any)."""
    finals = [float(r["final"]["metric"]) for r in plain]
    if not finals:
        return None
    return min(finals) if higher_is_better else max(finals)


def worst_curve(plain: Sequence[dict], higher_is_better: bool) -> list[tuple[int, float]]:
    """The pointwise worst of the plain runs' best-so-far curves: ``(step, value)`` at every
    record step that all of them evaluated, in step order. A run's best-so-far at a step is
    its best finite metric at or before it; a step before a run's first finite metric is
    left out."""
    if not plain:
        return []
    better = max if higher_is_better else min
    worse = min if higher_is_better else max
    bests: list[dict[int, float]] = []
    for run in plain:
        best, curve = None, {}
        for rec in sorted(run["records"], key=lambda r: r["step"]):
            value = rec.get("metric")
            if value is not None and math.isfinite(value):
                best = float(value) if best is None else better(best, float(value))
            if best is not None:
                curve[int(rec["step"])] = best
        bests.append(curve)
    common = set(bests[0]).intersection(*bests[1:])
    return [(step, worse(curve[step] for curve in bests)) for step in sorted(common)]


def mlperf_target(plain: Sequence[dict], higher_is_better: bool, gain_left: float = GAIN_LEFT) -> dict | None:
    """The MLPerf-style target of a task's plain runs (the rule: :mod:`egeria.bench.report`).

    Returns:
        None without plain runs or with fewer than two record steps common to them; else
        ``target``, ``gain_left``, ``curve_first`` and ``curve_end`` (the worst-case curve's
        first and last values), ``step`` (the first common record step where that curve
        reaches the target) and ``plain_seeds``.

    Raises:
        ValueError: naming ``gain_left`` when it is not in ``[0, 1)``.
    """
    if isinstance(gain_left, bool) or not isinstance(gain_left, (int, float)) or not 0 <= gain_left < 1:
        raise ValueError(f"mlperf_target gain_left must be a number in [0, 1), got gain_left={gain_left!r}")
    curve = worst_curve(plain, higher_is_better)
    if len(curve) < 2:
        return None
    first, end = curve[0][1], curve[-1][1]
    target = end - gain_left * (end - first)
    reached = next(step for step, value in curve if (value >= target if higher_is_better else value <= target))
    return {
        "target": target,
        "gain_left": gain_left,
        "curve_first": first,
        "curve_end": end,
        "step": reached,
        "plain_seeds": [r["seed"] for r in plain],
    }
