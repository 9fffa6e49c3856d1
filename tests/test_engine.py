from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from torch import nn

import egeria
import egeria.checkpoint.serialization
from egeria.checkpoint.saved_state import sealed, without_policy_state
from tiny import Chain, batches, checkpointed, idle_step, quick_config, tiny_cnn, train


def make(model_fn=Chain, lr=1e-4, optimizer="sgd", unfreeze_rule=None, **config):
    model = model_fn()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    eg = egeria.Egeria(model, opt, config=quick_config(**config), unfreeze_rule=unfreeze_rule)
    return model, opt, eg


def train_until_frozen(model, opt, eg, data, count=1):
    for i, (x, y) in enumerate(data):
        train(model, opt, eg, [(x, y)])
        if len(eg.frozen) >= count:
            return i
    raise AssertionError(f"nothing froze in {len(data)} steps; history: {eg.history[-3:]}")


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_front_module_freezes_first_and_frozen_is_a_prefix(mode):
    model, opt, eg = make(activation_mode=mode)
    data = batches(1) * 120
    decisions = train(model, opt, eg, data)
    freezes = [d for d in decisions if d.action == "freeze"]
    assert len(freezes) >= 2
    assert [d.modules[0] for d in freezes] == eg.modules[: len(freezes)]
    assert eg.frozen == eg.modules[: len(eg.frozen)]
    assert eg.stage == "guided"
    assert eg.modules[-1] not in eg.frozen


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_frozen_weights_stay_bit_identical(optimizer):
    model, opt, eg = make(optimizer=optimizer)
    data = batches(1) * 100
    train_until_frozen(model, opt, eg, data)
    frozen_params = [n for n in eg.partition.modules[0].params]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for group in opt.param_groups:  # a large rate, so anything not frozen visibly moves
        group["lr"] = 0.5 if optimizer == "sgd" else 0.05
    train(model, opt, eg, batches(8, seed=3))
    assert eg.frozen  # a raise of the rate does not unfreeze
    for name, p in model.named_parameters():
        if name in frozen_params:
            assert torch.equal(p, before[name]), name
            assert p.grad is None and not p.requires_grad
        else:
            assert not torch.equal(p, before[name]), name
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))  # groups untouched


def test_evaluation_forward_leaves_training_flags_and_batchnorm_stats_alone():
    model, opt, eg = make(model_fn=lambda: Chain(dropout=0.5))
    model.blocks[3].eval()  # a user's own choice, which Egeria must keep
    data = batches(1)
    train(model, opt, eg, data * 3)  # guided from step 2: evaluation forwards at each step
    flags = {name: m.training for name, m in model.named_modules()}
    stats = model.stem[1].running_mean.clone()
    model(data[0][0])  # the armed forward of the next step
    after_forward = model.stem[1].running_mean.clone()
    eg.step(torch.tensor(1.0))  # the controller's eval-mode front forward runs on its copy
    assert {name: m.training for name, m in model.named_modules()} == flags
    assert torch.equal(model.stem[1].running_mean, after_forward)
    assert not torch.equal(after_forward, stats)  # the training forward itself did update them


def test_batchnorm_and_dropout_stay_in_eval_mode_through_model_train():
    model, opt, eg = make(model_fn=lambda: Chain(dropout=0.5))
    model(torch.randn(4, 8))
    holding_bn = next(i for i, m in enumerate(eg.partition.modules) if "stem.1" in m.blocks)
    assert "stem.2" in eg.partition.modules[holding_bn].blocks
    train_until_frozen(model, opt, eg, batches(1) * 200, count=holding_bn + 1)
    stem_bn, stem_drop = model.stem[1], model.stem[2]
    stats = stem_bn.running_mean.clone()
    model.train()
    x = torch.randn(16, 8)
    out_a, out_b = model.stem(x), model.stem(x)
    assert not stem_bn.training and not stem_drop.training
    assert torch.equal(out_a, out_b)  # no dropout noise
    assert torch.equal(stem_bn.running_mean, stats)  # running stats did not move
    eg.close()
    model.train()
    assert stem_bn.training and stem_drop.training


