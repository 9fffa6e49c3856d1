from __future__ import annotations

import pytest
import torch

import egeria
from egeria.policies import AutoFreeze, FreezeOut, LinearSchedule, NoFreezing, StaticFreezing, StepInfo, make_policy
from tiny import Chain, batches, checkpointed, idle_step, train


def info(step, total=100, frozen=0, freezable=4):
    return StepInfo(step=step, total_steps=total, frozen=frozen, freezable=freezable, lr=0.1)


def test_freezeout_stop_times_follow_the_formula():
    policy = FreezeOut(t0=0.8, scaling="cubic")
    # t_i = (0.8 + 0.2 i / 4)^3: 0.512, 0.614125, 0.729, 0.857375
    assert policy.stop_times(4) == pytest.approx([0.512, 0.614125, 0.729, 0.857375])
    assert FreezeOut(t0=0.5, scaling="linear").stop_times(2) == pytest.approx([0.5, 0.75])
    steps = (51, 52, 61, 62, 72, 73, 85, 86, 100)
    assert [policy.target(info(s)) for s in steps] == [0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_linear_schedule_freezes_at_a_constant_pace_after_start():
    policy = LinearSchedule(start=0.5, final=1.0)
    targets = [policy.target(info(s)) for s in range(0, 101, 10)]
    assert targets[:6] == [0] * 6
    assert targets == sorted(targets)
    assert targets[-1] == 4
    assert LinearSchedule(start=0.0, final=0.5).target(info(100)) == 2


def test_static_and_none():
    policy = StaticFreezing(count=2, at_step=30)
    assert [policy.target(info(s)) for s in (29, 30, 90)] == [0, 2, 2]
    assert StaticFreezing(count=9, at_step=0).target(info(1)) == 4  # clamped to the freezable modules
    assert all(NoFreezing().target(info(s)) == 0 for s in range(1, 100, 7))


def test_autofreeze_freezes_the_front_run_at_or_below_the_median_change():
    policy = AutoFreeze(interval=10, percentile=50)
    previous = [1.0, 1.0, 1.0, 1.0, 1.0]
    # Relative changes of the 4 freezable modules' norms: 0.01, 0.02, 0.5, 0.03 -> median 0.025;
    # the front run at or below it is modules 0 and 1.
    assert policy.front_run(previous, [1.01, 1.02, 1.5, 1.03, 7.0], frozen=0, freezable=4) == 2
    assert policy.front_run(previous, [1.01, 1.5, 1.02, 1.03, 7.0], frozen=0, freezable=4) == 1
    assert policy.front_run(previous, [1.5, 1.01, 1.02, 1.03, 7.0], frozen=0, freezable=4) == 0
    # Already frozen modules are not compared: changes 0.5, 0.03 -> median 0.265.
    assert policy.front_run(previous, [1.01, 1.02, 1.5, 1.03, 7.0], frozen=2, freezable=4) == 2
    assert policy.target(info(25)) is None  # not an interval boundary


def test_autofreeze_reads_real_gradients_through_hooks():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="autofreeze", policy_options={"interval": 4}))
    train(model, opt, eg, batches(4, seed=5))
    assert eg.policy.previous is not None
    freezable = eg.partition.freezable
    assert all(v > 0 for v in eg.policy.previous[:freezable])
    eg.close()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_engine_applies_a_policy_with_the_same_mechanics():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = egeria.EgeriaConfig(policy="static", policy_options={"count": 2, "at_step": 3})
    eg = egeria.Egeria(model, opt, config=config)
    decisions = train(model, opt, eg, batches(3, seed=2))
    assert [(d.step, d.action, d.modules) for d in decisions] == [(3, "freeze", tuple(eg.modules[:2]))]
    assert eg.frozen == eg.modules[:2]
    named = dict(model.named_parameters())
    frozen = {n: named[n].detach().clone() for m in eg.partition.modules[:2] for n in m.params}
    train(model, opt, eg, batches(4, seed=3))
    assert all(torch.equal(named[n], v) for n, v in frozen.items())


