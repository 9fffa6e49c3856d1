"""How busy the machine's CPUs are with other work (paper 4.1.2: the controller runs the
reference only at low CPU load, e.g. below 50%, so it does not slow down the auxiliary
CPU work of training such as data loading).

"Other work" is every process except the trainer and the controller themselves: on a
machine that trains on its CPUs, the trainer keeps every core busy, and counting it would
stop the controller for good. The data loader's worker processes count as other work.
Measured from ``/proc`` (Linux); elsewhere from the load average, which cannot leave the
trainer out.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

__all__ = ["CpuLoad", "wait_for_quiet"]


class CpuLoad:
    """Share of all cores' time used by other processes since the previous :meth:`sample`.

    Args:
        exclude: process ids whose CPU time does not count (the trainer, the controller).
    """

    def __init__(self, exclude: Sequence[int]) -> None:
        self.exclude = list(exclude)
        self._proc = os.path.exists("/proc/stat")
        self._last = self._read() if self._proc else None

    def sample(self) -> float | None:
        """The share in [0, 1] since the last call, or None when nothing can be measured."""
        if not self._proc:
            try:
                return min(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
            except (OSError, AttributeError):
                return None
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        total = now[0] - last[0]
        if total <= 0:
            return 0.0
        other = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, min(1.0, other / total))

    def _read(self) -> tuple[int, int, int] | None:
        """(all jiffies, busy jiffies, jiffies of the excluded processes)."""
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + fields[4]
        own = 0
        for pid in self.exclude:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                own += int(parts[11]) + int(parts[12])  # utime, stime
            except (OSError, ValueError, IndexError):
                continue
        return sum(fields), sum(fields) - idle, own


def wait_for_quiet(
    load: CpuLoad,
    threshold: float,
    *,
    interrupt: Callable[[], bool],
    slice_s: float = 0.1,
    max_wait_s: float = 1.0,
) -> float:
    """Waits until the other processes' load falls below ``threshold``, ``interrupt()`` is
    true, or ``max_wait_s`` have passed (a host that is never quiet must not stop the
    readings: they go on, only less politely); returns the seconds waited. The first look
    covers the time since the previous sample; after that, slices of ``slice_s``. An
    unmeasurable load does not wait."""
    started = time.monotonic()
    while True:
        share = load.sample()
        waited = time.monotonic() - started
        if share is None or share < threshold or interrupt() or waited >= max_wait_s:
            return waited
        time.sleep(min(slice_s, max(0.0, max_wait_s - waited)))
