"""Egeria's own method: knowledge-guided freezing (EuroSys'23, sections 3 and 4).

What a user needs is exported here: :class:`KnowledgeGuided` (the policy, built from an
:class:`~egeria.EgeriaConfig`), :func:`derive_eval_interval` (the paper's guideline for
the evaluation interval), the unfreeze rule (:class:`LRDropRule`, :class:`UnfreezeContext`)
and the SP loss (:func:`sp_loss`). The rest are the method's parts, one idea each:

* the training side: ``policy`` (the policy at step boundaries), ``bootstrap`` (when the
  loss has settled), ``budget`` (the controller's cost), ``unfreezing``;
* the controller: ``controller`` (readings to decisions), ``rule`` (the freezing rule),
  ``plasticity`` and ``similarity`` (the readings), ``reference`` and ``quantization``
  (the reference model), ``truncated`` (forward passes that stop early), ``threads``;
* the transport between them: ``link``, ``protocol``, ``executors``, ``service``,
  ``device``, ``weights``, ``placement``, ``cpuload``, ``mainguard``.

``ARCHITECTURE.md`` at the repository root follows one evaluation through them.
"""

from __future__ import annotations

from .policy import KnowledgeGuided, derive_eval_interval
from .similarity import sp_loss
from .unfreezing import LRDropRule, UnfreezeContext

__all__ = ["KnowledgeGuided", "derive_eval_interval", "LRDropRule", "UnfreezeContext", "sp_loss"]
