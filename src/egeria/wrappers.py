"""Seeing through the wrappers a training framework puts around a model.

The object a loop calls (``DistributedDataParallel(model)``, ``torch.compile(model)``) is
not the module Egeria hooks and splits into layer modules: :func:`unwrap` finds that one
and the wrappers around it, and refuses the wrappers Egeria cannot work through, saying
what to do instead.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["unwrap", "unwrap_optimizer", "ddp_of", "compiled_in"]


def _compiled_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo
        return None
    return OptimizedModule


def unwrap(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """The module inside ``model``'s wrappers, and the wrappers from the outside in.

    Seen through: ``DistributedDataParallel`` (``.module``) and ``torch.compile``'s
    ``OptimizedModule`` (``._orig_mod``), nested in any order.

    Raises:
        ValueError: ``DataParallel`` or FSDP, whose forward runs on copies or shards of the
            parameters Egeria would freeze.
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    compiled = _compiled_type()
    wrappers: list[nn.Module] = []
    while True:
        kind = type(model).__name__
        if isinstance(model, DistributedDataParallel):
            wrappers.append(model)
            model = model.module
        elif compiled is not None and isinstance(model, compiled):
            wrappers.append(model)
            model = model._orig_mod
        elif isinstance(model, DataParallel):
            raise ValueError(
                "Egeria cannot freeze through DataParallel (its forward runs on per-device copies of the model); "
                "use DistributedDataParallel (torchrun) and pass the DDP model"
            )
        elif kind in ("FullyShardedDataParallel", "FSDPModule") or kind.startswith("FSDP"):
            raise ValueError(
                f"Egeria cannot freeze through {kind}: its parameters are sharded across ranks, so a layer module's "
                "weights are not whole on any rank; use DistributedDataParallel"
            )
        else:
            return model, wrappers


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's optimizer wrapper (accelerate's
    ``AcceleratedOptimizer`` keeps it in ``.optimizer``, Lightning's ``LightningOptimizer``
    in ``._optimizer``): the one whose step hooks fire."""
    import torch

    for _ in range(8):  # wrappers nest a few levels at most
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def compiled_in(wrappers: list[nn.Module]) -> bool:
    """Whether ``torch.compile`` is among ``wrappers`` (as :func:`unwrap` returns them)."""
    compiled = _compiled_type()
    return compiled is not None and any(isinstance(w, compiled) for w in wrappers)


def ddp_of(wrappers: list[nn.Module]) -> nn.Module | None:
    """The ``DistributedDataParallel`` among ``wrappers`` (None without one).

    Raises:
        ValueError: DDP inside ``torch.compile`` (Egeria rebuilds DDP when the frozen set
            changes, which a compiled graph around it would not see).
    """
    from torch.nn.parallel import DistributedDataParallel

    for i, wrapper in enumerate(wrappers):
        if isinstance(wrapper, DistributedDataParallel):
            if i > 0:
                raise ValueError(
                    "torch.compile(DistributedDataParallel(model)) hides the DDP that Egeria rebuilds when modules "
                    "freeze; compile inside it instead: DistributedDataParallel(torch.compile(model))"
                )
            return wrapper
    return None
