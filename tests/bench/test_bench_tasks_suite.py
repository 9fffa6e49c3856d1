"""Issue 28's suite tasks: the warm-up + cosine factor, the crop + flip augmentation, the VGG
model, and the ``vgg-fmnist`` and ``transformer-ptb-cosine`` tasks at tiny sizes."""

from __future__ import annotations

import math

import pytest
import torch

from egeria.bench.augment import crop_flip
from egeria.bench.tasks import TASKS, build_task
from egeria.bench.warmup_cosine import warmup_cosine, warmup_cosine_factor
from egeria.models.vgg import vgg
from egeria.partition import partition_model

from needs_data import needs_fmnist, needs_ptb


def test_warmup_cosine_factor_shape():
    warmup, total = 10, 110
    factors = [warmup_cosine_factor(s, warmup, total) for s in range(total + 5)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[warmup - 1] == pytest.approx(1.0)
    assert factors[warmup] == pytest.approx(1.0)
    assert factors[warmup + 50] == pytest.approx(0.5)  # the cosine's midpoint
    assert all(a >= b for a, b in zip(factors[warmup:], factors[warmup + 1 :]))
    assert factors[total - 1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert factors[total:] == [0.0] * 5


def test_warmup_cosine_scheduler_steps_per_optimizer_step():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    sched = warmup_cosine(opt, 4, 20)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert lrs[4] == pytest.approx(0.2)
    assert opt.param_groups[0]["lr"] == 0.0


@pytest.mark.parametrize("warmup, total", [(5, 5), (-1, 10), (2.5, 10), (0, 0), (True, 10)])
def test_warmup_cosine_refuses_bad_sizes(warmup, total):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"warmup=|total="):
        warmup_cosine(opt, warmup, total)


def test_crop_flip_is_a_pure_function_of_the_generator():
    image = torch.arange(2 * 6 * 6, dtype=torch.float32).reshape(2, 6, 6)
    transform = crop_flip(2, fill=-1.0)
    outs = [transform(image, torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(outs[0], outs[1])
    assert all(o.shape == image.shape for o in outs)
    seen = {transform(image, torch.Generator().manual_seed(s)).sum().item() for s in range(40)}
    assert len(seen) > 5  # shifts and flips vary with the seed


def test_crop_flip_shifts_in_the_fill_and_flips():
    image = torch.ones(1, 4, 4)
    transform = crop_flip(1, fill=-3.0)
    outs = [transform(image, torch.Generator().manual_seed(s)) for s in range(50)]
    assert any((o == -3.0).any() for o in outs)  # a shifted crop shows the padding
    assert any(torch.equal(o, image) for o in outs)  # the centred crop
    ramp = torch.arange(4.0).expand(1, 4, 4)
    flipped = [crop_flip(0)(ramp, torch.Generator().manual_seed(s)) for s in range(20)]
    assert any(torch.equal(o, ramp.flip(-1)) for o in flipped) and any(torch.equal(o, ramp) for o in flipped)


@pytest.mark.parametrize("pad", [-1, 1.5, True])
def test_crop_flip_refuses_bad_pad(pad):
    with pytest.raises(ValueError, match="pad="):
        crop_flip(pad)


def test_crop_flip_refuses_a_batch():
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        crop_flip(1)(torch.zeros(2, 1, 4, 4), torch.Generator())


def test_vgg_shapes_and_partition():
    model = vgg()
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    partition = partition_model(model, (torch.randn(2, 1, 28, 28),))
    assert len(partition.modules) >= 4
    assert partition.modules[0].name.startswith("features.0")


@pytest.mark.parametrize(
    "kwargs, words",
    [({"stages": ()}, "at least one stage"), ({"stages": ((8,), ())}, "stage 1"),
     ({"stages": ((8, 0),)}, "positive integers"), ({"num_classes": 0}, "num_classes=0"),
     ({"dropout": 1.0}, "dropout=1.0")],
)
def test_vgg_refusals_name_the_value(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        vgg(**kwargs)


def test_suite_tasks_are_registered():
    assert {"vgg-fmnist", "transformer-ptb-cosine"} <= set(TASKS)


@pytest.mark.slow
@needs_fmnist
def test_vgg_fmnist_is_seeded_and_augments_per_epoch():
    def first_batches(seed):
        task, epochs = build_task("vgg-fmnist", seed=seed, limit=64, eval_limit=10)
        return task, [next(iter(task.batches())) for _ in range(3)]

    task, a = first_batches(0)
    _, b = first_batches(0)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], a[1][0])  # another epoch: another order and variants
    assert isinstance(task.scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert task.metric == "accuracy" and task.higher_is_better
    assert task.optimizer.param_groups[0]["momentum"] == 0.9
    assert 0.0 <= task.evaluate(task.model.eval()) <= 1.0


@pytest.mark.slow
@needs_ptb
def test_transformer_ptb_cosine_schedule_ends_at_zero():
    task, epochs = build_task("transformer-ptb-cosine", seed=0, epochs=2, limit=64, eval_limit=4)
    assert epochs == 2 and task.name == "transformer-ptb-cosine" and not task.higher_is_better
    assert isinstance(task.optimizer, torch.optim.AdamW)
    total = task.steps_per_epoch * epochs
    lrs = []
    for _ in range(total):
        lrs.append(task.optimizer.param_groups[0]["lr"])
        task.optimizer.step()
        task.scheduler.step()
    assert max(lrs) == pytest.approx(1e-3)
    assert task.optimizer.param_groups[0]["lr"] == 0.0
