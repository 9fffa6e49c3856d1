"""The benchmark tasks: real data, CPU-sized, one function each (paper section 6, Table 1).

A task builds the model, optimizer, schedule, training batches and validation metric
for one seed. ``resnet-fmnist`` trains ResNet-20 on Fashion-MNIST with two 10x
learning-rate drops; ``transformer-ptb`` trains a 6-block Transformer LM on Penn Treebank
with an inverse-square-root schedule; ``finetune-mnist`` fine-tunes the ResNet-20 that
``resnet-fmnist`` produced on the 5,000 MNIST digits with a linear decay.

Issue 28's suite adds two tasks trained the way most recipes train today, with linear
warm-up then cosine to 0 as one ``LambdaLR`` stepped per optimizer step
(:mod:`egeria.bench.warmup_cosine`): ``vgg-fmnist``, a 7-convolution VGG-style net
(:mod:`egeria.models.vgg`, no residual connections) on Fashion-MNIST with SGD and
momentum and random crop + flip augmentation (:mod:`egeria.bench.augment` through
:class:`egeria.cache.Augmented`, 4 fixed variants per image, so the activation cache stays
exact); and ``transformer-ptb-cosine``, ``transformer-ptb``'s model and data with AdamW
under warm-up + cosine. The suite's fine-tuning task runs through the Hugging Face
``Trainer`` and lives in :mod:`egeria.bench.hf_finetune`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from .harness import classification_loss

__all__ = ["Task", "TASKS", "baseline_options", "build_task", "task_of_run"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Task:
    """One task instance, ready to train.

    Attributes:
        name: the task's name.
        model, optimizer, scheduler: what trains (scheduler steps once per optimizer step).
        batches: a function returning the training batches of one epoch, in the seeded order.
        steps_per_epoch: optimizer steps per epoch.
        loss: ``loss(model, batch) -> scalar tensor``.
        evaluate: ``evaluate(model) -> metric`` on the validation data (model in eval mode).
        metric: the metric's name; higher_is_better: its direction.
        default_epochs: epochs of the benchmark run.
        policy_options: each baseline policy's options for this task.
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Callable[[], Iterable[Batch]]
    steps_per_epoch: int
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    evaluate: Callable[[nn.Module], float]
    metric: str
    higher_is_better: bool
    default_epochs: int
    policy_options: dict


