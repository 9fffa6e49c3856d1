"""Argument checks shared by the public entry points: a ValueError that names the value
(the engine's own arguments: model, module, optimizer, schedule and loss, are checked here too)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .wrappers import ddp_of, unwrap

__all__ = [
    "check_int", "check_lr_schedule", "check_optimizer", "check_run_length", "checked_loss", "finite_count",
    "submodule_of",
]


def check_int(value: object, what: str, *, minimum: int = 1) -> None:
    """Raises ValueError unless ``value`` is an int (not a bool) >= ``minimum``.

    Args:
        what: how the user spelled it, e.g. ``"EgeriaConfig.window"``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{what}={value!r} must be {kind}")


def submodule_of(model: nn.Module, module: Any) -> nn.Module:
    """``module``, seen through ``torch.compile``, once it is known to lie inside ``model``."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not any(m is module for m in model.modules()):
        raise ValueError(
            f"module= ({type(module).__name__}) is not a submodule of the model ({type(model).__name__}); "
            "pass a part of the model being trained, e.g. module=model.net"
        )
    inner, wrappers = unwrap(module)
    if ddp_of(wrappers) is not None:
        raise ValueError("module= must not be wrapped in DistributedDataParallel; wrap the whole model instead")
    return inner


def checked_loss(loss: Any) -> torch.Tensor | float | None:
    """The loss as a detached scalar tensor or a float; ValueError for anything else."""
    if loss is None:
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(f"Egeria.step(loss): loss must be a scalar, got shape {tuple(loss.shape)}")
        return loss.detach().reshape(())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    raise ValueError(f"Egeria.step(loss): loss must be a tensor or a number, got {type(loss).__name__}")


def finite_count(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def check_lr_schedule(lr_schedule: Any) -> None:
    if lr_schedule is None or callable(lr_schedule):
        return
    hint = " (a scheduler goes to lr_scheduler=)" if hasattr(lr_schedule, "step") else ""
    raise ValueError(
        f"Egeria(lr_schedule={lr_schedule!r}) must be a callable lr_at(step) -> float giving the learning rate of "
        f"optimizer step `step` (from 0), or None{hint}"
    )


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    model_ids = {id(p) for p in model.parameters()}
    held = sum(1 for g in groups for p in g["params"] if id(p) in model_ids)
    if held == 0:
        raise ValueError(
            f"the optimizer ({type(optimizer).__name__}) holds none of the model's parameters; "
            "pass the optimizer that trains this model"
        )


def check_run_length(required: bool, total_steps: int | None) -> None:
    """Raises ValueError where the policy needs the run's length (``required``, Egeria's
    paper rule deriving n from it) and ``total_steps`` is unknown at the first step."""
    if required and total_steps is None:
        raise ValueError(
            "EgeriaConfig.eval_interval=None derives n from total_steps, but total_steps=None; "
            "pass total_steps=len(loader) * epochs (optimizer steps), call eg.set_schedule(total_steps=...) "
            "before training, or set eval_interval"
        )
