"""Memory by part (egeria.memory): each number against what it must be on a tiny model,
before and after a freeze, and where it is shown (eg.metrics(), summary)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import egeria
import egeria.memory
from tiny import Plan, batches

B = 16  # the batch size of tiny.batches


def _model():
    """Three layer modules: (Linear 8->16, Tanh), (Linear 16->16, Tanh), Linear 16->3."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _train(plan, steps, optimizer="adamw", compiled=False):
    model = _model()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    eg = egeria.Egeria(model, opt, policy=Plan(plan))
    for x, y in batches(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        eg.step()
    return model, opt, eg


def _bytes(params):
    return sum(p.numel() * p.element_size() for p in params)


def test_adamw_parts_before_and_after_freezing_the_front():
    model, opt, eg = _train({3: 1}, 5)
    assert eg.modules == ["0..1", "2..3", "4"] and eg.frozen == ["0..1"]
    rows = {(r["step"], r["frozen"]): r for r in eg.memory_history}
    before, after = rows[(3, 0)], rows[(4, 1)]  # just before the freeze at step 3, the step after
    params = list(model.parameters())
    front = list(model[0].parameters())
    rest = [p for p in params if all(p is not q for q in front)]
    step_tensor = 4  # AdamW's step count: one float32 per parameter
    for row in (before, after):
        assert row["parameters"] == _bytes(params)
    assert before["gradients"] == _bytes(params)
    assert before["optimizer_state"] == 2 * _bytes(params) + step_tensor * len(params)
    assert before["optimizer_state_released"] == 0
    assert after["gradients"] == _bytes(rest)
    assert after["optimizer_state"] == 2 * _bytes(rest) + step_tensor * len(rest)
    assert after["optimizer_state_released"] == 2 * _bytes(front) + step_tensor * len(front)
    assert before["activation_cache"] == after["activation_cache"] == 0


def test_saved_activations_are_autograds_saved_tensors_and_shrink_with_the_frozen_front():
    """Unfrozen, autograd keeps the input (for the first weight's gradient) and each Tanh's
    output (the next Linear's input, counted once); with the front frozen, the first Linear
    and Tanh save nothing, and the second Linear still keeps its input for its weight."""
    _, _, eg = _train({3: 1}, 5)
    rows = {(r["step"], r["frozen"]): r for r in eg.memory_history}
    assert rows[(1, 0)]["activations"] == 4 * (B * 8 + 2 * B * 16)
    assert rows[(4, 1)]["activations"] == 4 * (2 * B * 16)


def test_sgd_momentum_is_one_buffer_per_trainable_parameter():
    model, _, eg = _train({2: 1}, 4, optimizer="sgd")
    rest = [p for p in model.parameters() if p.requires_grad]
    row = eg.memory_history[-1]
    assert row["frozen"] == 1
    assert row["optimizer_state"] == _bytes(rest)
    assert row["optimizer_state_released"] == _bytes(model[0].parameters())


def test_steps_are_measured_on_samples_and_around_changes(monkeypatch):
    monkeypatch.setattr(egeria.memory, "SAMPLE_EVERY", 4)
    _, _, eg = _train({6: 1, 9: 2}, 12)
    assert [(r["step"], r["frozen"]) for r in eg.memory_history] == [
        (1, 0), (5, 0), (6, 0), (7, 1), (9, 1), (10, 2)
    ]


def test_metrics_and_summary_show_the_latest_parts():
    _, _, eg = _train({2: 1}, 3)
    last = eg.memory_history[-1]
    metrics = eg.metrics()
    for part in egeria.memory.PARTS:
        assert metrics[f"egeria/memory/{part}"] == float(last[part]), part
    now = egeria.memory.summary(eg)
    assert {k: now[k] for k in egeria.memory.PARTS} == {k: last[k] for k in egeria.memory.PARTS}
    assert "cuda_allocated" not in now  # a CPU model


def test_the_activation_cache_counts_its_tables_by_tier():
    stats = {"levels": {"a": {"tier": "memory", "bytes": 100}, "b": {"tier": "disk", "bytes": 30},
                        "c": {"tier": None, "bytes": 0}}}
    assert egeria.memory.cache_bytes(stats) == {"memory": 100, "disk": 30}
    assert egeria.memory.cache_bytes({}) == {"memory": 0, "disk": 0}


def test_the_cache_store_appears_in_the_memory_rows():
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, policy=Plan({2: 1}))
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    loader = eg.cache_loader(torch.utils.data.DataLoader(data, batch_size=16, shuffle=True,
                                                         generator=torch.Generator().manual_seed(5)), serve="always")
    for _ in range(2):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            eg.step()
    held = egeria.memory.cache_bytes(eg.cache_stats)
    assert held["memory"] == 64 * 16 * 4  # the first module's output, 16 float32 per sample
    assert egeria.memory.summary(eg)["activation_cache"] == held["memory"]
    eg.close()


def test_a_forward_that_raises_leaves_no_saved_tensor_hooks_behind():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    eg = egeria.Egeria(model, opt, policy=Plan({}))
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 5))  # wrong width: the first Linear raises
    torch.randn(3, requires_grad=True).exp().sum()  # exp saves its output: a leaked hook would count it
    assert eg._memory._seen == {}
    eg.close()