def build_task(
    name: str,
    *,
    seed: int = 0,
    epochs: int | None = None,
    limit: int | None = None,
    eval_limit: int | None = None,
    init: str | Path | None = None,
) -> tuple[Task, int]:
    """Builds task ``name`` for ``seed``; returns it with the number of epochs to train.

    Args:
        limit: use only the first ``limit`` training samples (quick runs and tests).
        eval_limit: use only the first ``eval_limit`` validation samples.
        init: checkpoint to start from (``finetune-mnist``: the ResNet-20 trained by
            ``resnet-fmnist``).

    Raises:
        ValueError: an unknown task, or a missing checkpoint for fine-tuning.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](seed=seed, epochs=epochs, limit=limit, eval_limit=eval_limit, init=init)


def task_of_run(run: Mapping[str, Any]) -> Task:
    """The task a run file (``egeria bench``'s JSON) trained, rebuilt with its seed, epochs
    and training-set limit, for studies of the run (its model, optimizer and schedule);
    evaluation on one sample, since a study does not evaluate it."""
    task, _ = build_task(run["task"], seed=run["seed"], epochs=run["epochs"], limit=run.get("limit"), eval_limit=1)
    return task


def _loader(dataset, batch_size: int, seed: int) -> Callable[[], Iterable[Batch]]:
    generator = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)
    return lambda: loader


def _accuracy(test: torch.utils.data.TensorDataset) -> Callable[[nn.Module], float]:
    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        x_all, y_all = test.tensors
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in zip(x_all.split(500), y_all.split(500)))
        return correct / len(y_all)

    return evaluate


def _resnet_fmnist(*, seed, epochs, limit, eval_limit, init) -> tuple[Task, int]:
    from ..data import load_fashion_mnist
    from ..models import resnet

    epochs = epochs or 12
    train = load_fashion_mnist(split="train", limit=limit)
    test = load_fashion_mnist(split="test", limit=eval_limit)
    torch.manual_seed(seed)
    model = resnet(depth=20, in_channels=1, num_classes=10)
    if init is not None:
        model.load_state_dict(torch.load(init, map_location="cpu", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    steps = math.ceil(len(train) / 128)
    total = steps * epochs
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [total // 2, total * 3 // 4], gamma=0.1)
    task = Task(
        "resnet-fmnist", model, opt, sched, _loader(train, 128, seed), steps, classification_loss, _accuracy(test),
        "accuracy", True, epochs, baseline_options(steps, epochs),
    )
    return task, epochs


def _transformer_ptb(*, seed, epochs, limit, eval_limit, init) -> tuple[Task, int]:
    warmup = 400

    def inverse_sqrt(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LRScheduler:
        def factor(step: int) -> float:
            step += 1
            return min(step / warmup, math.sqrt(warmup / step))

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    return _ptb_lm("transformer-ptb", inverse_sqrt, seed=seed, epochs=epochs or 8, limit=limit, eval_limit=eval_limit)


def _transformer_ptb_cosine(*, seed, epochs, limit, eval_limit, init) -> tuple[Task, int]:
    from .warmup_cosine import warmup_cosine

    def schedule(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LRScheduler:
        # 400 warm-up steps as transformer-ptb (8% of the suite's 4,980), fewer in a short run.
        return warmup_cosine(opt, min(400, total // 10), total)

    return _ptb_lm("transformer-ptb-cosine", schedule, seed=seed, epochs=epochs or 6, limit=limit, eval_limit=eval_limit)


def _ptb_lm(name, make_schedule, *, seed, epochs, limit, eval_limit) -> tuple[Task, int]:
    """The 6-block Transformer LM on PTB windows of 35 tokens, batch 32, AdamW (peak LR
    1e-3, weight decay 0.01), under ``make_schedule(optimizer, total_steps)``; validation
    perplexity."""
    from ..data import LMWindows, load_ptb
    from ..models import TransformerLM, next_token_loss

    corpus = load_ptb()
    train = LMWindows(corpus.train, 35)
    valid = LMWindows(corpus.valid, 35)
    if limit is not None:
        train = torch.utils.data.Subset(train, range(min(limit, len(train))))
    if eval_limit is not None:
        valid = torch.utils.data.Subset(valid, range(min(eval_limit, len(valid))))
    torch.manual_seed(seed)
    model = TransformerLM(corpus.vocab_size, d_model=128, n_heads=4, n_layers=6, d_ff=512, max_len=64, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    steps = math.ceil(len(train) / 32)
    sched = make_schedule(opt, steps * epochs)

    def lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        tokens, targets = batch
        return next_token_loss(model(tokens), targets)

    @torch.no_grad()
    def perplexity(model: nn.Module) -> float:
        loader = torch.utils.data.DataLoader(valid, batch_size=64)
        total, count = 0.0, 0
        for tokens, targets in loader:
            total += float(next_token_loss(model(tokens), targets, reduction="sum"))
            count += targets.numel()
        return math.exp(total / count)

    task = Task(
        name, model, opt, sched, _loader(train, 32, seed), steps, lm_loss, perplexity,
        "perplexity", False, epochs, baseline_options(steps, epochs),
    )
    return task, epochs


def _vgg_fmnist(*, seed, epochs, limit, eval_limit, init) -> tuple[Task, int]:
    from ..cache import Augmented
    from ..data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist
    from ..models.vgg import vgg
    from .augment import crop_flip
    from .warmup_cosine import warmup_cosine

    epochs = epochs or 10
    train = load_fashion_mnist(split="train", limit=limit)
    test = load_fashion_mnist(split="test", limit=eval_limit)
    # Shifts of up to 2 pixels (the padding black, in normalised units) and left-right flips;
    # 4 fixed variants per image, one drawn per epoch, so the activation cache stays exact.
    black = -FASHION_MNIST_MEAN / FASHION_MNIST_STD
    augmented = Augmented(train, crop_flip(2, fill=black), variants=4, seed=seed)
    torch.manual_seed(seed)
    model = vgg(in_channels=1, num_classes=10)
    if init is not None:
        model.load_state_dict(torch.load(init, map_location="cpu", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    steps = math.ceil(len(train) / 128)
    total = steps * epochs
    sched = warmup_cosine(opt, max(1, total // 20), total)  # 5% warm-up
    task = Task(
        "vgg-fmnist", model, opt, sched, _epoch_loader(augmented, 128, seed), steps, classification_loss,
        _accuracy(test), "accuracy", True, epochs, baseline_options(steps, epochs),
    )
    return task, epochs


def _epoch_loader(dataset, batch_size: int, seed: int) -> Callable[[], Iterable[Batch]]:
    """:func:`_loader` over :class:`egeria.cache.Augmented` data: each call (one per epoch)
    sets the data's epoch (0, 1, ...), which picks each image's variant; a loader wrapped by
    the activation cache once sets the epoch itself on every pass, the same way."""
    loader = _loader(dataset, batch_size, seed)()
    calls = [0]

    def batches() -> Iterable[Batch]:
        dataset.set_epoch(calls[0])
        calls[0] += 1
        return loader

    return batches


def _finetune_mnist(*, seed, epochs, limit, eval_limit, init) -> tuple[Task, int]:
    from ..data import load_mnist5k
    from ..models import resnet

    if init is None or not Path(init).is_file():
        raise ValueError(
            f"finetune-mnist starts from the ResNet-20 trained by resnet-fmnist; checkpoint {init!r} not found "
            "(run `egeria bench resnet-fmnist --policy none` first or pass --init PATH)"
        )
    epochs = epochs or 10
    train = load_mnist5k(split="train", limit=limit)
    test = load_mnist5k(split="test", limit=eval_limit)
    torch.manual_seed(seed)
    model = resnet(depth=20, in_channels=1, num_classes=10)
    model.load_state_dict(torch.load(init, map_location="cpu", weights_only=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    steps = math.ceil(len(train) / 128)
    total = steps * epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    task = Task(
        "finetune-mnist", model, opt, sched, _loader(train, 128, seed), steps, classification_loss, _accuracy(test),
        "accuracy", True, epochs, baseline_options(steps, epochs),
    )
    return task, epochs


def baseline_options(steps_per_epoch: int, epochs: int) -> dict:
    """Each baseline at its published default, scaled to the task's length."""
    return {
        "freezeout": {"t0": 0.8, "scaling": "cubic"},
        "autofreeze": {"interval": max(1, steps_per_epoch // 2), "percentile": 50.0},
        "linear": {"start": 0.5, "final": 1.0},
        "static": {"count": 2, "at_step": steps_per_epoch * max(1, epochs // 2)},
        "smartfrz": {},  # its defaults: 50 stages over the run, windows of 30 samples of 1,024 weights
        "none": {},
    }


TASKS: dict[str, Callable[..., tuple[Task, int]]] = {
    "resnet-fmnist": _resnet_fmnist,
    "transformer-ptb": _transformer_ptb,
    "finetune-mnist": _finetune_mnist,
    "vgg-fmnist": _vgg_fmnist,
    "transformer-ptb-cosine": _transformer_ptb_cosine,
}
