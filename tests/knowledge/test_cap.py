"""The FLOPs cap bounds what freezes while it still moves: past ``max_frozen_flops`` a module
freezes only once quiet (docs/decisions/041-quiet-modules-pass-the-cap.md); a baseline
given the cap stops at it."""

from __future__ import annotations

import json

import pytest
import torch

import egeria
from egeria.knowledge.executors import InlineExecutor
from egeria.knowledge.protocol import Readout, Request
from egeria.knowledge.rule import FrontRule, RuleSettings
from egeria.knowledge.service import ControllerSpec
from egeria.knowledge.weights import float_snapshot
from tiny import Chain, batches, quick_config, train

# Chain's weight computation per sample: stem 8x16, four blocks 16x16 each, head 16x3 (1,200
# multiply-adds): the stem's two modules and the first block hold 32% of it, so a cap of 0.4
# lets three of its six freezable modules freeze while they move.
CAP = 0.4
WITHIN = 3


def _rule() -> FrontRule:
    return FrontRule(RuleSettings(window=3, tolerance_ratio=0.2, floor_ratio=8.0))


def _read(rule: FrontRule, values: dict[int, float], step: int, floor: float = 0.01) -> None:
    for index, value in values.items():
        rule.read(index, value, floor=floor, step=step)


def test_past_the_cap_a_settled_module_waits_and_a_quiet_one_freezes():
    rule = _rule()
    # both modules flat at 100x their floor: settled (their slope is 0), not quiet
    for step in range(1, 8):
        _read(rule, {0: 1.0, 1: 1.0}, step)
    assert rule.settled(0) and rule.settled(1) and not rule.quiet(1)
    assert rule.settled_front([0, 1]) == 2
    assert rule.settled_front([0, 1], cap=1) == 1  # module 1 is past the cap and still moves
    assert rule.settled_front([0, 1], cap=0) == 0
    # module 1 at 5x its floor (within floor_ratio 8) for a span: quiet, and past the cap too
    for step in range(8, 15):
        _read(rule, {0: 1.0, 1: 0.05}, step)
    assert rule.quiet(1)
    assert rule.settled_front([0, 1], cap=1) == 2
    # a prefix: a quiet module behind one that has not settled waits for it
    for step in range(15, 22):
        _read(rule, {0: 1.0 + step, 1: 0.05}, step)
    assert not rule.settled(0) and rule.settled_front([0, 1], cap=1) == 0


def _controller(cap: int):
    torch.manual_seed(0)
    model = Chain(depth=4).eval()
    partition = egeria.partition_model(model, (torch.randn(4, 8),))
    partition.cap = cap
    spec = ControllerSpec(
        partition, float_snapshot(model), "fp32",
        RuleSettings(window=3, tolerance_ratio=0.2, floor_ratio=8.0, idle_share=0.01),
        threads=1, cpu_threshold=None, span=partition.freezable,
    )
    return model, partition, InlineExecutor(spec)


def test_the_idle_yardstick_is_the_most_active_module_within_the_cap():
    """The deepest block moves a thousandfold more than the rest: the modules within the
    cap are compared among themselves, never with it, so none of them reads idle by its
    measure, and a module past the cap is read for quiet only."""
    model, partition, executor = _controller(cap=WITHIN)
    x = torch.randn(16, 8)
    g = torch.Generator().manual_seed(0)
    rows = []
    for seq in range(1, 8):
        with torch.no_grad():
            for name, param in model.named_parameters():
                scale = 1.0 if name.startswith("blocks.3.") else 1e-3
                param.add_(scale * 0.1 * torch.randn(param.shape, generator=g))
        executor.offer(Request(seq, 0, seq, 0, ((x,), {})))
        executor.readout(Readout(seq, None, dict(model.state_dict())))
        [result] = executor.poll()
        rows += result.readings or []
    assert rows, "the test needs readings"
    last = {r["module"]: r for r in rows if r["step"] == 7}
    names = partition.names
    assert set(last) == set(names[: partition.freezable])
    within = [last[n]["active_share"] for n in names[:WITHIN]]
    assert max(within) == pytest.approx(1.0) and all(s is not None for s in within)
    assert all(last[n]["active_share"] is None and last[n]["idle"] == 0 for n in names[WITHIN : partition.freezable])
    # blocks.3 read far above every module within the cap: as a yardstick it would have
    # made them idle
    assert last["blocks.3"]["smoothed"] > 100 * max(last[n]["smoothed"] for n in names[:WITHIN])


