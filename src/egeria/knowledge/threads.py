"""Limiting torch's intra-op threads for a stretch of work."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["limited_threads"]


@contextlib.contextmanager
def limited_threads(threads: int | None) -> Iterator[None]:
    """Runs the body with ``threads`` torch threads (None: leave torch's setting)."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
