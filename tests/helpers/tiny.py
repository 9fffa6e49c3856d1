"""Small deterministic models and a training loop for Egeria's tests (not a test file)."""

from __future__ import annotations

import copy
import json

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import egeria
from egeria.models import resnet
from egeria.policies.base import StatelessPolicy


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.fc(x)))


class Chain(nn.Module):
    """Stem, a stack of blocks, head; registered head-first to test execution order."""

    def __init__(self, width: int = 16, depth: int = 4, classes: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.head = nn.Linear(width, classes)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.stem = nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def tiny_cnn(classes: int = 3) -> nn.Module:
    return resnet(depth=8, in_channels=1, num_classes=classes, width=4)


def batches(count: int, *, image: bool = False, batch: int = 16, classes: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 1, 12, 12) if image else (batch, 8)
    return [(torch.randn(shape, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(count)]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    eg: egeria.Egeria | None,
    data,
    *,
    scheduler=None,
    on_step: Callable[[int], None] | None = None,
) -> list[egeria.Decision]:
    """The README's loop; returns Egeria's decisions."""
    decisions = []
    model.train()
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if eg is not None:
            decisions.extend(d for d in eg.step(loss) if d.action != "guided")
        if on_step is not None:
            on_step(i)
    return decisions


def idle_step(optimizer: torch.optim.Optimizer, eg: egeria.Egeria, loss: float = 1.0) -> list[egeria.Decision]:
    """A step boundary that trains nothing: an optimizer step without gradients (Egeria
    counts optimizer steps), then ``eg.step(loss)``; returns its decisions."""
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    return eg.step(torch.tensor(loss))


def quick_config(*, bootstrap_change_rate: float = 0.5, tolerance_ratio: float = 0.2, **overrides) -> egeria.EgeriaConfig:
    """Evaluate every step with a short window so decisions come within tens of steps; an
    int8 reference on every CPU (as these tests were written; "auto" picks bf16); no cost
    budget, whose warning depends on timing. The paper's rule (which unfreezes at a 10x LR
    drop), and under either rule no condition on the drift still to come (``horizon``
    1.0) and no cap on the computation frozen, unless overridden: these tests isolate one
    mechanism each (the defaults have their own tests).

    Bootstrapping ends at a 50% change of the loss between two intervals (the library's
    constant is 10%), so that readings start within a few steps of a tiny task; it and the
    slope test's tolerance ratio are module constants of Egeria's policy, which this sets
    in this process (conftest.py puts the library's back after every test)."""
    quick_constants(bootstrap_change_rate, tolerance_ratio)
    settings = dict(
        eval_interval=1, window=3, executor="inline", reference_precision="int8",
        cost_budget=None, rule="paper", horizon=1.0, max_frozen_flops=1.0,
    )
    settings.update(overrides)
    return egeria.EgeriaConfig(**settings)


def quick_constants(bootstrap_change_rate: float, tolerance_ratio: float) -> None:
    """Egeria's bootstrapping threshold and slope tolerance ratio, in this process (read
    when a policy is built)."""
    from egeria.knowledge import policy as knowledge

    knowledge.BOOTSTRAP_CHANGE_RATE = bootstrap_change_rate
    knowledge.TOLERANCE_RATIO = tolerance_ratio


def checkpointed(model: nn.Module, optimizer: torch.optim.Optimizer, eg: egeria.Egeria) -> tuple:
    """A checkpoint as a user would save it: model and optimizer state, Egeria's state
    through a JSON round trip."""
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        copy.deepcopy(optimizer.state_dict()),
        json.loads(json.dumps(eg.state_dict())),
    )


class Trapped(Chain):
    """A Chain whose eval-mode forward (which only the controller runs) misbehaves:
    ``trap`` is "raise", "hang" or "slow" (0.3 s per forward)."""

    def __init__(self, trap: str | None = None, **kw) -> None:
        super().__init__(**kw)
        self.trap = trap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.trap == "raise":
            raise RuntimeError("trapped forward")
        if not self.training and self.trap == "hang":
            import time

            time.sleep(3600)
        if not self.training and self.trap == "slow":
            import time

            time.sleep(0.3)
        return super().forward(x)


class Plan(StatelessPolicy):
    """Freezes ``plan[step]`` leading modules from each listed step on (0 unfreezes): a
    scripted policy for tests of the freezing mechanics."""

    name = "plan"

    def __init__(self, plan: dict[int, int]) -> None:
        self.plan = plan

    def target(self, info):
        return self.plan.get(info.step)
