"""Seeing through the wrappers a training framework puts around a model.

The object a loop calls (``DistributedDataParallel(model)``, ``torch.compile(model)``) is
not the module Egeria hooks and splits into layer modules: :func:`unwrap` finds that one
and the wrappers around it, and refuses the wrappers Egeria cannot work through, saying
what to do instead.

A model sharded with ``torch.distributed.fsdp.fully_shard`` (FSDP2) is no wrapper: the
module keeps its place and its parameters' names, each parameter a ``DTensor`` shard with
its own ``requires_grad``; :func:`fsdp2_in` tells the engine it is there
(:mod:`egeria.distributed` says what changes). FSDP1 (``FullyShardedDataParallel``) is
refused: it flattens a wrapped module's parameters into one ``FlatParameter`` whose
``requires_grad`` must be uniform, so a frozen set that changes mid-run cannot apply.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["unwrap", "unwrap_optimizer", "ddp_of", "compiled_in", "fsdp2_in", "fsdp2_units", "fsdp2_hook"]


def _compiled_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo
        return None
    return OptimizedModule


def _fsdp_types() -> tuple[type | None, type | None]:
    """FSDP2's ``FSDPModule`` and FSDP1's ``FullyShardedDataParallel``; None where this
    torch lacks them, or where nothing imported FSDP yet (no model can be sharded then,
    and the import is not cheap)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)


_FSDP1_REFUSAL = (
    "Egeria cannot freeze through FullyShardedDataParallel (FSDP1): it flattens each wrapped module's parameters "
    "into one FlatParameter whose requires_grad must be uniform, so a frozen set that changes during training "
    "cannot apply; shard the model with torch.distributed.fsdp.fully_shard (FSDP2), which keeps requires_grad "
    "per parameter, and pass it to Egeria as it is"
)


def fsdp2_in(model: nn.Module) -> bool:
    """Whether ``model`` or any module inside it is sharded with ``fully_shard`` (FSDP2)."""
    return bool(fsdp2_units(model))


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` sharded with ``fully_shard`` (each one unit FSDP2 gathers
    and reshards at once), ``model`` itself included."""
    fsdp2, _ = _fsdp_types()
    return [] if fsdp2 is None else [m for m in model.modules() if isinstance(m, fsdp2)]


def fsdp2_hook(hook: Any) -> bool:
    """Whether ``hook`` (a value of a module's hook dicts) is FSDP2's: its units' forward
    hooks (methods of their per-unit state), which gather and reshard the parameters, and
    the state-dict hooks it puts on the modules inside them."""
    target = getattr(hook, "hook", hook)  # a load-state-dict hook comes wrapped
    owner = getattr(target, "__self__", target)
    source = getattr(owner, "__module__", None) or type(owner).__module__
    return source.startswith("torch.distributed.fsdp")


def unwrap(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """The module inside ``model``'s wrappers, and the wrappers from the outside in.

    Seen through: ``DistributedDataParallel`` (``.module``) and ``torch.compile``'s
    ``OptimizedModule`` (``._orig_mod``), nested in any order. A model sharded with
    ``fully_shard`` (FSDP2) is returned as it is (:func:`fsdp2_in`).

    Raises:
        ValueError: ``DataParallel``, whose forward runs on per-device copies of the
            parameters Egeria would freeze, or FSDP1 (``FullyShardedDataParallel``, around
            the model or inside it), whose flat parameters cannot freeze in part.
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    compiled = _compiled_type()
    _, fsdp1 = _fsdp_types()
    wrappers: list[nn.Module] = []
    while True:
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
        elif fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
            raise ValueError(_FSDP1_REFUSAL)
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
