"""Adapters that run Egeria inside training frameworks.

Each adapter lives in its own module and imports its framework only there, so this
package imports without any of them installed:

* :mod:`egeria.integrations.hf`: ``EgeriaCallback``, a Hugging Face ``TrainerCallback``
  (``pip install -e ".[hf]"`` in egeria's clone).
* :mod:`egeria.integrations.lightning`: ``EgeriaCallback``, a PyTorch Lightning
  ``Callback`` (``pip install -e ".[lightning]"`` in egeria's clone).
"""

from __future__ import annotations

__all__: list[str] = []