def test_freezeout_through_the_engine_ends_with_every_freezable_module_frozen_in_order():
    model = Chain(depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = egeria.EgeriaConfig(policy="freezeout", policy_options={"t0": 0.5, "scaling": "linear"})
    eg = egeria.Egeria(model, opt, config=config, total_steps=40)
    decisions = train(model, opt, eg, batches(40, seed=4))
    frozen_order = [name for d in decisions for name in d.modules]
    assert frozen_order == eg.modules[: eg.partition.freezable]
    assert decisions[0].step == 20


def test_a_users_own_policy_object():
    class EveryTenSteps:
        name = "every-ten"

        def bind(self, binding):
            self.bound = binding.partition.names == eg.modules

        def target(self, info):
            return info.step // 10

        def unbind(self):
            self.bound = False

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy = EveryTenSteps()
    eg = egeria.Egeria(model, opt, policy=policy)
    train(model, opt, eg, batches(20, seed=6))
    assert policy.bound and eg.frozen == eg.modules[:2]
    eg.close()
    assert not policy.bound


class _ProtocolOnly:
    """A policy with the FreezePolicy methods and nothing else."""

    name = "protocol-only"

    def bind(self, binding):
        pass

    def target(self, info):
        return None

    def unbind(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class _Capped(_ProtocolOnly):
    capped_by_config = True


class _NamedMoves(_ProtocolOnly):
    """Freezes the first module at step 3, naming it ``named``."""

    name = "named-moves"

    def __init__(self, named):
        self.named = named

    def target(self, info):
        return egeria.policies.Move(1, "named", modules=self.named) if info.step == 3 else None


def test_a_move_that_names_its_modules_is_recorded_with_those_names():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, policy=_NamedMoves(("stem.0",)))
    decisions = train(model, opt, eg, batches(4, seed=6))
    assert [(d.step, d.action, d.modules) for d in decisions if d.action == "freeze"] == [(3, "freeze", ("stem.0",))]
    assert eg.frozen == ["stem.0"]


def test_a_move_whose_names_differ_from_what_its_count_adds_changes_nothing(caplog):
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, policy=_NamedMoves(("blocks.0",)))
    with caplog.at_level("WARNING", logger="egeria.engine"):
        decisions = train(model, opt, eg, batches(4, seed=6))
    assert eg.frozen == [] and not [d for d in decisions if d.action == "freeze"]
    assert "named-moves named ['blocks.0'] to freeze, but a move to 1 frozen modules from 0 adds ['stem.0']" in caplog.text
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("policy, freezable", [(_ProtocolOnly, 6), (_Capped, 3)])
def test_the_engine_asks_a_policy_object_what_it_offers_and_takes_defaults_for_the_rest(policy, freezable):
    # Chain's first three layer modules hold 32% of its weight computation (see below);
    # the cap applies to a policy object only where it says so (Egeria's own says so).
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, policy=policy(), config=egeria.EgeriaConfig(max_frozen_flops=0.4))
    train(model, opt, eg, batches(2))
    assert eg.partition.freezable == freezable
    assert (eg.stage, eg.window, eg.eval_interval, eg.controller_stats, eg.history) == ("guided", None, None, {}, [])
    eg.close()


def test_policy_resume_equals_uninterrupted_run():
    data = batches(3, seed=7) * 12

    def fresh():
        torch.manual_seed(0)
        model = Chain()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        config = egeria.EgeriaConfig(policy="autofreeze", policy_options={"interval": 3, "percentile": 50})
        return model, opt, egeria.Egeria(model, opt, config=config)

    model, opt, eg = fresh()
    first = train(model, opt, eg, data[:13])
    saved = checkpointed(model, opt, eg)
    rest = train(model, opt, eg, data[13:])
    assert first and rest, "the test needs decisions before and after the checkpoint"
    model2, opt2, eg2 = fresh()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    eg2.load_state_dict(saved[2])
    assert train(model2, opt2, eg2, data[13:]) == rest


def test_bad_policy_choices_are_clear_errors():
    with pytest.raises(ValueError, match=r"EgeriaConfig\.policy='freezeotu'"):
        egeria.EgeriaConfig(policy="freezeotu")
    with pytest.raises(ValueError, match="bad options for the 'freezeout' policy"):
        make_policy("freezeout", t_zero=0.5)
    with pytest.raises(ValueError, match="scaling='quartic'"):
        FreezeOut(scaling="quartic")
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not both"):
        egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="none"), policy=NoFreezing())
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(policy="linear"))
    model(torch.randn(4, 8))
    with pytest.raises(ValueError, match="pass total_steps"):
        idle_step(opt, eg)


@pytest.mark.parametrize("policy", ["linear", "egeria"])
def test_max_frozen_flops_caps_the_frozen_prefix_for_every_policy_it_is_given_to(policy):
    from tiny import quick_config

    # Chain's weight computation per sample: stem 8x16, four blocks 16x16 each, head 16x3
    # (1,200 multiply-adds): the stem's linear layer, its norm and dropout (none) and the
    # first block hold 32% of it, with the second block 53%.
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    if policy == "linear":
        config = egeria.EgeriaConfig(policy="linear", policy_options={"start": 0.1}, max_frozen_flops=0.4)
        eg = egeria.Egeria(model, opt, config=config, total_steps=60)
    else:
        eg = egeria.Egeria(model, opt, config=quick_config(window=3, rule="egeria", max_frozen_flops=0.4))
    decisions = train(model, opt, eg, batches(1) * 60)
    assert eg.frozen[:3] == eg.modules[:3] == ["stem.0", "stem.1..stem.2", "blocks.0"]
    if policy == "linear":
        assert eg.frozen == eg.modules[:3] and eg.partition.freezable == 3
    else:
        # Egeria's rule: the cap bounds what freezes while it moves; past it, only a module
        # at its floor (quiet) freezes (record 041)
        assert eg.partition.cap == 3 and eg.partition.freezable == len(eg.modules) - 1
        past = [d for d in decisions if d.action == "freeze" and d.modules[0] in eg.modules[3:]]
        assert all("reference's own error" in d.reason for d in past)
    with pytest.raises(ValueError, match="max_frozen_flops=0"):
        egeria.EgeriaConfig(max_frozen_flops=0)
