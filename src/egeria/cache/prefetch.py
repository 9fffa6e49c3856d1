"""Reading the next batches' cached activations in a background thread (paper 4.3).

The loader knows the epoch's whole order, so while the trainer works on batch ``p`` the
prefetcher reads batches ``p + 1 .. p + depth`` from the table and moves them to the
training device (through pinned memory for CUDA). A batch the trainer needs before it is
ready is read on the spot and counted as a prefetch miss.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["Prefetcher"]


class Prefetcher:
    """Background reads of upcoming batches.

    Args:
        read: ``read(tag, keys) -> value`` (may raise; the exception is handed over).
        depth: how many batches ahead to read.
    """

    def __init__(self, read: Callable[[Any, list[int]], Any], depth: int) -> None:
        self.read = read
        self.depth = depth
        self.ready: dict[tuple[Any, int], tuple[Any, BaseException | None]] = {}
        self.read_s: list[float] = []
        self._lock = threading.Lock()
        self._todo: queue.Queue = queue.Queue()
        self._scheduled: set[tuple[Any, int]] = set()
        self._thread = threading.Thread(target=self._run, name="egeria-prefetch", daemon=True)
        self._thread.start()

    def schedule(self, tag: Any, position: int, keys: list[int]) -> None:
        with self._lock:
            if (tag, position) in self._scheduled:
                return
            self._scheduled.add((tag, position))
        self._todo.put((tag, position, keys))

    def take(self, tag: Any, position: int) -> tuple[bool, Any, BaseException | None]:
        """(found, value, error) for a batch; not found when it is not read yet."""
        with self._lock:
            self._scheduled.discard((tag, position))
            if (tag, position) in self.ready:
                value, error = self.ready.pop((tag, position))
                return True, value, error
        return False, None, None

    def clear(self) -> None:
        with self._lock:
            self.ready.clear()
            self._scheduled.clear()
        while True:
            try:
                self._todo.get_nowait()
            except queue.Empty:
                break

    def close(self) -> None:
        self.clear()
        self._todo.put(None)

    def _run(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            tag, position, keys = job
            with self._lock:
                if (tag, position) not in self._scheduled:
                    continue
            started = time.perf_counter()
            value, error = None, None
            try:
                value = self.read(tag, keys)
            except Exception as err:  # handed to the trainer, which recomputes
                error = err
            self.read_s.append(time.perf_counter() - started)
            with self._lock:
                if (tag, position) in self._scheduled:
                    self.ready[(tag, position)] = (value, error)



