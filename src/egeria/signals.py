"""Egeria's signals for the dashboards users already read: one flat dict of scalars
(:func:`scalars`), a decision as one line of text (:func:`decision_text`), and a writer
that puts both into TensorBoard from a plain loop (:class:`TensorBoardSignals`).

The scalars, every name under ``egeria/``:

- ``frozen_modules``: layer modules frozen now;
- ``frozen_params_share``: their share of the layer modules' parameters;
- ``frozen_backward_flops_share``: their share of the model's backward FLOPs, estimated
  from each module's weight multiply-adds (a frozen front module computes neither weight
  nor input gradients); absent until the first forward pass has been traced;
- ``plasticity/<module>``: the latest plasticity reading of each module read so far
  (Egeria's policy);
- ``readings_sent``, ``readings_answered``, ``readings_dropped``: the controller's
  evaluations (Egeria's policy);
- ``overhead_share``: Egeria's own time on the training thread over the run's (Egeria's
  policy, once measured);
- ``memory/<part>``: bytes of each memory part at the latest measured step
  (:mod:`egeria.memory`: parameters, gradients, optimizer_state,
  optimizer_state_released, activations, activation_cache, activation_cache_disk, and on
  CUDA cuda_allocated and cuda_max_allocated), those measured.

The HF and Lightning callbacks (:mod:`egeria.integrations`) hand the same dict to the
Trainer's loggers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .decision import Decision
    from .engine import Egeria

__all__ = ["PREFIX", "scalars", "decision_text", "TensorBoardSignals"]

PREFIX = "egeria/"


def scalars(
    frozen: int,
    params: list[int] | None,
    flops: list[float] | None,
    history: list[dict],
    stats: dict,
    memory: dict | None = None,
) -> dict[str, float]:
    """Egeria's scalars (see the module's docstring) from ``frozen`` (the count of frozen
    leading modules), each layer module's parameters and weight FLOPs (None while unknown),
    the plasticity ``history``, the ``controller_stats`` and the latest ``memory`` row
    (:attr:`egeria.Egeria.memory_history`); :meth:`egeria.Egeria.metrics` gathers them."""
    out = {"frozen_modules": float(frozen)}
    if params is not None:
        out["frozen_params_share"] = _share(params, frozen)
    if flops is not None:
        out["frozen_backward_flops_share"] = _share(flops, frozen)
    for module, value in _latest_plasticity(history).items():
        out[f"plasticity/{module}"] = value
    if stats:
        out["readings_sent"] = float(stats.get("sent", 0))
        out["readings_answered"] = float(stats.get("answered", 0))
        out["readings_dropped"] = float(stats.get("dropped", 0))
        share = (stats.get("overhead") or {}).get("share")
        if share is not None:
            out["overhead_share"] = float(share)
    for part, value in (memory or {}).items():
        if part not in ("step", "frozen") and isinstance(value, (int, float)):
            out[f"memory/{part}"] = float(value)
    return {PREFIX + name: value for name, value in out.items()}


def decision_text(decision: Decision) -> str:
    """One line for a text log: ``step 620: freeze stem, stage1 (reason)``."""
    return f"step {decision.step}: {decision.action} {', '.join(decision.modules)} ({decision.reason})"


def _share(sizes: list[float], leading: int) -> float:
    total = sum(sizes)
    return float(sum(sizes[:leading]) / total) if total > 0 else 0.0


def _latest_plasticity(history: list[dict]) -> dict[str, float]:
    """Each module's latest finite plasticity reading, in the order modules were first read."""
    latest: dict[str, float] = {}
    for reading in history:
        value = reading.get("plasticity")
        if isinstance(value, (int, float)) and math.isfinite(value):
            latest[reading["module"]] = float(value)
    return latest


class TensorBoardSignals:
    """Writes Egeria's scalars every ``every`` steps, and each decision as a text event at
    its step, to a TensorBoard ``SummaryWriter`` (or any object with its ``add_scalar`` and
    ``add_text``). :class:`~egeria.Egeria` drives it from ``Egeria(writer=...)``.

    Raises:
        ValueError: a writer without ``add_scalar``, or ``every`` not a positive int.
    """

    def __init__(self, writer: Any, every: int) -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise ValueError(
                f"writer must be a TensorBoard SummaryWriter (an object with add_scalar), got {type(writer).__name__}"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"log_every must be a positive int (steps between writes), got {every!r}")
        self.writer = writer
        self.every = every

    def after_step(self, eg: Egeria, decisions: list[Decision]) -> None:
        """At a step boundary: the decisions as text, the scalars when due or changed."""
        add_text = getattr(self.writer, "add_text", None)
        for decision in decisions:
            if callable(add_text):
                add_text(PREFIX + "decisions", decision_text(decision), global_step=decision.step)
        if decisions or eg.steps % self.every == 0:
            self.write(eg)

    def write(self, eg: Egeria) -> None:
        """Writes the scalars now, at ``eg.steps``."""
        for name, value in eg.metrics().items():
            self.writer.add_scalar(name, value, global_step=eg.steps)
