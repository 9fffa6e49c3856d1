"""Freezing policies: *when* to freeze; the engine decides *how* (the same for all).

``make_policy(name, **options)`` builds a baseline by name: ``"freezeout"``,
``"autofreeze"``, ``"linear"``, ``"static"``, ``"smartfrz"``, ``"none"``. ``"egeria"`` (the default) is
Egeria's own method, :class:`egeria.knowledge.KnowledgeGuided`, built from the whole
:class:`~egeria.EgeriaConfig`; it lives in :mod:`egeria.knowledge` and implements the same
:class:`FreezePolicy` interface.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from .autofreeze import AutoFreeze
from .base import Binding, FreezePolicy, Move, PolicyView, StatelessPolicy, StepInfo, Target, as_move
from .schedules import FreezeOut, LinearSchedule, NoFreezing, StaticFreezing
from .smartfrz import SmartFRZ

if TYPE_CHECKING:
    from ..config import EgeriaConfig
    from ..knowledge.unfreezing import UnfreezeRule

__all__ = [
    "Binding",
    "FreezePolicy",
    "PolicyView",
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
    "policy_for",
    "as_move",
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


def policy_for(config: EgeriaConfig, policy: FreezePolicy | None, unfreeze_rule: UnfreezeRule | None) -> FreezePolicy:
    """The policy an ``Egeria`` runs: ``policy`` where given, else the one ``config.policy``
    names (``"egeria"``: :class:`egeria.knowledge.KnowledgeGuided`, with ``unfreeze_rule``).

    Raises:
        ValueError: both a policy object and a policy name; an object that is no
            :class:`FreezePolicy`; ``unfreeze_rule`` for another policy than Egeria's.
    """
    if policy is not None and config.policy != "egeria":
        raise ValueError(f"pass either policy= or EgeriaConfig.policy={config.policy!r}, not both")
    if policy is None:
        if config.policy == "egeria":
            from ..knowledge import KnowledgeGuided  # the method's package builds on this one

            return KnowledgeGuided(config, unfreeze_rule=unfreeze_rule)
        policy = make_policy(config.policy, **config.policy_options)
    if not isinstance(policy, FreezePolicy):
        raise ValueError(f"policy={policy!r} lacks the FreezePolicy methods (bind, target, unbind, state_dict)")
    if unfreeze_rule is not None:
        raise ValueError("unfreeze_rule= applies to Egeria's own policy; give it to KnowledgeGuided(unfreeze_rule=...)")
    return policy


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
