"""Copies of a model's weights for the controller: an fp32 snapshot of the whole model (on
the CPU, or on the model's device for ``reference_device="model"``), and packed copies of
the state of some layer modules (paper 4.1.3, "updating the reference").

A packed copy holds one flat buffer per dtype, so sending it to the controller process
costs one copy of the weights into one shared-memory block, not one block per tensor.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..hooks import is_marked
from ..partition import Partition
from ..wrappers import fsdp2_hook, fsdp2_units
from .device import pack_to_host

__all__ = ["float_snapshot", "ModuleKeys", "PackedState", "as_mapping"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


#: How FSDP2 (torch's composable API) names the entries of its state in a module's __dict__.
_FSDP_STATE_KEY = "__composable_api_state_key"


def float_snapshot(
    model: nn.Module, device: torch.device | str = "cpu", whole: Mapping[str, torch.Tensor] | None = None
) -> nn.Module:
    """An fp32 eval-mode copy of ``model`` on ``device`` (the CPU by default) without
    Egeria's own forward hooks.

    A model sharded with ``fully_shard`` (FSDP2) is copied as plain modules of its own
    classes, without FSDP2's hooks, its parameters and buffers taken from ``whole`` (its
    whole state by ``state_dict`` key, :class:`egeria.distributed.WholeWeights`)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if hooks:
                memo[id(hooks)] = type(hooks)((k, v) for k, v in hooks.items() if not _foreign(k, v))
    by_id = _whole_by_identity(model, whole)
    # Tensors go straight to ``device``: no second copy of the model on the training
    # device unless it is asked for.
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(_float_on(by_id.get(id(p), p), device), requires_grad=False)
    for b in model.buffers():
        memo[id(b)] = _float_on(by_id.get(id(b), b), device)
    _unsharded_modules(model, memo)
    snapshot = copy.deepcopy(model, memo).eval()
    for p in snapshot.parameters():
        p.requires_grad_(False)
        p.grad = None
    return snapshot


def _foreign(key: int, hook: Any) -> bool:
    """Egeria's own hooks and FSDP2's: not copied."""
    return is_marked(key) or fsdp2_hook(hook)


def _whole_by_identity(model: nn.Module, whole: Mapping[str, torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """``whole``'s tensors by the identity of the parameter or buffer they stand for;
    raises where a sharded tensor has none."""
    from torch.distributed.tensor import DTensor

    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    found = {id(t): whole[name] for name, t in named if whole is not None and name in whole}
    missing = [name for name, t in named if isinstance(t, DTensor) and id(t) not in found]
    if missing:
        raise ValueError(f"a copy of a sharded model needs its whole weights; none given for {missing[:3]}")
    return found


def _unsharded_modules(model: nn.Module, memo: dict[int, Any]) -> None:
    """Puts into ``memo`` a copy of every FSDP2 unit of ``model`` as its own class (FSDP2
    made it an instance of a subclass that refuses deepcopy), children first."""
    for unit in reversed(fsdp2_units(model)):  # model.modules() order: a unit after its children
        plain = next(c for c in type(unit).__mro__ if c.__module__.split(".")[:3] != ["torch", "distributed", "fsdp"])
        copied = plain.__new__(plain)
        memo[id(unit)] = copied
        own = {k: v for k, v in unit.__dict__.items() if not k.startswith(_FSDP_STATE_KEY)}
        copied.__dict__.update(copy.deepcopy(own, memo))


def _float_on(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    copied = tensor.detach().to(device, copy=True)
    return copied.float() if copied.is_floating_point() else copied


class ModuleKeys:
    """The ``state_dict`` keys of each layer module, and those that belong to no block."""

    def __init__(self, model: nn.Module, partition: Partition) -> None:
        keys = list(model.state_dict().keys())
        self.per_module: list[list[str]] = [
            [k for k in keys if _under(k, m.blocks)] for m in partition.modules
        ]
        owned = {k for ks in self.per_module for k in ks}
        self.loose: list[str] = [k for k in keys if k not in owned]

    def of(self, modules: Iterable[int], *, loose: bool = True) -> list[str]:
        chosen = [k for i in modules for k in self.per_module[i]]
        return chosen + self.loose if loose else chosen


def _under(key: str, blocks: Sequence[str]) -> bool:
    return any(key.startswith(b + ".") for b in blocks)


class PackedState:
    """A CPU copy of some state tensors in one flat buffer per dtype.

    Args:
        state: the model's ``state_dict()`` (any device).
        keys: the entries to copy.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], keys: Sequence[str]) -> None:
        tensors = [state[k] for k in keys]
        self.buffers, where = pack_to_host(tensors)  # one copy per dtype (egeria.knowledge.device)
        self.entries: list[tuple[str, torch.dtype, int, tuple[int, ...]]] = [
            (key, dtype, offset, tuple(t.shape)) for key, t, (dtype, offset) in zip(keys, tensors, where)
        ]

    def unpack(self) -> dict[str, torch.Tensor]:
        """The entries as views into the buffers."""
        out = {}
        for key, dtype, offset, shape in self.entries:
            n = 1
            for s in shape:
                n *= s
            out[key] = self.buffers[dtype][offset : offset + n].view(shape)
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def as_mapping(weights: Any) -> Mapping[str, torch.Tensor]:
    """A packed copy unpacked, a mapping as it is."""
    return weights.unpack() if isinstance(weights, PackedState) else weights