@pytest.mark.parametrize("rule", ["paper", "egeria"])
def test_lr_drop_unfreezes_all_then_the_rule_refreezes(rule):
    # The paper's rule unfreezes at a 10x drop; Egeria's never does unless told to.
    model, opt, eg = make(window=4, rule=rule, unfreeze_rule=egeria.LRDropRule(10.0) if rule == "egeria" else None)
    data = batches(1) * 200
    train_until_frozen(model, opt, eg, data)
    frozen_names = list(eg.frozen)
    for group in opt.param_groups:
        group["lr"] = group["lr"] * 0.1  # 1e-4 * 0.1 is not exactly 1e-5: the rule must still fire
    [decision] = idle_step(opt, eg)
    assert decision.action == "unfreeze"
    assert list(decision.modules) == frozen_names
    assert eg.frozen == []
    if rule == "paper":  # W halved, watching again at once
        assert eg.window == 2 and eg.stage == "guided"
    else:  # W kept, the loss must settle at the new rate first
        assert eg.window == 4 and eg.stage == "bootstrap"
    assert all(p.requires_grad for p in model.parameters())
    assert model.stem[1].training is model.training
    train_until_frozen(model, opt, eg, data)


def test_smaller_lr_drop_does_not_unfreeze():
    model, opt, eg = make()
    train_until_frozen(model, opt, eg, batches(1) * 100)
    for group in opt.param_groups:
        group["lr"] *= 0.2
    steps = eg.steps
    assert idle_step(opt, eg) == []
    assert eg.frozen and eg.steps == steps + 1


def test_user_unfreeze_rule_replaces_the_lr_rule():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    calls = []

    def every_fifth_step(ctx: egeria.UnfreezeContext) -> bool:
        calls.append(ctx)
        return ctx.step - ctx.freeze_step >= 5

    eg = egeria.Egeria(model, opt, config=quick_config(), unfreeze_rule=every_fifth_step)
    data = batches(1) * 100
    train_until_frozen(model, opt, eg, data)
    decisions = train(model, opt, eg, batches(1) * 5)
    assert [d.action for d in decisions][-1] == "unfreeze"
    assert calls and calls[-1].frozen


def _seeded(model_fn, **config):
    """Seed 0's model, SGD (lr 1e-3, momentum 0.9) and Egeria with ``quick_config(**config)``:
    the same start for a run and its resumed twin."""
    torch.manual_seed(0)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return model, opt, egeria.Egeria(model, opt, config=quick_config(**config))


@pytest.mark.parametrize(
    "model_fn,data,mode,split",
    [
        (Chain, batches(2) * 40, "eval", 30),
        (Chain, batches(2) * 40, "train", 15),
        (tiny_cnn, batches(12, image=True) * 4, "train", 22),
        (tiny_cnn, batches(12, image=True) * 4, "eval", 15),  # mid-watch: reference and readings restored
    ],
    ids=["mlp-dynamic-int8-eval", "mlp-dynamic-int8-train", "cnn-static-int8-train", "cnn-static-int8-eval"],
)
def test_resume_mid_run_equals_uninterrupted_run(model_fn, data, mode, split):
    def fresh():
        return _seeded(model_fn, window=4, activation_mode=mode)

    model, opt, eg = fresh()
    first = train(model, opt, eg, data[:split])
    saved = checkpointed(model, opt, eg)
    rest = train(model, opt, eg, data[split:])
    assert eg.history and rest, "the test needs readings before and decisions after the checkpoint"

    model2, opt2, eg2 = fresh()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    eg2.load_state_dict(saved[2])
    assert eg2.frozen == [d.modules[0] for d in first]
    assert not any(p.requires_grad for n in eg2.frozen for p in _params_of(model2, eg2, n))
    rest2 = train(model2, opt2, eg2, data[split:])
    assert rest2 == rest
    assert eg2.history == eg.history
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("split,decays", [(20, [30, 50]), (45, [30, 50]), (45, [])], ids=["before", "between", "constant"])
def test_resume_under_egerias_criterion_equals_uninterrupted_run(split, decays):
    """The outlooks, the mass at the reference's refresh and the schedule read from the
    scheduler (or the optimizer's constant learning rate) go through a checkpoint: a run
    resumed before the first freeze, or between the decays, decides and reads as the
    uninterrupted one, from its first reading on. Resumed between the decays, the schedule
    read from the scheduler's position on peaks at the rate there, 1/10 of the run's: the
    rule's own peak, checkpointed, keeps the learning-rate bound where it was."""
    def fresh():
        torch.manual_seed(0)
        model = Chain()
        # a rate at which the weights move measurably (at 1e-4 only batch norm's running
        # statistics did, and readings hold those: record 040)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=decays, gamma=0.1) if decays else None
        config = quick_config(rule="egeria", horizon=0.05, floor_ratio=0, eval_interval=2)
        return model, opt, sched, egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=70)

    data = batches(1) * 70
    model, opt, sched, eg = fresh()
    train(model, opt, eg, data[:split], scheduler=sched)
    saved = (*checkpointed(model, opt, eg), copy.deepcopy(sched.state_dict()) if sched else None)
    rest = train(model, opt, eg, data[split:], scheduler=sched)
    if decays:
        assert rest and all(d.step > split for d in rest), "the test needs a freeze after the checkpoint"
    else:  # a constant rate never comes down to the bound: only the idle stem (record 032) freezes
        assert all("of the most active watched module's" in d.reason for d in rest)
        assert any(row["step"] > split for row in eg.history)
    assert all(row["mass"] is not None for row in eg.history if row["step"] > split)

    model2, opt2, sched2, eg2 = fresh()
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    eg2.load_state_dict(saved[2])
    if sched2 is not None:
        sched2.load_state_dict(saved[3])
    assert train(model2, opt2, eg2, data[split:], scheduler=sched2) == rest
    assert eg2.history == eg.history
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    eg.close()
    eg2.close()


