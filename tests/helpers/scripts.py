"""The repository's scripts (``benchmarks/*.py``, ``scripts/*.py``) loaded as modules, for
the tests that drive them through their ``main`` or call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: str) -> ModuleType:
    """The script at ``path`` (relative to the repository's root) as a fresh module named for
    its file, registered in ``sys.modules`` (a script's dataclasses look their module up
    there)."""
    file = ROOT / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    spec.loader.exec_module(module)
    return module