def _half_still_sgd(model: Chain) -> torch.optim.SGD:
    """SGD at 0.05 for the last two blocks and the head, at 0 for the rest: every module up
    to blocks.1 stops moving from the start, blocks.2 and 3 train on."""
    moving = [p for i in (2, 3) for p in model.blocks[i].parameters()] + list(model.head.parameters())
    ids = {id(p) for p in moving}
    still = [p for p in model.parameters() if id(p) not in ids]
    return torch.optim.SGD([{"params": moving, "lr": 0.05}, {"params": still, "lr": 0.0}])


def _engine(model: Chain, opt, policy: str = "egeria", cap: float = CAP) -> egeria.Egeria:
    if policy == "egeria":
        # an fp32 reference: its own error is 0, so only a module that does not move is quiet
        config = quick_config(rule="egeria", max_frozen_flops=cap, reference_precision="fp32")
    else:
        config = egeria.EgeriaConfig(policy=policy, policy_options={"count": 6, "at_step": 5},
                                     max_frozen_flops=cap, executor="inline")
    return egeria.Egeria(model, opt, config=config, total_steps=120)


@pytest.mark.parametrize("cap", [CAP, 1.0])
def test_past_the_cap_only_the_modules_that_stopped_moving_freeze(cap):
    torch.manual_seed(0)
    model = Chain()
    opt = _half_still_sgd(model)
    eg = _engine(model, opt, cap=cap)
    decisions = train(model, opt, eg, batches(120))
    frozen, partition = list(eg.frozen), eg.partition
    eg.close()
    freezes = [d for d in decisions if d.action == "freeze"]
    assert partition.freezable == 6
    if cap == CAP:
        # stem.0 to blocks.0 within the cap, blocks.1 past it: all four quiet; blocks.2 and 3
        # train on, past the cap, and wait although their slope settles (below, uncapped)
        assert partition.cap == WITHIN
        assert frozen == eg.modules[:4], freezes
        assert all("reference's own error" in d.reason for d in freezes)
    else:
        assert partition.cap == 6 and frozen == eg.modules[:6], freezes
        assert any("slope within tolerance" in d.reason and "blocks.2" in d.modules for d in freezes)


def test_a_baseline_given_the_cap_stops_at_it():
    torch.manual_seed(0)
    model = Chain()
    opt = _half_still_sgd(model)
    eg = _engine(model, opt, policy="static")
    train(model, opt, eg, batches(20))
    frozen, partition = list(eg.frozen), eg.partition
    eg.close()
    assert partition.freezable == WITHIN and partition.cap is None
    assert frozen == eg.modules[:WITHIN]


def test_a_resumed_run_keeps_the_cap_and_its_modules_past_it():
    torch.manual_seed(0)
    model = Chain()
    opt = _half_still_sgd(model)
    eg = _engine(model, opt)
    data = batches(120)
    train(model, opt, eg, data[:5])
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(), json.loads(json.dumps(eg.state_dict())))
    rest = train(model, opt, eg, data[5:])
    assert eg.partition.cap == WITHIN and rest, "the test needs a freeze past the cap after the checkpoint"

    torch.manual_seed(0)
    model2 = Chain()
    opt2 = _half_still_sgd(model2)
    eg2 = _engine(model2, opt2)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    eg2.load_state_dict(saved[2])
    assert eg2.partition.cap == WITHIN and eg2.partition.freezable == 6
    assert train(model2, opt2, eg2, data[5:]) == rest
    assert eg2.frozen == eg.frozen == eg.modules[:4]
    eg.close()
    eg2.close()
