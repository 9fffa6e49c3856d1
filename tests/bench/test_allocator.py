"""egeria.bench.allocator: fixed glibc heap thresholds for timed comparisons."""

from __future__ import annotations

import subprocess
import sys

import pytest

import egeria.bench.allocator as allocator
from egeria.bench.allocator import MMAP_THRESHOLD_MAX, steady_heap

glibc = pytest.mark.skipif(not allocator.can_fix_heap(), reason="the C library is not glibc")

# Allocates and frees six 4 MB activations (the sizes of a ResNet's at batch 128) ten times,
# touching every page, and prints the minor page faults of each round after the first two
# (the second may still place one of them anew, around what torch's first calls kept).
_ROUNDS = """
import resource, sys, torch
from egeria.bench.allocator import heap_state, steady_heap
torch.set_num_threads(1)
assert heap_state() == "default"
if sys.argv[1] == "steady":
    assert steady_heap() and heap_state() == "steady"
faults = []
for round in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kept = [torch.empty(1 << 20).fill_(float(i)) for i in range(6)]
    del kept
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[2:]))
"""


def _worst_round(heap: str) -> int:
    done = subprocess.run([sys.executable, "-c", _ROUNDS, heap], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.timing  # page faults also count what the kernel and the loaded machine do: 1,024 in 1 of 5 CI runs
@pytest.mark.slow
@glibc
def test_a_steady_heap_reuses_freed_activations_without_page_faults():
    one = 4 * (1 << 20) // 4096  # the pages of one activation
    assert _worst_round("steady") < one // 4  # the later rounds reuse the earlier rounds' pages


def test_steady_heap_changes_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr(allocator, "_state", "default")
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    assert steady_heap() is False
    assert allocator.heap_state() == "default"


def test_steady_heap_warns_when_glibc_refuses(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "_state", "default")
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda option, value: 0)
    assert steady_heap() is False
    assert "refused" in caplog.text and allocator.heap_state() == "default"


def test_steady_heap_passes_both_thresholds_to_mallopt(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_state", "default")
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda option, value: calls.append((option, value)) or 1)
    assert steady_heap(mmap_threshold=1 << 20, trim_threshold=1 << 30) is True
    assert calls == [(allocator._M_MMAP_THRESHOLD, 1 << 20), (allocator._M_TRIM_THRESHOLD, 1 << 30)]
    assert allocator.heap_state() == "steady"


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"mmap_threshold": 0}, "mmap_threshold"),
        ({"trim_threshold": -1}, "trim_threshold"),
        ({"mmap_threshold": 1.5}, "1.5"),
        ({"trim_threshold": True}, "True"),
        ({"trim_threshold": 2**32 + 5}, str(2**32 + 5)),  # a C int would wrap it to 5
        ({"mmap_threshold": MMAP_THRESHOLD_MAX + 1}, str(MMAP_THRESHOLD_MAX + 1)),
    ],
)
def test_bad_thresholds_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        steady_heap(**kwargs)
