"""What Egeria did at a step boundary: the events of a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .checkpoint.statecheck import Spec, integer, items, optional, record, text

__all__ = ["Decision", "ACTIONS"]

#: ``freeze`` and ``unfreeze`` change the frozen set; ``guided`` ends bootstrapping.
ACTIONS = ("freeze", "unfreeze", "guided")


@dataclass(frozen=True)
class Decision:
    """One event, applied at the end of ``step``; ``Egeria.events`` lists them all and
    ``Egeria.step()`` returns those of its step.

    Attributes:
        step: the step at whose end it applies.
        action: ``"freeze"``, ``"unfreeze"`` or ``"guided"`` (bootstrapping is over).
        modules: names of the layer modules it affects (empty for ``"guided"``).
        reason: a short human-readable cause.
        evaluated_at: for a freeze from a plasticity reading, the step of that reading
            (equal to ``step`` inline; earlier when the controller runs asynchronously).
    """

    step: int
    action: str
    modules: tuple[str, ...] = ()
    reason: str = ""
    evaluated_at: int | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Decision.action={self.action!r} is not one of {ACTIONS}")

    def to_dict(self) -> dict:
        """A JSON-safe dict (``modules`` as a list)."""
        return {
            "step": self.step,
            "action": self.action,
            "modules": list(self.modules),
            "reason": self.reason,
            "evaluated_at": self.evaluated_at,
        }

    @staticmethod
    def state_spec(modules: Sequence[str], steps: int) -> Spec:
        """What :meth:`to_dict` output holds in a state saved at ``steps`` over layer
        modules named ``modules``."""
        return record(
            {
                "step": integer(0, steps),
                "action": text(ACTIONS),
                "modules": items(text(modules)),
                "reason": text(),
                "evaluated_at": optional(integer(0, steps)),
            },
            optional=("modules", "reason", "evaluated_at"),
        )

    @classmethod
    def from_dict(cls, entry: dict) -> Decision:
        """The inverse of :meth:`to_dict`."""
        return cls(
            int(entry["step"]),
            entry["action"],
            tuple(entry.get("modules", ())),
            entry.get("reason", ""),
            entry.get("evaluated_at"),
        )
