"""The optimizer state of frozen parameters, released at a freeze and restored exactly at an
unfreeze (record 039, ``docs/decisions/039-optimizer-state-release.md``).

A frozen parameter has no gradient, so a torch optimizer skips it: its state (AdamW's
``exp_avg``, ``exp_avg_sq`` and ``step``, SGD's ``momentum_buffer``) is neither read nor
written until the parameter trains again, yet it stays allocated. :class:`ReleasedState`
takes that state out of ``optimizer.state`` at a freeze and holds it for Egeria:

* a tensor on an accelerator is copied to host memory (pinned under CUDA) and the device
  copy is let go: the device memory the optimizer held for the frozen front comes back;
  an FSDP2 shard (a ``DTensor``) moves its local shard and is rebuilt on its mesh;
* a tensor already on the CPU is kept as it is, neither copied nor duplicated: on a run on
  the CPU the release frees nothing (the moments are still needed for an exact unfreeze;
  dropping them would restart Adam's moments and bias correction at the unfreeze);
* at an unfreeze each tensor goes back to its device unchanged, before the next step: the
  run is bit for bit the run without the release.

The optimizer's param groups are never changed. Its ``state_dict()`` still holds the
released state (a state-dict post-hook puts it back into the dict it returns, as host
tensors, which ``load_state_dict`` moves to each parameter's device, or under FSDP2 as the
shard's ``DTensor``, which DCP needs: on an accelerator that copy is on the device for as long
as the returned dict lives), so a checkpoint saved while the front is frozen loads in code
without the release, and one saved without it loads here: after ``load_state_dict`` a
load post-hook takes the loaded state of the parameters frozen now and releases it again.

Faults never stop training: an optimizer without ``state`` or without state-dict hooks (not
a ``torch.optim.Optimizer``), or a release that fails (host memory exhausted), keeps the
state where it is, with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ReleasedState", "state_bytes", "tensor_bytes"]

logger = logging.getLogger(__name__)


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes ``t`` holds on this process (an FSDP2 ``DTensor``: its local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value``: a tensor, or dicts, lists and tuples of them
    (one parameter's optimizer state); released shards count their host copy."""
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    if isinstance(value, _Shard):
        return tensor_bytes(value.local)
    if isinstance(value, _Moved):
        return tensor_bytes(value.host)
    if isinstance(value, Mapping):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(state_bytes(v) for v in value)
    return 0


@dataclass
class _Shard:
    """A released FSDP2 state shard: its local tensor on the host and how to rebuild it."""

    local: torch.Tensor
    device: torch.device
    mesh: Any
    placements: Any
    shape: torch.Size
    stride: tuple[int, ...]

    def rebuilt(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = self.local.to(self.device, non_blocking=self.local.is_pinned())
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor (pinned under CUDA, so the copy back can be async)."""
    host = torch.empty_like(t, device="cpu", pin_memory=t.device.type == "cuda")
    host.copy_(t)  # synchronous: the host copy is whole before the device one is let go
    return host


@dataclass
class _Moved:
    """A released device tensor: its host copy and the device it goes back to."""

    host: torch.Tensor
    device: torch.device

    def back(self) -> torch.Tensor:
        return self.host.to(self.device, non_blocking=self.host.is_pinned())


def _map(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` (one parameter's optimizer state: dicts, lists and tuples of tensors and
    numbers) with ``leaf`` applied to everything that is not a container."""
    if isinstance(value, Mapping):
        return {k: _map(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, leaf) for v in value)
    return leaf(value)


def _release_leaf(value: Any) -> Any:
    """A tensor as Egeria holds it: a device tensor copied to the host, a host one as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "to_local") and hasattr(value, "device_mesh"):  # an FSDP2 shard
        local = value.to_local()
        if local.device.type == "cpu":
            return value
        return _Shard(_to_host(local), local.device, value.device_mesh, value.placements, value.shape, value.stride())
    return value if value.device.type == "cpu" else _Moved(_to_host(value), value.device)


def _restore_leaf(value: Any) -> Any:
    """A tensor as the optimizer held it: back on its device."""
    if isinstance(value, _Moved):
        return value.back()
    if isinstance(value, _Shard):
        return value.rebuilt()
    return value


def _save_leaf(value: Any) -> Any:
    """A tensor for a state dict the user saves: a host copy as the host tensor (a load moves
    it to the parameter's device), an FSDP2 shard rebuilt (DCP needs the ``DTensor``)."""
    if isinstance(value, _Moved):
        return value.host
    if isinstance(value, _Shard):
        return value.rebuilt()
    return value


class ReleasedState:
    """Holds the optimizer state of frozen parameters (see the module's text).

    Args:
        optimizer: the torch optimizer training the model.

    ``release(params)`` at a freeze, ``restore(params)`` at an unfreeze, ``close()`` at the
    end (everything back in the optimizer, hooks removed). ``off`` is the reason the state
    stays in the optimizer, or None.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.held: dict[nn.Parameter, Any] = {}  # parameter -> its state, as released
        self._frozen: list[nn.Parameter] = []  # released parameters, in order (those with no state too)
        self._handles: list[RemovableHandle] = []
        self.off: str | None = None
        unsupported = self._unsupported(optimizer)
        if unsupported is not None:
            self._turn_off(unsupported)
        else:
            self._handles = [
                optimizer.register_state_dict_post_hook(self._into_state_dict),
                optimizer.register_load_state_dict_post_hook(self._after_load),
            ]

    @staticmethod
    def _unsupported(optimizer: Any) -> str | None:
        if not isinstance(getattr(optimizer, "state", None), dict):
            return f"the optimizer ({type(optimizer).__name__}) keeps no per-parameter state dict"
        for hook in ("register_state_dict_post_hook", "register_load_state_dict_post_hook"):
            if not callable(getattr(optimizer, hook, None)):
                return f"the optimizer ({type(optimizer).__name__}) has no {hook} (not a torch.optim.Optimizer)"
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the released state (host memory; on a CPU run the same tensors the
        optimizer held)."""
        return sum(state_bytes(v) for v in self.held.values())

    def release(self, params: Iterable[nn.Parameter]) -> None:
        """Takes the state of ``params`` (just frozen) out of the optimizer."""
        params = list(params)
        if self.off is not None:
            return
        try:
            taken = {p: _map(self.optimizer.state[p], _release_leaf) for p in params if p in self.optimizer.state}
        except (RuntimeError, MemoryError) as err:  # the host copy failed: the state stays where it is
            self._turn_off(f"its state could not be moved off the device ({err})")
            return
        for p, value in taken.items():
            del self.optimizer.state[p]
            self.held[p] = value
        self._frozen.extend(params)

    def restore(self, params: Iterable[nn.Parameter]) -> None:
        """Gives the optimizer back the state of ``params`` (about to train again)."""
        for p in params:
            if p in self.held:
                self.optimizer.state[p] = _map(self.held.pop(p), _restore_leaf)
        self._frozen = [p for p in self._frozen if p in self.held]

    def close(self) -> None:
        """Everything back into the optimizer; the hooks removed."""
        self.restore(list(self.held))
        self._frozen = []
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _turn_off(self, reason: str) -> None:
        self.off = reason
        logger.warning(
            "Egeria: the optimizer state of frozen parameters stays in the optimizer: %s; training goes on as "
            "before, without the memory a freeze would free",
            reason,
        )

    # -- the optimizer's state dicts ------------------------------------------------

    def _indices(self) -> dict[int, int]:
        """Each parameter's key in the optimizer's state dict (its place in the param
        groups, counted as ``Optimizer.state_dict`` does), by ``id``."""
        index: dict[int, int] = {}
        for p in chain.from_iterable(g["params"] for g in self.optimizer.param_groups):
            index.setdefault(id(p), len(index))
        return index

    def _into_state_dict(self, optimizer: Any, state_dict: dict) -> dict:
        """State-dict post-hook: the released state back in the dict the user saves."""
        if self.held:
            index = self._indices()
            state = dict(state_dict["state"])
            for p, value in self.held.items():
                state[index[id(p)]] = _map(value, _save_leaf)
            state_dict = {**state_dict, "state": state}
        return state_dict

    def _after_load(self, optimizer: Any) -> None:
        """Load post-hook: the loaded state replaced all state; the frozen parameters'
        part of it is released again, and what was held before is let go (a parameter the
        loaded dict holds no state for has none now, as in the optimizer)."""
        self.held = {}
        frozen, self._frozen = self._frozen, []
        self.release(frozen)