def _params_of(model, eg, module_name):
    module = next(m for m in eg.partition.modules if m.name == module_name)
    named = dict(model.named_parameters())
    return [named[p] for p in module.params]


# -- bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("eval_interval", 0),
        ("window", -1),
        ("window", 2.5),
        ("cost_budget", 0.0),
        ("cost_budget", float("nan")),
        ("reference_precision", "int4"),
        ("modules", 42),
        ("modules", ["head"]),
        ("modules", "("),
        ("max_modules", 1),
        ("executor", "gpu"),
        ("start_method", "clone"),
        ("cpu_threshold", 1.5),
        ("speed", "turbo"),
        ("horizon", 0.0),
        ("horizon", float("nan")),
        ("floor_ratio", -1.0),
        ("floor_ratio", float("inf")),
    ],
)
def test_invalid_config_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"EgeriaConfig\.{field}="):
        egeria.EgeriaConfig(**{field: value})


def test_optimizer_without_model_parameters_is_rejected():
    model = Chain()
    other = torch.optim.SGD(Chain().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds none of the model's parameters"):
        egeria.Egeria(model, other, total_steps=100)


def test_single_module_model_is_rejected():
    model = nn.Sequential(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="single layer module"):
        egeria.Egeria(model, opt, total_steps=100)


def test_eval_interval_none_needs_total_steps_by_the_first_step_under_the_papers_rule():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a framework may learn the length only when training starts
    eg = egeria.Egeria(model, opt, config=egeria.EgeriaConfig(rule="paper"))
    model(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"set_schedule\(total_steps=...\)"):
        idle_step(opt, eg)
    with pytest.raises(ValueError, match="total_steps=0 must be a positive integer"):
        eg.set_schedule(total_steps=0)
    eg.set_schedule(total_steps=78_000)
    idle_step(opt, eg)
    assert eg.eval_interval == 318 and eg.steps == 1
    with pytest.raises(RuntimeError, match="before the first step"):
        eg.set_schedule(total_steps=1000)


def test_step_before_any_forward_pass_is_a_clear_error():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eg = egeria.Egeria(model, opt, total_steps=100)
    with pytest.raises(RuntimeError, match="first forward pass"):
        idle_step(opt, eg)


def test_non_finite_losses_are_logged_and_ignored(caplog):
    model, opt, eg = make(eval_interval=2, bootstrap_change_rate=0.10)
    model(torch.randn(4, 8))
    for loss in (2.0, 2.0):  # first interval: mean 2.0
        idle_step(opt, eg, loss)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        # Second interval: counted as is, its mean (nan) or (2.0 + inf) would not settle the
        # loss; ignoring the non-finite values leaves 2.0, which ends bootstrapping.
        idle_step(opt, eg, float("nan"))
        idle_step(opt, eg, 2.0)
    assert "non-finite" in caplog.text
    assert eg.stage == "guided"


def test_bad_loss_is_rejected_without_counting_a_step():
    model, opt, eg = make()
    model(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        eg.step(torch.ones(2))
    with pytest.raises(ValueError, match="got str"):
        eg.step("0.5")
    assert eg.steps == 0


def test_example_inputs_must_be_a_tuple():
    model = Chain()
    with pytest.raises(ValueError, match=r"example_inputs=\(x,\)"):
        egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=10, example_inputs=torch.randn(2, 8))


def test_a_model_that_cannot_be_split_trains_on_and_step_says_why():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eg = egeria.Egeria(model, opt, config=quick_config(modules=r"head"))
    model(torch.randn(4, 8))  # the user's forward pass is not broken
    with pytest.raises(ValueError, match="single layer module"):
        idle_step(opt, eg)


def test_a_forward_that_catches_exceptions_cannot_swallow_the_early_stop():
    class Forgiving(Chain):
        def forward(self, x):
            h = self.stem(x)
            for block in self.blocks:
                try:
                    h = block(h)
                except Exception:  # noqa: BLE001 - what some user models do
                    pass
            return self.head(h)

    model = Forgiving()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    eg = egeria.Egeria(model, opt, config=quick_config())
    train(model, opt, eg, batches(1) * 12)
    assert eg.history and all(r["module"] == eg.modules[0] for r in eg.history[:3])


def test_eval_interval_follows_the_papers_guideline():
    model = Chain(depth=4)
    eg = egeria.Egeria(
        model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=78_000, example_inputs=(torch.randn(2, 8),),
        config=egeria.EgeriaConfig(rule="paper"),
    )
    assert len(eg.modules) == 7
    assert eg.eval_interval == 318  # 78,000 / (2 * 10) / 7 / 1.75 = 318.4


def test_under_egerias_rule_n_is_min_eval_interval_whatever_the_length_and_needs_no_total_steps():
    model = Chain(depth=4)
    for total in (None, 600, 78_000):
        eg = egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=total,
                           example_inputs=(torch.randn(2, 8),))
        assert eg.eval_interval == 20 and eg.window == 3
        eg.close()
    eg = egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.randn(4, 8))
    idle_step(eg.optimizer, eg)  # no set_schedule needed
    assert eg.steps == 1
    eg.close()


