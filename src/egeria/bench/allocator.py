"""Fixed heap thresholds for the processes of a timed comparison (glibc only).

glibc's ``malloc`` serves a request above its *mmap threshold* with a fresh ``mmap`` and
returns it to the kernel when it is freed, so the next request of that size touches new
pages and takes a page fault per 4 KiB page. The threshold starts at 128 KiB and rises to
the size of the largest mmapped chunk freed so far (up to 32 MiB), so it depends on the
order of a process's first large allocations, and freed memory above the *trim threshold*
(twice the mmap threshold) at the top of the heap goes back to the kernel too. Processes
doing the same training steps can end up in different states, and which one pays most
in page faults and kernel time is a matter of chance; with fixed thresholds they allocate
alike (docs/decisions/019-fixed-heap.md).

:func:`steady_heap` fixes both thresholds (the mmap threshold at glibc's maximum, above the
activations of most models on a CPU; buffers larger than 32 MiB still come from fresh pages;
the trim threshold high enough that freed memory stays in the heap), so every arm of a
comparison allocates the same way from its first step. It speeds up plain training as
much as Egeria's, changes no result, and is applied to *every* arm of the demo and of the
benchmarks. Egeria never calls it in a user's process on its own: it is the process's
allocator, not Egeria's.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Callable

from ..checks import check_int

__all__ = ["steady_heap", "heap_state", "can_fix_heap", "HEAPS", "MMAP_THRESHOLD_MAX"]

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)  # glibc's largest: 32 MiB on 64-bit
_INT_MAX = 2**31 - 1  # mallopt takes a C int
HEAPS = ("steady", "default")  # what heap_state() says, and what a benchmark run records

_state = "default"  # "steady" once steady_heap() has fixed this process's thresholds


def heap_state() -> str:
    """How this process's heap allocates: ``"steady"`` once :func:`steady_heap` fixed its
    thresholds, else ``"default"``."""
    return _state


def can_fix_heap() -> bool:
    """Whether :func:`steady_heap` can act here (the C library is glibc)."""
    return _mallopt() is not None


def steady_heap(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 1 << 30) -> bool:
    """Fixes this process's glibc heap thresholds (bytes); returns whether they were set.

    Returns False, changing nothing, where the C library is not glibc (macOS, musl,
    Windows) or refuses a value. Under an ``LD_PRELOAD``-ed allocator (jemalloc, tcmalloc)
    glibc still accepts the values, which then change nothing.

    Raises:
        ValueError: a threshold that is not a positive int of at most 2**31 - 1, or an mmap
            threshold above :data:`MMAP_THRESHOLD_MAX`.
    """
    global _state
    for name, value, most in (
        ("mmap_threshold", mmap_threshold, MMAP_THRESHOLD_MAX),  # glibc's limit
        ("trim_threshold", trim_threshold, _INT_MAX),  # a C int
    ):
        check_int(value, name)
        if value > most:
            raise ValueError(f"{name}={value!r} must be at most {most} bytes")
    mallopt = _mallopt()
    if mallopt is None:
        return False
    done = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
    if not done:
        logger.warning(
            "glibc refused a heap threshold (mmap %d, trim %d); the heap is not fixed",
            mmap_threshold, trim_threshold,
        )
        return False
    _state = "steady"
    return True


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` (int, int) -> int, or None where this is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own C library
        libc.gnu_get_libc_version  # glibc alone has it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
