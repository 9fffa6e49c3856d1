"""SmartFRZ as a policy: the predictor's arithmetic, the fixed weight sample, front-to-back
decisions, checkpoints, and the shipped weights."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import egeria
from egeria.policies import SmartFRZ, StepInfo, make_policy
from egeria.policies.smartfrz import front_run
from egeria.policies.smartfrz_predictor import (
    WEIGHTS_FILE,
    WEIGHTS_SHA256,
    AttentionPredictor,
    load_shipped,
    pack_weights,
)
from egeria.policies.smartfrz_sampling import build_samples, normalise_window, read_sample, sample_indices
from tiny import Chain, batches, checkpointed, train


def _set(linear: nn.Linear, weight, bias) -> None:
    with torch.no_grad():
        linear.weight.copy_(torch.tensor(weight, dtype=torch.float32))
        linear.bias.copy_(torch.tensor(bias, dtype=torch.float32))


def _identity_mlp(mlp: nn.Sequential, n: int) -> None:
    for layer in (mlp[0], mlp[2], mlp[4]):
        _set(layer, torch.eye(n).tolist(), [0.0] * n)


def test_predictor_forward_matches_a_hand_computed_case():
    # S = 2, every MLP the identity (with ReLUs, so inputs are kept >= 0 here), dim 2.
    predictor = AttentionPredictor(size=2, hidden=2, dim=2, head_hidden=2)
    for mlp in (predictor.key, predictor.query, predictor.value, predictor.head):
        _identity_mlp(mlp, 2)
    # The head's last layer: logits = (z0 - z1, 2 z1 + 1).
    _set(predictor.head[4], [[1.0, -1.0], [0.0, 2.0]], [0.0, 1.0])
    window = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]])  # T = 3, oldest first
    # Keys = values = (1, 0) and (0, 2); query (1, 1). Scores q.k / sqrt(2): 1/sqrt2, 2/sqrt2.
    s1, s2 = 1 / math.sqrt(2), 2 / math.sqrt(2)
    a1 = math.exp(s1) / (math.exp(s1) + math.exp(s2))
    a2 = 1 - a1
    z = (a1 * 1.0, a2 * 2.0)  # a1 (1, 0) + a2 (0, 2)
    expected = torch.tensor([[z[0] - z[1], 2 * z[1] + 1]])
    torch.testing.assert_close(predictor(window), expected)


def test_predictor_refuses_windows_of_the_wrong_shape():
    predictor = AttentionPredictor(size=4, hidden=4, dim=2, head_hidden=2)
    with pytest.raises(ValueError, match=r"\(1, 1, 4\)"):
        predictor(torch.zeros(1, 1, 4))
    with pytest.raises(ValueError, match=r"\(1, 3, 5\)"):
        predictor(torch.zeros(1, 3, 5))


def test_normalised_window_is_the_motion_in_hundredths_of_the_weight_spread():
    newest = torch.tensor([1.0, -1.0, 1.0, -1.0])  # std 2/sqrt(3)
    window = torch.stack([newest - 0.02, newest, newest + 0.02])
    spread = float(newest.std())
    expected = torch.asinh(torch.tensor([-0.02, 0.0, 0.02]) / (0.01 * spread)).unsqueeze(1).expand(3, 4)
    torch.testing.assert_close(normalise_window(window), expected)
    # The weights' values drop out: only their motion is left.
    torch.testing.assert_close(normalise_window(window * 3 + 5), expected)


def test_the_sample_is_the_same_weights_every_time_and_in_every_process():
    model = Chain()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    first = build_samples(model, partition, partition.freezable, 16, seed=3)
    second = build_samples(model, partition, partition.freezable, 16, seed=3)
    assert [s.params for s in first] == [s.params for s in second]
    for a, b in zip(first, second):
        for x, y in zip(a.picks, b.picks):
            assert torch.equal(x, y)
    other = build_samples(model, partition, partition.freezable, 16, seed=4)
    assert any(not torch.equal(x, y) for a, b in zip(first, other) for x, y in zip(a.picks, b.picks))
    # A sample reads exactly those weights, from the weight matrices only.
    named = dict(model.named_parameters())
    block = partition.names.index("blocks.0")
    assert first[block].params == ("blocks.0.fc.weight",)
    flat = named["blocks.0.fc.weight"].detach().reshape(-1)
    torch.testing.assert_close(read_sample(named, first[block]), flat[first[block].picks[0]])
    # Another interpreter, with another hash seed, draws the same indices.
    code = "from egeria.policies.smartfrz_sampling import sample_indices; print(sample_indices(5000, 16, 3, 2).tolist())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert json.loads(out) == sample_indices(5000, 16, 3, 2).tolist()


def test_a_small_module_is_sampled_with_replacement():
    picks = sample_indices(5, 16, seed=0, index=0)
    assert len(picks) == 16 and int(picks.min()) >= 0 and int(picks.max()) <= 4
    assert torch.equal(picks, picks.sort().values)
    distinct = sample_indices(100, 16, seed=0, index=0)
    assert len(set(distinct.tolist())) == 16


def test_front_run_stops_at_the_first_module_to_keep():
    assert front_run([0.9, 0.8, 0.2, 0.9]) == 2
    assert front_run([0.3, 0.9, 0.9]) == 0
    assert front_run([0.5, 0.9]) == 0  # p = 0.5 is not a majority for freezing
    assert front_run([]) == 0


# -- a hand-made predictor for the engine-level tests: "freeze when the weights stood still"


SIZE, WINDOW = 8, 4


def motion_predictor(threshold: float) -> AttentionPredictor:
    """Uniform attention (zero keys and queries); value 0 = mean |x| of a snapshot; logits
    (mean |x| over the older snapshots, threshold): freezes a module whose normalised
    motion is below ``threshold``."""
    predictor = AttentionPredictor(size=SIZE, hidden=2 * SIZE, dim=2, head_hidden=2)
    with torch.no_grad():
        for p in [*predictor.key.parameters(), *predictor.query.parameters(), *predictor.value.parameters()]:
            p.zero_()
        first = predictor.value[0].weight
        first[:SIZE] = torch.eye(SIZE)
        first[SIZE:] = -torch.eye(SIZE)  # relu(x) and relu(-x): |x| in two halves
        predictor.value[2].weight[0] = 1.0 / SIZE  # mean |x|
        predictor.value[4].weight[0, 0] = 1.0
    _set(predictor.head[0], [[1.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    _set(predictor.head[2], [[1.0, 0.0], [0.0, 0.0]], [0.0, 0.0])
    _set(predictor.head[4], [[1.0, 0.0], [0.0, 0.0]], [0.0, threshold])
    return predictor


@pytest.fixture
def motion_weights(tmp_path):
    path = tmp_path / "motion.pt"
    path.write_bytes(pack_weights(motion_predictor(threshold=0.5), {"window": WINDOW}))
    return str(path)


def smartfrz_run(weights: str, params=None, lr: float = 0.5, **options):
    torch.manual_seed(0)
    model = Chain()
    chosen = list(model.parameters()) if params is None else params(model)
    opt = torch.optim.SGD(chosen, lr=lr)
    policy = SmartFRZ(size=SIZE, window=WINDOW, stage_every=WINDOW, weights=weights, **options)
    eg = egeria.Egeria(model, opt, policy=policy, total_steps=100)
    return model, opt, eg


def test_decisions_go_front_to_back(motion_weights):
    # Only blocks.1 trains: the stem and blocks.0 stand still and freeze at the first stage;
    # blocks.2 and blocks.3 stand still too but sit behind the moving blocks.1, so they stay.
    model, opt, eg = smartfrz_run(motion_weights, params=lambda m: list(m.blocks[1].parameters()))
    decisions = train(model, opt, eg, batches(WINDOW, seed=2))
    assert [(d.step, d.action, d.modules) for d in decisions] == [
        (WINDOW, "freeze", ("stem.0", "stem.1..stem.2", "blocks.0"))
    ]
    assert eg.frozen == ["stem.0", "stem.1..stem.2", "blocks.0"]
    assert [p > 0.5 for p in eg.policy.probabilities] == [True, True, True, False, True, True]
    # The moving front module holds every module behind it.
    model, opt, eg = smartfrz_run(motion_weights, params=lambda m: list(m.stem[0].parameters()))
    assert train(model, opt, eg, batches(3 * WINDOW, seed=2)) == []
    assert eg.policy.stages_run == 3 and eg.policy.probabilities[0] < 0.5 < min(eg.policy.probabilities[1:])


def test_nothing_is_predicted_before_a_window_is_full(motion_weights):
    model, opt, eg = smartfrz_run(motion_weights, params=lambda m: list(m.head.parameters()))
    assert train(model, opt, eg, batches(WINDOW - 1, seed=2)) == []
    assert eg.policy.stages_run == 0


def test_resume_equals_uninterrupted_run(motion_weights):
    # Every module trains, the learning rate falls: the front freezes stage by stage.
    data = batches(40, seed=7)

    def fresh():
        model, opt, eg = smartfrz_run(motion_weights)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)
        return model, opt, sched, eg

    model, opt, sched, eg = fresh()
    cut = 5 * WINDOW + 2  # mid-window, after the first freeze: the next stage reads samples from both sides
    first = train(model, opt, eg, data[:cut], scheduler=sched)
    saved = checkpointed(model, opt, eg)
    saved_sched = copy.deepcopy(sched.state_dict())
    rest = train(model, opt, eg, data[cut:], scheduler=sched)
    assert first and rest, "the test needs decisions before and after the checkpoint"
    model2, opt2, sched2, eg2 = fresh()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved_sched)
    eg2.load_state_dict(saved[2])
    assert train(model2, opt2, eg2, data[cut:], scheduler=sched2) == rest
    assert eg2.policy.probabilities == eg.policy.probabilities and eg2.policy.stages_run == eg.policy.stages_run


def test_a_bad_checkpoint_field_is_a_value_error_naming_it(motion_weights):
    model, opt, eg = smartfrz_run(motion_weights)
    train(model, opt, eg, batches(WINDOW + 2, seed=1))
    good = json.loads(json.dumps(eg.state_dict()))
    good.pop("digest", None)  # a hand-edited state: checked field by field, not refused whole by its digest
    cases = {
        "windows[2]": lambda s: s["windows"].__setitem__(2, "junk"),
        "seed": lambda s: s.__setitem__("seed", 7),
        "size": lambda s: s.__setitem__("size", 1024),
        "stage": lambda s: s.__setitem__("stage", -1),
        "probabilities": lambda s: s.__setitem__("probabilities", [2.0]),
        "windows": lambda s: s.__setitem__("windows", s["windows"][:1]),
    }
    for field, damage in cases.items():
        state = copy.deepcopy(good)
        damage(state["policy_state"])
        with pytest.raises(ValueError, match=re.escape(f"SmartFRZ state field {field} =")):
            eg.load_state_dict(state)
    wide = copy.deepcopy(good)
    entry = wide["policy_state"]["windows"][0]
    entry["shape"] = [entry["shape"][0] * SIZE // 2, 2]
    with pytest.raises(ValueError, match=r"windows\[0\]"):
        eg.load_state_dict(wide)
    eg.load_state_dict(good)  # the undamaged state still loads
    # The same check, for an engine that checks a whole state before loading any of it.
    spec = eg.policy.state_spec(SimpleNamespace(partition=eg.partition))
    spec(good["policy_state"], "state.policy_state")
    damaged = copy.deepcopy(good["policy_state"])
    damaged["window"] = WINDOW + 1
    with pytest.raises(ValueError, match=re.escape(f"SmartFRZ state field window = {WINDOW + 1}")):
        spec(damaged, "state.policy_state")


def test_shipped_weights_load_and_match_their_checksum(tmp_path):
    raw = WEIGHTS_FILE.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == WEIGHTS_SHA256
    predictor, meta = load_shipped()
    assert predictor.size == 1024 and meta["window"] == SmartFRZ().window
    assert meta["trained_on"] and not any(
        task in " ".join(meta["trained_on"]) for task in ("resnet", "fmnist", "ptb")
    )
    out = predictor(torch.zeros(3, SmartFRZ().window, 1024))
    assert out.shape == (3, 2) and torch.isfinite(out).all()
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(ValueError, match="SHA-256"):
        load_shipped(damaged, sha256=WEIGHTS_SHA256)


def test_smartfrz_is_a_policy_by_name_with_checked_options():
    assert isinstance(make_policy("smartfrz"), SmartFRZ)
    assert egeria.EgeriaConfig(policy="smartfrz").policy == "smartfrz"
    with pytest.raises(ValueError, match="SmartFRZ window=1"):
        SmartFRZ(window=1)
    with pytest.raises(ValueError, match="SmartFRZ seed=-1"):
        SmartFRZ(seed=-1)
    with pytest.raises(ValueError, match="weights='/nonexistent'"):
        SmartFRZ(weights="/nonexistent")
    with pytest.raises(ValueError, match="pass total_steps"):
        SmartFRZ().plan(StepInfo(step=1, total_steps=None, frozen=0, freezable=3, lr=0.1))


def test_default_policy_binds_the_shipped_predictor():
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="smartfrz"), total_steps=50)
    train(model, opt, eg, batches(2, seed=1))
    assert eg.stage == "guided"  # the engine's stage names Egeria's rule's phases, not SmartFRZ's count
    assert eg.policy._predictor is not None and eg.policy.plan(
        StepInfo(step=1, total_steps=50, frozen=0, freezable=6, lr=0.1)
    ) == (1, 1)
