"""A change of the frozen set."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Decision"]


@dataclass(frozen=True)
class Decision:
    """A change of the frozen set, applied at the end of ``step``.

    Attributes:
        step: the step at whose end it applies.
        action: ``"freeze"`` or ``"unfreeze"``.
        modules: names of the layer modules it affects.
        reason: a short human-readable cause.
        evaluated_at: for a freeze from a plasticity reading, the step of that reading
            (equal to ``step`` inline; earlier when the controller runs asynchronously).
    """

    step: int
    action: str
    modules: tuple[str, ...]
    reason: str = ""
    evaluated_at: int | None = None
