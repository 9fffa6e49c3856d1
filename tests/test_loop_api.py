"""What Egeria takes from the training loop: optimizer steps (not calls), the loss from
the model's output, decisions as they happen, a schedule given late."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import egeria
from tiny import Chain, batches, quick_config, train


def _linear_policy(model, opt, total_steps, **kw):
    config = egeria.EgeriaConfig(policy="linear", policy_options={"start": 0.5})
    return egeria.Egeria(model, opt, config=config, total_steps=total_steps, **kw)


def test_gradient_accumulation_counts_optimizer_steps_not_micro_batches():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    eg = _linear_policy(model, opt, total_steps=10)  # 10 optimizer steps of 3 micro-batches
    seen = []
    for i, (x, y) in enumerate(batches(30)):
        (F.cross_entropy(model(x), y) / 3).backward()
        if i % 3 == 2:
            opt.step()
            opt.zero_grad()
        seen.extend(eg.step())  # a framework's per-batch callback: every micro-batch
    assert eg.steps == 10
    assert [d.step for d in seen if d.action == "freeze"] and all(d.step <= 10 for d in seen)
    assert eg.frozen == eg.modules[: eg.partition.freezable]  # the schedule ran to its end


def test_a_step_the_grad_scaler_skips_is_not_counted():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    eg = egeria.Egeria(model, opt, config=quick_config())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for i, (x, y) in enumerate(batches(4)):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss * (float("inf") if i == 1 else 1.0)).backward()  # step 2 overflows
        scaler.step(opt)
        scaler.update()
        eg.step(loss)
    assert eg.steps == 3


def test_two_optimizer_steps_between_calls_are_a_clear_error():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    eg = egeria.Egeria(model, opt, config=quick_config())
    model(torch.randn(4, 8))
    opt.step()
    opt.step()
    with pytest.raises(ValueError, match="stepped 2 times since the last Egeria.step"):
        eg.step(torch.tensor(1.0))


class _Output(dict):
    """A Hugging Face-style output: a mapping whose fields are also attributes."""

    __getattr__ = dict.__getitem__


class _WithLoss(Chain):
    def forward(self, x, labels=None):
        logits = super().forward(x)
        return _Output(logits=logits, loss=F.cross_entropy(logits, labels))


@pytest.mark.parametrize("wrap", [_Output, dict])
def test_the_loss_comes_from_the_models_output_when_step_gets_none(wrap):
    model = _WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    eg = egeria.Egeria(model, opt, config=quick_config(eval_interval=2))
    for x, y in batches(1) * 6:
        out = model(x, labels=y)
        out = wrap(out)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        eg.step()  # no loss given: the output's is used
    assert eg.stage == "guided"  # bootstrapping ended on the recorded losses


def test_on_change_gets_every_decision_as_it_is_applied():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    got = []
    eg = _linear_policy(model, opt, total_steps=10, on_change=lambda d: got.append((eg.steps, d)))
    train(model, opt, eg, batches(10))
    assert [d for _, d in got] == eg.events and got
    assert all(step == d.step for step, d in got)  # called inside the step that applies it
    with pytest.raises(ValueError, match="on_change must be callable"):
        egeria.Egeria(model, opt, config=quick_config(), on_change="print")


def test_close_removes_the_optimizer_hook():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    eg = egeria.Egeria(model, opt, config=quick_config())
    assert len(opt._optimizer_step_post_hooks) == 1
    eg.close()
    assert len(opt._optimizer_step_post_hooks) == 0


def test_an_optimizer_without_step_hooks_counts_every_call():
    class Plain:  # duck-typed: param_groups and step(), no hooks
        def __init__(self, params):
            self.param_groups = [{"params": list(params), "lr": 0.01}]

        def step(self):
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-0.01)

    model: nn.Module = Chain()
    opt = Plain(model.parameters())
    eg = egeria.Egeria(model, opt, config=quick_config())
    for x, y in batches(3):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        eg.step()
    assert eg.steps == 3


def test_wrappers_are_seen_through_or_refused_with_the_fix():
    from egeria.wrappers import unwrap

    model = Chain()
    compiled = torch.compile(model, backend="eager")
    assert unwrap(compiled) == (model, [compiled])
    with pytest.raises(ValueError, match="use DistributedDataParallel"):
        unwrap(nn.DataParallel(model))
    # FSDP1 is refused and FSDP2 seen through: tests/test_fsdp.py


def test_egeria_on_a_compiled_model_hooks_the_module_inside():
    model = Chain()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    eg = egeria.Egeria(compiled, opt, config=egeria.EgeriaConfig(policy="static", policy_options={"count": 2, "at_step": 2}))
    train(compiled, opt, eg, batches(4))  # the loop calls the compiled model
    assert eg.wrapper is compiled and eg.model is model
    assert eg.frozen == eg.modules[:2]
    assert not any(p.requires_grad for p in model.stem.parameters())


def test_a_frameworks_optimizer_wrapper_is_seen_through():
    class Wrapped(torch.optim.Optimizer):  # as accelerate's AcceleratedOptimizer: no Optimizer.__init__
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

        def step(self, closure=None):
            return self.optimizer.step(closure)

    model = Chain()
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    eg = egeria.Egeria(model, Wrapped(inner), config=quick_config())
    assert eg.optimizer is inner
    for x, y in batches(3):
        F.cross_entropy(model(x), y).backward()
        Wrapped(inner).step()
        eg.step()
    assert eg.steps == 3


def test_the_output_losses_of_a_steps_micro_batches_are_averaged():
    model = _WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    got = []
    eg = egeria.Egeria(model, opt, config=quick_config(eval_interval=2))
    eg.policy._record_loss = lambda loss: got.append(float(loss))  # what bootstrapping is fed
    losses = []
    for i, (x, y) in enumerate(batches(4)):
        loss = model(x, labels=y)["loss"]
        losses.append(float(loss.detach()))
        (loss / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
        eg.step()
    assert got == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2])


class _Task(nn.Module):
    """A framework's training object: called with (batch, index) as Lightning's DDP calls
    a LightningModule; its network inside gets the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Chain()

    def forward(self, batch, index):
        x, y = batch
        return {"loss": F.cross_entropy(self.net(x), y)}


def test_module_picks_the_part_to_hook_and_freeze_inside_the_object_the_loop_calls():
    task = _Task()
    opt = torch.optim.SGD(task.parameters(), lr=1e-3)
    eg = egeria.Egeria(task, opt, config=quick_config(), module=task.net)
    assert eg.wrapper is task and eg.model is task.net
    for i, batch in enumerate(batches(1) * 60):
        loss = task(batch, i)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        eg.step(loss)
        if eg.frozen:
            break
    # The network's blocks, named inside it; the controller ran it on x and froze the front.
    assert eg.modules[0] == "stem.0" and eg.modules[-1] == "head"
    assert eg.frozen == ["stem.0"]
    assert not any(p.requires_grad for p in task.net.stem[0].parameters())
    assert all(p.requires_grad for p in task.net.blocks.parameters())
    with pytest.raises(ValueError, match="is not a submodule of the model"):
        egeria.Egeria(task, opt, config=quick_config(), module=Chain())
