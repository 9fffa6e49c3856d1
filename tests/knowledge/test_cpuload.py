"""The CPU-load gate of the controller: other processes' load, measured from /proc."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from egeria.knowledge.cpuload import CpuLoad, wait_for_quiet


class FakeLoad:
    def __init__(self, shares):
        self.shares = list(shares)
        self.calls = 0

    def sample(self):
        self.calls += 1
        return self.shares.pop(0) if self.shares else 0.0


def test_waits_until_the_load_falls_below_the_threshold():
    load = FakeLoad([0.9, 0.8, 0.2, 0.9])
    wait_for_quiet(load, 0.5, interrupt=lambda: False, slice_s=0.001)
    assert load.calls == 3


def test_a_control_message_interrupts_the_wait():
    load = FakeLoad([0.9] * 100)
    calls = []
    wait_for_quiet(load, 0.5, interrupt=lambda: calls.append(1) or len(calls) >= 2, slice_s=0.001)
    assert len(calls) == 2 and load.calls == 2


def test_a_host_that_is_never_quiet_does_not_stop_the_readings():
    load = FakeLoad([0.9] * 10**6)
    waited = wait_for_quiet(load, 0.5, interrupt=lambda: False, slice_s=0.01, max_wait_s=0.05)
    assert waited >= 0.05 and load.calls >= 2  # it gave up waiting instead of waiting forever


def test_an_unmeasurable_load_does_not_wait():
    load = FakeLoad([None])
    assert wait_for_quiet(load, 0.5, interrupt=lambda: False, slice_s=10.0) < 1.0


@pytest.mark.timing
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_busy_process_counts_unless_excluded():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        counted, excluded = CpuLoad([]), CpuLoad([busy.pid])
        ticks_before, started = _cpu_ticks(busy.pid), time.monotonic()
        time.sleep(1.0)
        with_busy, without_busy = counted.sample(), excluded.sample()
        ticks, elapsed = _cpu_ticks(busy.pid) - ticks_before, time.monotonic() - started
    finally:
        busy.kill()
        busy.wait()
    # The busy process's own share of the machine over the interval (it may get less than
    # a core on a loaded machine); excluding it must remove about that much.
    import os

    share = ticks / os.sysconf("SC_CLK_TCK") / elapsed / os.cpu_count()
    assert share > 0
    assert with_busy - without_busy > 0.5 * share


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime
