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
from .device import pack_to_host

__all__ = ["float_snapshot", "ModuleKeys", "PackedState", "as_mapping"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def float_snapshot(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """An fp32 eval-mode copy of ``model`` on ``device`` (the CPU by default) without
    Egeria's own forward hooks."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if hooks:
                memo[id(hooks)] = type(hooks)((k, v) for k, v in hooks.items() if not is_marked(k))
    # Tensors go straight to ``device``: no second copy of the model on the training
    # device unless it is asked for.
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(_float_on(p, device), requires_grad=False)
    for b in model.buffers():
        memo[id(b)] = _float_on(b, device)
    snapshot = copy.deepcopy(model, memo).eval()
    for p in snapshot.parameters():
        p.requires_grad_(False)
        p.grad = None
    return snapshot


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
