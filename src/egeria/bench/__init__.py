"""Time-to-accuracy benchmarks: real tasks, every freezing policy, one JSON per run."""

from __future__ import annotations

import importlib

from .run import HEAPS, POLICY_NAMES, run_bench
from .tasks import TASKS, build_task

__all__ = ["run_bench", "POLICY_NAMES", "HEAPS", "TASKS", "build_task", "EXTRA", "missing_extra"]

#: What ``egeria demo`` and ``egeria bench`` need beyond the library (the ``bench`` extra).
EXTRA = ("tqdm", "matplotlib")


def missing_extra(command: str) -> str | None:
    """None when the ``bench`` extra is installed, else the message that says what
    ``command`` needs and how to install it."""
    missing = []
    for name in EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if not missing:
        return None
    return (
        f"egeria {command} needs {' and '.join(missing)} (the bench extra): "
        "pip install -e '.[bench]' in egeria's clone (scripts/setup.sh installs it)"
    )