def test_close_removes_every_hook_and_unfreezes():
    model, opt, eg = make()
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    train_until_frozen(model, opt, eg, batches(1) * 100)
    eg.close()
    hooks_after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert hooks_after == 0 and hooks_before > 0
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match="closed"):
        eg.step(torch.tensor(1.0))


def test_close_keeping_modules_frozen_still_removes_every_hook():
    model, opt, eg = make()
    train_until_frozen(model, opt, eg, batches(1) * 100)
    frozen = [p for n in eg.frozen for p in _params_of(model, eg, n)]
    eg.close(unfreeze=False)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert frozen and not any(p.requires_grad for p in frozen)


def test_derived_eval_interval_has_a_floor_and_an_explicit_one_is_kept(monkeypatch):
    model = Chain(depth=4)
    short = egeria.Egeria(
        model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=1_400, example_inputs=(torch.randn(2, 8),),
        config=egeria.EgeriaConfig(rule="paper"),
    )
    assert len(short.modules) == 7  # the guideline: 1,400 / (2 * 10) / 7 / 1.75 = 5.7
    assert short.eval_interval == 20  # MIN_EVAL_INTERVAL
    short.close()
    monkeypatch.setattr(egeria.knowledge.policy, "MIN_EVAL_INTERVAL", 3)
    floor = egeria.Egeria(
        model, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=1_400,
        config=egeria.EgeriaConfig(rule="paper"), example_inputs=(torch.randn(2, 8),),
    )
    assert floor.eval_interval == 5
    floor.close()
    explicit = egeria.Egeria(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=egeria.EgeriaConfig(rule="paper", eval_interval=2),
        example_inputs=(torch.randn(2, 8),),
    )
    assert explicit.eval_interval == 2


def test_state_dict_after_close_is_refused():
    model, opt, eg = make()
    train(model, opt, eg, batches(2))
    eg.close()
    with pytest.raises(RuntimeError, match="closed"):
        eg.state_dict()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0


def test_ctrl_c_during_an_inline_reading_reaches_the_user():
    class Interrupted(Chain):
        def forward(self, x):
            if not self.training:  # only the controller's eval-mode front runs this way
                raise KeyboardInterrupt
            return super().forward(x)

    model = Interrupted()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    eg = egeria.Egeria(model, opt, config=quick_config())
    with pytest.raises(KeyboardInterrupt):
        train(model, opt, eg, batches(1) * 20)
    eg.close()


def test_a_checkpoint_without_a_controller_state_resumes_without_hanging():
    # Saved after an unfreeze (generation > 0) by a run whose controller had failed.
    model, opt, eg = make(window=4)
    data = batches(1) * 200
    train_until_frozen(model, opt, eg, data)
    for group in opt.param_groups:
        group["lr"] *= 0.1
    train(model, opt, eg, data[:2])  # unfreezes: a new generation
    state = json.loads(json.dumps(eg.state_dict()))
    assert state["policy_state"]["link"]["generation"] > 0
    state["policy_state"]["link"]["controller"] = None
    state = sealed(state)  # as that run would have saved it
    eg.close()
    again = egeria.Egeria(model, opt, config=quick_config(window=4), example_inputs=(torch.randn(4, 8),))
    again.load_state_dict(state)
    before = len(again.history)
    train(model, opt, again, data[:10])
    assert len(again.history) > before and again.controller_stats["failure"] is None
    again.close()


