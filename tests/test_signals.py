"""Egeria's signals: ``eg.metrics()`` and the TensorBoard writer of a plain loop, read back
from the event files the real ``SummaryWriter`` wrote."""

from __future__ import annotations

import pytest
import torch

import egeria
from tiny import Chain, batches, quick_config, train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402


def static(at_step: int, count: int = 1) -> egeria.EgeriaConfig:
    return egeria.EgeriaConfig(policy="static", policy_options={"count": count, "at_step": at_step})


def built(config: egeria.EgeriaConfig, **kw) -> tuple[Chain, torch.optim.Optimizer, egeria.Egeria]:
    torch.manual_seed(0)
    model = Chain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, optimizer, egeria.Egeria(model, optimizer, config=config, total_steps=100, **kw)


def test_metrics_before_the_first_forward_hold_the_frozen_count_alone():
    _, _, eg = built(static(3))
    assert eg.metrics() == {"egeria/frozen_modules": 0.0}
    eg.close()


def test_metrics_count_the_frozen_modules_and_their_shares_of_parameters_and_flops():
    model, optimizer, eg = built(static(3, count=2))
    train(model, optimizer, eg, batches(2))
    before = eg.metrics()
    assert before["egeria/frozen_modules"] == 0.0
    assert before["egeria/frozen_params_share"] == 0.0 and before["egeria/frozen_backward_flops_share"] == 0.0
    train(model, optimizer, eg, batches(2))
    now = eg.metrics()
    modules = eg.partition.modules
    assert [m.name for m in modules[:2]] == eg.frozen
    params = dict(model.named_parameters())
    frozen = sum(params[p].numel() for m in modules[:2] for p in m.params)
    total = sum(p.numel() for p in model.parameters())
    assert now["egeria/frozen_modules"] == 2.0
    assert now["egeria/frozen_params_share"] == pytest.approx(frozen / total)
    # per sample, the stem's linear layer maps 8 inputs to 16 (its norm and dropout have
    # no weight multiply-adds), each block 16 to 16, the head 16 to 3
    flops = [8 * 16, 0, 16 * 16, 16 * 16, 16 * 16, 16 * 16, 16 * 3]
    names = ["stem.0", "stem.1..stem.2", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert [m.name for m in modules] == names
    assert now["egeria/frozen_backward_flops_share"] == pytest.approx(sum(flops[:2]) / sum(flops), rel=0.02)
    assert not [k for k in now if "plasticity" in k or "readings" in k]  # the static policy reads nothing
    eg.close()


def test_egerias_rule_reports_each_modules_latest_plasticity_and_its_readings():
    model, optimizer, eg = built(quick_config())
    train(model, optimizer, eg, batches(30))
    now = eg.metrics()
    latest = {}
    for reading in eg.history:
        latest[reading["module"]] = reading["plasticity"]
    assert latest, "no readings in 30 steps"
    assert {k.removeprefix("egeria/plasticity/"): v for k, v in now.items() if "plasticity/" in k} == latest
    stats = eg.controller_stats
    assert now["egeria/readings_sent"] == stats["sent"] > 0
    assert now["egeria/readings_answered"] == stats["answered"]
    assert now["egeria/readings_dropped"] == stats["dropped"]
    assert 0 <= now["egeria/overhead_share"] == stats["overhead"]["share"]
    eg.close()


def test_the_writer_gets_the_scalars_every_log_every_steps_and_each_decision_as_text(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path))
    model, optimizer, eg = built(static(3), writer=writer, log_every=5)
    train(model, optimizer, eg, batches(12))
    eg.close()
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    frozen = [(e.step, e.value) for e in events.Scalars("egeria/frozen_modules")]
    assert frozen == [(3, 1.0), (5, 1.0), (10, 1.0)]
    share = [e.step for e in events.Scalars("egeria/frozen_params_share")]
    assert share == [3, 5, 10]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("egeria/decisions/text_summary")]
    assert texts == [(3, f"step 3: freeze stem.0 ({eg.events[0].reason})")]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"writer": object()}, "writer must be a TensorBoard SummaryWriter"),
        ({"writer": SummaryWriter, "log_every": 0}, "log_every must be a positive int"),
        ({"writer": SummaryWriter, "log_every": 2.5}, "got 2.5"),
    ],
)
def test_a_bad_writer_or_interval_is_named(kwargs, message):
    model = Chain()
    with pytest.raises(ValueError, match=message):
        egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1), config=static(3), **kwargs)
