from __future__ import annotations

import random
import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _library_constants(monkeypatch) -> None:
    """Egeria's constants as the library has them after every test (tiny.quick_config
    changes two of them)."""
    from egeria.policies import knowledge

    for name in ("BOOTSTRAP_CHANGE_RATE", "TOLERANCE_RATIO"):
        monkeypatch.setattr(knowledge, name, getattr(knowledge, name))


@pytest.fixture(autouse=True)
def _quiet_deprecations():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
