"""The benchmark layouts: which cores train, which the controller gets, the config each
policy runs with, the pinning, and how reports place runs that record no layout."""

from __future__ import annotations

import os

import pytest
import torch

from egeria.bench.layouts import (
    LEGACY_LAYOUT,
    Layout,
    layout_of_path,
    pinned,
    resolve_layout,
    split_layout_prefix,
    usable_cpus,
)
from egeria.config import EgeriaConfig


def test_cpu_layout_trains_on_every_core_with_as_many_threads() -> None:
    layout = resolve_layout("cpu", [3, 1, 2])
    assert layout == Layout("cpu", (1, 2, 3), 3, None)
    assert layout.config_overrides("egeria") == {}  # Egeria's own config decides (executor="auto")
    assert layout.to_dict() == {"name": "cpu", "train_cpus": [1, 2, 3], "torch_threads": 3, "controller_cpus": None}


def test_accel_layout_trains_on_one_core_and_gives_the_rest_to_the_controller() -> None:
    layout = resolve_layout("accel", [5, 4, 7])
    assert layout == Layout("accel", (4,), 1, (5, 7))
    overrides = layout.config_overrides("egeria")
    assert overrides == {"executor": "process", "controller_cpus": [5, 7]}
    cfg = EgeriaConfig().replace(**overrides)  # a valid config
    assert cfg.executor == "process" and list(cfg.controller_cpus) == [5, 7]
    for policy in ("none", "freezeout", "autofreeze", "linear", "static"):
        assert layout.config_overrides(policy) == {}, policy  # no controller: the same single core


def test_default_cores_are_those_the_process_may_use() -> None:
    assert resolve_layout("cpu").train_cpus == usable_cpus()
    if hasattr(os, "sched_getaffinity"):
        assert set(usable_cpus()) == os.sched_getaffinity(0)


@pytest.mark.parametrize("cpus", [[0], [2, 2]])
def test_accel_on_one_core_names_the_layout_and_the_cores(cpus: list[int]) -> None:
    with pytest.raises(ValueError, match=r"layout 'accel' needs at least 2 cores .* may use 1: \[\d\]"):
        resolve_layout("accel", cpus)
    assert resolve_layout("cpu", cpus).torch_threads == 1


def test_bad_layout_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"unknown layout 'gpu'; choose one of \['cpu', 'accel'\]"):
        resolve_layout("gpu", [0, 1])
    with pytest.raises(ValueError, match="layout 'cpu': no cores"):
        resolve_layout("cpu", [])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pinning needs Linux")
def test_pinned_sets_cores_and_threads_and_restores_them() -> None:
    before_cpus, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(before_cpus)
    with pinned(Layout("accel", (core,), 1, None)):
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before_cpus and torch.get_num_threads() == before_threads
    with pytest.raises(RuntimeError), pinned(Layout("accel", (core,), 1, None)):
        raise RuntimeError("a failed run")
    assert os.sched_getaffinity(0) == before_cpus and torch.get_num_threads() == before_threads


def test_layout_prefix_of_a_report_argument() -> None:
    assert split_layout_prefix("accel=runs/old") == ("accel", "runs/old")
    assert split_layout_prefix("cpu=a=b") == ("cpu", "a=b")
    assert split_layout_prefix("runs/x=1") == (None, "runs/x=1")  # not a layout name: a path
    assert split_layout_prefix("gpu=runs") == (None, "gpu=runs")
    assert split_layout_prefix("accel=") == (None, "accel=")


def test_layout_of_path_is_the_nearest_layout_folder() -> None:
    assert layout_of_path("results/tta-full/runs-accel/resnet-fmnist/none-seed0.json") == "accel"
    assert layout_of_path("results/runs-cpu/x/accel/t/none-seed0.json") == "accel"  # the nearest
    assert layout_of_path("out/cpu/t/egeria-seed0.json") == "cpu"
    assert layout_of_path("benchmarks/results/runs/t/none-seed0.json") is None
    assert layout_of_path("accel.json") is None  # the file's own name does not count
    assert LEGACY_LAYOUT == "accel"
