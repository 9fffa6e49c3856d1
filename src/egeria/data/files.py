"""Data files that may be gzipped: which of ``name.gz`` and ``name`` a folder holds, and
opening either one by its suffix."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO, Any

__all__ = ["open_data", "packed_or_plain"]


def packed_or_plain(root: Path, name: str) -> Path | None:
    """``root/name.gz`` where it is a file (preferred), else ``root/name``, else None."""
    for candidate in (root / f"{name}.gz", root / name):
        if candidate.is_file():
            return candidate
    return None


def open_data(path: Path, mode: str, **kwargs: Any) -> IO:
    """``path`` opened through gzip where its suffix is ``.gz``, else as a plain file."""
    return (gzip.open if path.suffix == ".gz" else open)(path, mode, **kwargs)
