"""Where the controller runs: inline beside a CPU model, a process beside an accelerator;
threads never more than the cores it is given; pinning."""

from __future__ import annotations

import os
import time

import pytest
import torch

import egeria
from egeria.knowledge.placement import controller_threads, model_device, resolve_executor
from tiny import Chain, batches, quick_config, train


def test_auto_runs_inline_for_a_cpu_model_and_in_a_process_beside_an_accelerator():
    model = Chain()
    assert model_device(model).type == "cpu"
    assert resolve_executor("auto", model) == "inline"
    assert resolve_executor("auto", Chain().to("meta")) == "process"  # any non-CPU device
    assert resolve_executor("thread", model) == "thread"


def test_controller_threads():
    assert controller_threads("inline", None) is None  # the trainer's own threads
    assert controller_threads("thread", None) is None  # shares the trainer's pool
    assert controller_threads("process", None) == 1
    assert controller_threads("process", (2, 3)) == 2  # one per core it may run on


def test_the_default_config_trains_a_cpu_model_with_an_inline_controller():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(eval_interval=1, window=3))
    train(model, opt, eg, batches(3))
    assert eg.controller_stats["executor"] == "inline"
    eg.close()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity")
def test_the_controller_process_runs_on_the_cores_it_is_given():
    core = sorted(os.sched_getaffinity(0))[-1]
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    config = quick_config(executor="process", controller_cpus=[core], cpu_threshold=None)
    with egeria.Egeria(model, opt, config=config) as eg:
        train(model, opt, eg, batches(2))
        pid = eg.controller_stats["pid"]
        deadline = time.monotonic() + 60  # the child pins itself as it starts
        while os.sched_getaffinity(pid) != {core} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(pid) == {core}


def test_bad_controller_cpus_are_named():
    with pytest.raises(ValueError, match="controller_cpus=\\[-1\\]"):
        egeria.EgeriaConfig(controller_cpus=[-1])
    with pytest.raises(ValueError, match="controller_cpus=\\[\\]"):
        egeria.EgeriaConfig(controller_cpus=[])
    with pytest.raises(ValueError, match="controller_cpus=\\[1\\] pins a controller process; executor='inline'"):
        egeria.EgeriaConfig(controller_cpus=[1], executor="inline")