def test_save_and_load_a_checkpoint_folder_with_tensors_resumes_exactly(tmp_path, monkeypatch):
    data = batches(2) * 40

    def fresh():
        # read every other step: saved after an odd step, the reference (refreshed at the
        # reading before) differs from the live weights, so the state carries its tensors
        return _seeded(Chain, window=4, eval_interval=2)

    model, opt, eg = fresh()
    train(model, opt, eg, data[:31])
    eg.save(tmp_path / "ckpt")
    weights, opt_state = {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict())
    rest = train(model, opt, eg, data[31:])
    assert rest

    meta = json.loads((tmp_path / "ckpt" / "egeria.json").read_text())
    tensors = torch.load(tmp_path / "ckpt" / meta["tensors_file"], weights_only=True)
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert '"data"' not in json.dumps(meta)  # no base64 tensors left in the JSON

    model2, opt2, eg2 = fresh()
    model2.load_state_dict(weights)
    opt2.load_state_dict(opt_state)
    eg2.load(tmp_path / "ckpt")
    assert train(model2, opt2, eg2, data[31:]) == rest and eg2.history == eg.history

    # A save that fails at either file keeps the previous checkpoint whole and loadable
    # (the JSON commits it last); a later save replaces both; bad folders are clear errors.
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    real_save, real_write = torch.save, egeria.checkpoint.serialization._atomic_write
    full = OSError(28, "No space left on device")
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(full))
    with pytest.raises(OSError, match="No space left"):
        eg2.save(tmp_path / "ckpt")
    monkeypatch.setattr(torch, "save", real_save)

    def json_fails(path, write):
        if path.name == "egeria.json":
            raise full
        real_write(path, write)

    monkeypatch.setattr(egeria.checkpoint.serialization, "_atomic_write", json_fails)
    with pytest.raises(OSError, match="No space left"):
        eg2.save(tmp_path / "ckpt")
    monkeypatch.setattr(egeria.checkpoint.serialization, "_atomic_write", real_write)
    kept = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    assert kept == before  # the uncommitted tensor file went with the failed save
    _, _, eg4 = fresh()
    eg4.load(tmp_path / "ckpt")
    assert eg4.steps == 31
    eg2.save(tmp_path / "ckpt")
    assert len(list((tmp_path / "ckpt").glob("egeria-*.pt"))) == 1
    with pytest.raises(FileNotFoundError, match="missing egeria.json"):
        eg2.load(tmp_path / "nothing")
    [tensor_file] = (tmp_path / "ckpt").glob("egeria-*.pt")
    tensor_file.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="cannot be read"):
        eg2.load(tmp_path / "ckpt")


def test_a_refused_state_changes_nothing_and_the_schedule_can_follow_a_load():
    model, opt, eg = make()
    train_until_frozen(model, opt, eg, batches(1) * 100)
    steps, frozen = eg.steps, list(eg.frozen)
    state = json.loads(json.dumps(eg.state_dict()))
    assert state["total_steps"] is None
    with pytest.raises(ValueError, match="rank other than 0"):
        eg.load_state_dict(without_policy_state(state))  # what a rank other than 0 saves
    assert (eg.steps, eg.frozen) == (steps, frozen)  # checked before anything was touched

    # A fresh Egeria that loads a state may still be given the run's length, and a saved
    # length comes back when none is given.
    torch.manual_seed(0)
    model2 = Chain()
    opt2 = torch.optim.SGD(model2.parameters(), lr=1e-4)
    eg2 = egeria.Egeria(model2, opt2, config=quick_config(), example_inputs=(torch.randn(2, 8),))
    eg2.load_state_dict(state)
    eg2.set_schedule(total_steps=500)
    assert eg2.total_steps == 500
    eg3 = egeria.Egeria(model2, opt2, config=quick_config(), example_inputs=(torch.randn(2, 8),))
    edited = {k: v for k, v in state.items() if k != "digest"}  # edited by hand: no digest, checked by field
    eg3.load_state_dict({**edited, "total_steps": 300})
    with pytest.raises(ValueError, match="state.digest .* changed or damaged"):
        eg3.load_state_dict({**state, "total_steps": 300})
    assert eg3.total_steps == 300
