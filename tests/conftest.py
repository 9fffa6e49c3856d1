"""Fixtures for every test, and the helpers' folder on ``sys.path``.

The tests mirror the package (``tests/knowledge``, ``tests/policies``, ``tests/cache``,
``tests/bench``, ...); what they share (tiny models and configs, fake transports, worker
modules that spawned processes import by name) is in ``tests/helpers`` and is imported by
module name (``from tiny import Chain``). The folder goes on ``sys.path`` here, before any
test module is imported; processes started with ``spawn`` inherit the parent's
``sys.path``, and a test that writes a script for a fresh interpreter puts the folder on
its path itself (``Path(tiny.__file__).parent``).
"""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path

import pytest
import torch

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _library_constants(monkeypatch) -> None:
    """Egeria's constants as the library has them after every test (tiny.quick_config
    changes two of them)."""
    from egeria.knowledge import policy as knowledge

    for name in ("BOOTSTRAP_CHANGE_RATE", "TOLERANCE_RATIO"):
        monkeypatch.setattr(knowledge, name, getattr(knowledge, name))


@pytest.fixture(autouse=True)
def _quiet_deprecations():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


@pytest.fixture
def no_idle(monkeypatch) -> None:
    """Egeria's idle test off (docs/decisions/032-idle-modules.md): the tests' ``Chain`` has a
    linear stem whose readings stay under 1/100 of its blocks' from its first readings, so
    it freezes idle; tests of the rule's other conditions take this fixture. The rule's
    settings are built in this process and carried whole to any controller process."""
    from egeria.knowledge import policy as knowledge

    monkeypatch.setattr(knowledge, "IDLE_SHARE", None)
