"""benchmarks/cache_overhead.py's profile: where a profiled loop's Python time went."""

from __future__ import annotations

import cProfile

import torch

from egeria.cache import Augmented
from scripts import load_script


def _module():
    return load_script("benchmarks/cache_overhead.py")


def test_the_profile_counts_egerias_own_functions_per_step_apart_from_the_rest():
    data = Augmented(torch.utils.data.TensorDataset(torch.zeros(40, 2)), lambda x, g: x, variants=4)
    profiler = cProfile.Profile()
    profiler.enable()
    for index in range(40):
        data.variant(index)
    torch.zeros(3).sum()
    profiler.disable()
    found = _module()._profiled(profiler, steps=4)
    ours = {row["function"]: row for row in found["top_egeria"]}
    variant = next(row for name, row in ours.items() if name.startswith("datasets.py:") and name.endswith("(variant)"))
    assert variant["calls"] == 40 and variant["egeria"]
    assert all(row["egeria"] for row in found["top_egeria"])
    assert any(not row["egeria"] for row in found["top"])  # torch's and Python's own functions count apart
    assert found["egeria_own_ms_per_step"] >= sum(r["own_ms_per_step"] for r in found["top_egeria"]) - 1e-9
    assert variant["own_ms_per_step"] > 0
