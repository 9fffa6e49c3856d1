"""Freezing policies: *when* to freeze; the engine decides *how* (the same for all).

``make_policy(name, **options)`` builds a baseline by name: ``"freezeout"``,
``"autofreeze"``, ``"linear"``, ``"static"``, ``"smartfrz"``, ``"none"``. ``"egeria"`` (the default) is
Egeria's own method, :class:`egeria.knowledge.KnowledgeGuided`, built from the whole
:class:`~egeria.EgeriaConfig`; it lives in :mod:`egeria.knowledge` and implements the same
:class:`FreezePolicy` interface.
"""

from __future__ import annotations

import warnings
from typing import Any

from .autofreeze import AutoFreeze
from .base import Binding, FreezePolicy, Move, StatelessPolicy, StepInfo, Target
from .schedules import FreezeOut, LinearSchedule, NoFreezing, StaticFreezing
from .smartfrz import SmartFRZ

__all__ = [
    "Binding",
    "FreezePolicy",
    "Move",
    "StepInfo",
    "Target",
    "StatelessPolicy",
    "AutoFreeze",
    "FreezeOut",
    "LinearSchedule",
    "NoFreezing",
    "StaticFreezing",
    "SmartFRZ",
    "POLICIES",
    "make_policy",
]

#: Baseline policies by name; "egeria" is :class:`egeria.knowledge.KnowledgeGuided`.
POLICIES = {
    "none": NoFreezing,
    "freezeout": FreezeOut,
    "autofreeze": AutoFreeze,
    "linear": LinearSchedule,
    "static": StaticFreezing,
    "smartfrz": SmartFRZ,
}


def make_policy(name: str, **options: Any) -> FreezePolicy:
    """The policy called ``name`` with its options.

    Raises:
        ValueError: an unknown name or option.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown freezing policy {name!r}; choose one of {['egeria', *POLICIES]}")
    try:
        return POLICIES[name](**options)
    except TypeError as err:
        raise ValueError(f"bad options for the {name!r} policy: {err}") from None


def __getattr__(name: str) -> Any:
    # Before the method had its own package (issue 30), egeria.policies exported it.
    if name in ("KnowledgeGuided", "derive_eval_interval"):
        warnings.warn(
            f"egeria.policies.{name} moved to egeria.knowledge.{name} (also egeria.{name})",
            DeprecationWarning,
            stacklevel=2,
        )
        from .. import knowledge

        return getattr(knowledge, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
