"""Freezing policies: *when* to freeze; the engine decides *how* (the same for all).

``make_policy(name, **options)`` builds a baseline by name: ``"freezeout"``,
``"autofreeze"``, ``"linear"``, ``"static"``, ``"smartfrz"``, ``"none"``. ``"egeria"`` (the default) is
:class:`KnowledgeGuided`, built from the whole :class:`~egeria.EgeriaConfig`.
"""

from __future__ import annotations

from typing import Any

from .autofreeze import AutoFreeze
from .base import Binding, FreezePolicy, Move, StatelessPolicy, StepInfo, Target
from .knowledge import KnowledgeGuided, derive_eval_interval
from .schedules import FreezeOut, LinearSchedule, NoFreezing, StaticFreezing
from .smartfrz import SmartFRZ

__all__ = [
    "Binding",
    "FreezePolicy",
    "KnowledgeGuided",
    "Move",
    "StepInfo",
    "Target",
    "derive_eval_interval",
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

#: Baseline policies by name; "egeria" is :class:`KnowledgeGuided`.
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
