"""Freezing to the average (egeria.averaging): a module freezes at the running average of its
weights, its BatchNorm statistics are re-estimated on the next batches, the averages ride the
checkpoint and restart at an unfreeze."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import egeria
from egeria.checkpoint.saved_state import sealed
from tiny import Chain, Plan, batches, checkpointed

#: Chain's stem as layer modules: its Linear, then its BatchNorm (and dropout).
STEM = ["stem.0", "stem.1..stem.2"]


def make(plan, span=4, seed=0):
    torch.manual_seed(seed)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eg = egeria.Egeria(model, opt, policy=Plan(plan), average=egeria.WeightAverage(span=span))
    return model, opt, eg


def step(model, opt, eg, x, y):
    model.train()
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return eg.step(loss)


def stem_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("stem.")}


def test_a_module_freezes_at_the_mean_then_the_exponential_average_of_its_weights():
    model, opt, eg = make({6: 2}, span=4)
    seen = []  # the stem's weights after each optimizer step, as eg.step() finds them
    for x, y in batches(6):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(stem_params(model))
        eg.step(loss)
    assert eg.frozen == STEM
    for name, value in stem_params(model).items():
        expected = seen[0][name].clone()
        for k, later in enumerate(seen[1:], start=2):
            expected.lerp_(later[name], 1.0 / min(k, 4))
        assert torch.equal(value, expected), name
        if not torch.equal(seen[0][name], seen[-1][name]):  # (a bias before the BatchNorm never moves)
            assert not torch.equal(value, seen[-1][name]), f"{name}: the average is not the last iterate"
    # a frozen module's average is dropped; the unfrozen ones go on
    assert not any(n.startswith("stem.") for n in eg._prefix.average.averages)
    assert any(n.startswith("blocks.0.") for n in eg._prefix.average.averages)


def test_batchnorm_statistics_are_re_estimated_on_the_next_batches_then_held():
    model, opt, eg = make({3: 2}, span=2)
    data = batches(16, seed=4)
    for x, y in data[:3]:
        step(model, opt, eg, x, y)
    norm = model.stem[1]
    linear = model.stem[0]
    assert eg.frozen == STEM and eg._prefix.settled == 1  # the BatchNorm's module is not final yet
    assert norm.momentum is None and int(norm.num_batches_tracked) == 0
    means, variances = [], []
    for i, (x, y) in enumerate(data[3:13]):
        with torch.no_grad():
            h = linear(x)
        means.append(h.mean(0))
        variances.append(h.var(0, unbiased=True))
        if i == 4:  # an eval-mode pass (the user's validation) reads the statistics so far, changes none
            before = norm.running_mean.clone()
            model.eval()
            with torch.no_grad():
                model(x)
            assert not norm.training and torch.equal(norm.running_mean, before)
        step(model, opt, eg, x, y)
        assert eg._prefix.settled == (2 if i == 9 else 1)
    torch.testing.assert_close(norm.running_mean, torch.stack(means).mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.running_var, torch.stack(variances).mean(0), rtol=1e-5, atol=1e-6)
    assert norm.momentum == 0.1
    held = norm.running_mean.clone()
    step(model, opt, eg, *data[13])
    assert not norm.training and torch.equal(norm.running_mean, held)


@pytest.mark.parametrize("split", [4, 8, 14], ids=["averaging", "re-estimating", "after"])
def test_resumed_equals_uninterrupted_bit_for_bit(split, tmp_path):
    plan = {6: 2, 12: 3}
    data = batches(20, seed=2)
    model, opt, eg = make(plan)
    for x, y in data[:split]:
        step(model, opt, eg, x, y)
    saved = checkpointed(model, opt, eg)
    eg.save(tmp_path)
    for x, y in data[split:]:
        step(model, opt, eg, x, y)
    assert eg.frozen == [*STEM, "blocks.0"]

    for load in ("dict", "folder"):
        model2, opt2, eg2 = make(plan, seed=1)
        model2.load_state_dict(saved[0])
        opt2.load_state_dict(copy.deepcopy(saved[1]))  # the optimizer takes the saved tensors in
        eg2.load_state_dict(saved[2]) if load == "dict" else eg2.load(tmp_path)
        for x, y in data[split:]:
            step(model2, opt2, eg2, x, y)
        assert eg2.frozen == eg.frozen
        for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
            assert torch.equal(a, b), (load, name)


def test_an_unfreeze_restarts_the_averages_and_ends_a_re_estimate():
    model, opt, eg = make({3: 2, 6: 0})
    data = batches(9, seed=5)
    for x, y in data[:6]:
        step(model, opt, eg, x, y)
    norm = model.stem[1]
    assert eg.frozen == [] and eg._prefix.average.updates == 0 and not eg._prefix.average.averages
    assert norm.momentum == 0.1 and norm.training  # trains as plain again
    for x, y in data[6:]:
        step(model, opt, eg, x, y)
    assert eg._prefix.average.updates == 3


def test_bad_settings_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="span=0"):
        egeria.WeightAverage(span=0)
    with pytest.raises(ValueError, match="span=2.5"):
        egeria.WeightAverage(span=2.5)
    model = Chain()
    with pytest.raises(ValueError, match="average must be an egeria.WeightAverage or None, got int"):
        egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1), average=1)


def test_a_damaged_average_state_is_refused_and_changes_nothing():
    model, opt, eg = make({3: 2})
    for x, y in batches(5, seed=6):
        step(model, opt, eg, x, y)
    state = json.loads(json.dumps(eg.state_dict()))
    good = dict(eg._prefix.average.averages)

    frozen_param = dict(state)
    frozen_param["average"] = {**state["average"], "averages": {**state["average"]["averages"], "stem.0.weight": state["average"]["averages"]["blocks.0.fc.weight"]}}
    with pytest.raises(ValueError, match=r"state\.average\.averages key.*'stem\.0\.weight'"):
        eg.load_state_dict(sealed(frozen_param))
    wrong_shape = dict(state)
    wrong_shape["average"] = {**state["average"], "averages": {**state["average"]["averages"], "blocks.0.fc.weight": state["average"]["averages"]["blocks.0.fc.bias"]}}
    with pytest.raises(ValueError, match=r"state\.average\.averages\['blocks\.0\.fc\.weight'\]\.shape"):
        eg.load_state_dict(sealed(wrong_shape))
    unfrozen = dict(state)
    unfrozen["average"] = {**state["average"], "restats": [{"module": "blocks.1", "left": 3, "momenta": [0.1]}]}
    with pytest.raises(ValueError, match=r"state\.average\.restats\[0\]\.module"):
        eg.load_state_dict(sealed(unfrozen))
    assert eg._prefix.average.averages.keys() == good.keys()
    assert all(torch.equal(eg._prefix.average.averages[k], v) for k, v in good.items())


def test_a_state_without_averages_starts_them_afresh_and_one_with_them_loads_without(caplog):
    model, opt, eg = make({3: 2})
    for x, y in batches(5, seed=7):
        step(model, opt, eg, x, y)
    state = json.loads(json.dumps(eg.state_dict()))
    plain_model = Chain()
    plain = egeria.Egeria(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1), policy=Plan({3: 2}))
    plain_model.load_state_dict(model.state_dict())
    with caplog.at_level("WARNING"):
        plain.load_state_dict(state)
    assert "holds weight averages" in caplog.text
    assert plain.frozen == STEM

    eg.load_state_dict(sealed({**state, "average": None}))
    assert eg._prefix.average.updates == 0 and not eg._prefix.average.averages
