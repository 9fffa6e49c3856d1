"""The shared training harness against hand-written loops: same weights, steps and calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import egeria
import egeria.bench.flops
from egeria.bench.harness import StepResult, classification_loss, train
from tiny import Chain, batches, quick_config
from tiny import train as readme_train

EPOCHS = 3


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


def _milestone(optimizer: torch.optim.Optimizer, step: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.MultiStepLR(optimizer, [step], gamma=0.1)


def _pair(seed: int = 0) -> tuple[Chain, Chain]:
    """Two models with the same initial weights."""
    torch.manual_seed(seed)
    first = Chain(dropout=0.1)
    second = Chain(dropout=0.1)
    second.load_state_dict(first.state_dict())
    return first, second


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def _shuffled(data: list, seed: int):
    """A new order of ``data`` for each epoch, drawn when the epoch starts."""
    order = torch.Generator().manual_seed(seed)

    def epoch() -> list:
        return [data[int(i)] for i in torch.randperm(len(data), generator=order)]

    return epoch


def test_plain_run_matches_a_hand_written_loop_bit_for_bit():
    data = batches(5, seed=3)
    ours, theirs = _pair()

    opt = _sgd(theirs)
    sched = _milestone(opt, 8)
    epoch_batches = _shuffled(data, seed=7)
    torch.manual_seed(11)  # dropout draws from the global generator: same seed in both runs
    expected_losses = []
    for _ in range(EPOCHS):
        theirs.train()
        for x, y in epoch_batches():
            loss = F.cross_entropy(theirs(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            expected_losses.append(loss.item())

    opt = _sgd(ours)
    sched = _milestone(opt, 8)
    torch.manual_seed(11)
    results = train(ours, opt, _shuffled(data, seed=7), classification_loss, epochs=EPOCHS, scheduler=sched)

    _assert_same_weights(ours, theirs)
    assert [r.loss for r in results] == expected_losses
    assert [(r.step, r.epoch) for r in results] == [(i + 1, i // 5 + 1) for i in range(15)]
    assert all(r.decisions == () and r.flops is None for r in results)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # the scheduler stepped once per step


def test_egeria_run_matches_the_readme_loop_with_the_same_decisions():
    data = batches(12, seed=4)
    ours, theirs = _pair(seed=1)
    config = quick_config(policy="static", policy_options={"count": 2, "at_step": 5})

    opt = _sgd(theirs)
    eg = egeria.Egeria(theirs, opt, config=config)
    torch.manual_seed(3)
    expected = readme_train(theirs, opt, eg, data)
    eg.close()

    opt = _sgd(ours)
    eg = egeria.Egeria(ours, opt, config=config)
    torch.manual_seed(3)
    results = train(ours, opt, lambda: data, classification_loss, egeria=eg)
    decisions = [d for r in results for d in r.decisions]
    eg.close()

    assert [d.to_dict() for d in expected] == [d.to_dict() for d in decisions] != []
    assert results[4].decisions == tuple(decisions)  # at the step the decision was made
    _assert_same_weights(ours, theirs)


def test_egeria_steps_once_after_each_optimizer_step():
    model = Chain()
    opt = _sgd(model)
    eg = egeria.Egeria(model, opt, config=quick_config())
    optimizer_steps = []
    opt.register_step_post_hook(lambda *_: optimizer_steps.append(len(optimizer_steps) + 1))
    seen_at = []
    real_step = eg.step

    def spy(loss: torch.Tensor) -> list:
        seen_at.append(len(optimizer_steps))
        return real_step(loss)

    eg.step = spy
    results = train(model, opt, lambda: batches(4, seed=2), classification_loss, epochs=2, egeria=eg)
    eg.close()
    assert seen_at == optimizer_steps == [r.step for r in results] == list(range(1, 9))


def test_callbacks_see_every_step_and_evaluate_runs_in_eval_mode_untimed():
    model = Chain()
    opt = _sgd(model)
    stepped: list[StepResult] = []
    evaluated: list[tuple[int, int, bool]] = []

    def evaluate(result: StepResult) -> None:
        evaluated.append((result.step, result.epoch, model.training))

    results = train(
        model, opt, lambda: batches(5, seed=1), classification_loss, epochs=2,
        on_step=stepped.append, evaluate=evaluate, eval_every=3,
    )
    assert stepped == results and len(results) == 10
    # Every third step, and after the last one; in eval mode, the model back in train mode after.
    assert evaluated == [(3, 1, False), (6, 2, False), (9, 2, False), (10, 2, False)]
    assert model.training
    running = 0.0
    for r in results:
        running += r.time_s
        assert r.train_time_s == running and r.data_s >= 0


def test_evaluation_defaults_to_each_epoch_end():
    model = Chain()
    calls: list[int] = []
    train(model, _sgd(model), lambda: batches(4, seed=1), classification_loss, epochs=3,
          evaluate=lambda r: calls.append(r.step))
    assert calls == [4, 8, 12]


def test_batches_are_asked_for_once_per_epoch():
    model = Chain()
    asked = []

    def epoch_batches():
        asked.append(len(asked) + 1)
        return batches(2, seed=len(asked))

    results = train(model, _sgd(model), epoch_batches, classification_loss, epochs=3)
    assert asked == [1, 2, 3] and len(results) == 6


def test_flops_counted_on_the_first_step_and_after_each_freeze_without_changing_numerics(monkeypatch):
    data = batches(6, seed=5)
    config = quick_config(policy="static", policy_options={"count": 2, "at_step": 3})
    ours, theirs = _pair(seed=2)

    opt = _sgd(theirs)
    eg = egeria.Egeria(theirs, opt, config=config)
    torch.manual_seed(0)
    train(theirs, opt, lambda: data, classification_loss, egeria=eg)
    eg.close()

    counted = []
    real = egeria.bench.flops.count_flops
    monkeypatch.setattr(egeria.bench.flops, "count_flops", lambda fn: counted.append(1) or real(fn))
    opt = _sgd(ours)
    eg = egeria.Egeria(ours, opt, config=config)
    torch.manual_seed(0)
    results = train(ours, opt, lambda: data, classification_loss, egeria=eg, count_flops=True)
    eg.close()

    _assert_same_weights(ours, theirs)
    assert len(counted) == 2  # step 1, and step 4 (the first after the freeze at step 3)
    flops = [r.flops for r in results]
    assert flops[:3] == [flops[0]] * 3 and flops[3:] == [flops[3]] * 3
    assert 0 < flops[3] < flops[0]


@pytest.mark.parametrize("field, value", [("epochs", 0), ("epochs", 1.5), ("eval_every", 0), ("eval_every", True)])
def test_bad_arguments_name_the_value(field: str, value: object):
    model = Chain()
    with pytest.raises(ValueError, match=rf"train {field}={value!r} must be"):
        train(model, _sgd(model), lambda: batches(1), classification_loss, **{field: value})
