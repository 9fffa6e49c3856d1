"""The training's memory by part, measured on sampled steps and around every freeze.

Parts, in bytes held by this process (an FSDP2 rank: its shards):

- ``parameters``: the model's parameters (frozen or not);
- ``gradients``: the gradients the optimizer stepped with (summed as its step begins);
  a frozen parameter has none;
- ``optimizer_state``: the state the optimizer holds (Adam's moments and step counts,
  SGD's momentum): on an accelerator, device memory;
- ``optimizer_state_released``: the frozen parameters' state Egeria holds for them
  (:mod:`egeria.optimizer_state`): host memory; on a CPU run the same memory, so there the
  release frees nothing and only this label moves;
- ``activations``: the tensors autograd saved for the backward during one training forward
  (the largest of the step's micro-batches), counted through
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once; the parameters and
  buffers ops save are not activations); not measured under ``torch.compile``;
- ``activation_cache``, ``activation_cache_disk``: the activation cache's tables in memory
  and on disk (:mod:`egeria.cache`), 0 without it;
- on CUDA, ``cuda_allocated`` and ``cuda_max_allocated``: ``torch.cuda.memory_allocated``
  and ``max_memory_allocated`` at the step boundary (the peak since the process started or
  the user last reset it: Egeria resets nothing).

:class:`MemoryMeter` measures the step after every :data:`SAMPLE_EVERY`-th boundary (the
first included) and the step after each freeze or unfreeze, and takes a row just before
each change too (gradients and activations there from the latest measured step, which had
the same frozen modules), so every freeze has a row before and after it. Only a measured
step pays for the hooks. :func:`summary` gives a run's latest figures by part (the demo's
table); :meth:`egeria.Egeria.metrics` carries them as ``egeria/memory/<part>``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .hooks import mark
from .optimizer_state import state_bytes, tensor_bytes

if TYPE_CHECKING:
    from .engine import Egeria

__all__ = ["PARTS", "SAMPLE_EVERY", "MemoryMeter", "cache_bytes", "summary"]

#: The parts every row holds, in the order plots stack them.
PARTS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "optimizer_state_released",
    "activations",
    "activation_cache",
    "activation_cache_disk",
)

#: Step boundaries between measured steps (besides those after a change).
SAMPLE_EVERY = 100


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """A saved tensor's storage, as (address, bytes); a tensor without a plain storage counts
    as itself."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without one
        return id(t), t.numel() * t.element_size()


class MemoryMeter:
    """Measures the memory parts of one run (see the module's text).

    Args:
        model: the module Egeria freezes (its training forwards are measured).
        optimizer: its optimizer.
        own_pass: whether a forward pass now is Egeria's own (not measured).
        context: the frozen modules' count, the released optimizer state's bytes and the
            activation cache's bytes by tier (``memory``, ``disk``), now.
        activations: measure saved activations (False under ``torch.compile``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        own_pass: Callable[[], bool],
        context: Callable[[], tuple[int, int, dict]],
        *,
        activations: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._context = context
        self.rows: list[dict] = []
        self._own_pass = own_pass
        self._armed = True  # the first step is measured
        self._gradients: int | None = None  # of the measured step under way
        self._activations: int | None = None
        self._last_gradients: int | None = None  # of the latest measured step
        self._last_activations: int | None = None
        self._saving: Any = None  # the saved-tensors hooks of a forward being measured
        self._skip: set[int] = set()  # storages of parameters and buffers in that forward
        self._seen: dict[int, int] = {}
        self._handles: list[RemovableHandle] = []
        if activations:
            self._handles += [
                mark(model.register_forward_pre_hook(self._forward_begins)),
                mark(model.register_forward_hook(self._forward_ends, always_call=True)),
            ]
        register = getattr(optimizer, "register_step_pre_hook", None)
        if callable(register):
            self._handles.append(register(self._step_begins))

    # -- hooks: they count, nothing more --------------------------------------------

    def _forward_begins(self, module: nn.Module, args: tuple) -> None:
        if not self._armed or self._saving is not None or not module.training or not torch.is_grad_enabled():
            return
        if self._own_pass():
            return
        self._skip = {
            _storage_key(t.to_local() if hasattr(t, "to_local") else t)[0]
            for t in (*module.parameters(), *module.buffers())
        }
        self._seen = {}
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saving.__enter__()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            key, nbytes = _storage_key(t)
            if key not in self._skip:
                self._seen[key] = nbytes
        return t

    def _forward_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._saving is None:
            return
        saving, self._saving = self._saving, None
        saving.__exit__(None, None, None)
        total = sum(self._seen.values())
        self._seen = {}
        self._activations = max(total, self._activations or 0)

    def _step_begins(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._armed:
            return
        seen: set[int] = set()
        total = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in seen:
                    seen.add(id(p))
                    total += tensor_bytes(p.grad)
        self._gradients = total

    # -- step boundaries -------------------------------------------------------------

    def boundary(self, step: int) -> None:
        """At a step boundary, before any change: a row for a measured step; arms the next
        step every :data:`SAMPLE_EVERY` boundaries."""
        if self._armed:
            self._armed = False
            if self._gradients is not None or self._activations is not None:
                self._last_gradients, self._gradients = self._gradients, None
                self._last_activations, self._activations = self._activations, None
                self._record(step)
        if step % SAMPLE_EVERY == 0:
            self._armed = True

    def changing(self, step: int) -> None:
        """Just before a freeze or unfreeze: a row of the modules frozen until now."""
        if not self.rows or self.rows[-1]["step"] != step:
            self._record(step)

    def changed(self) -> None:
        """After a freeze or unfreeze: the next step is measured."""
        self._armed = True

    def parts(self) -> dict:
        """The parts now: parameters, optimizer state and cache measured now, gradients and
        activations from the latest measured step (None before one); ``frozen``, the
        frozen modules' count."""
        frozen, released, cache = self._context()
        params = {id(p): p for p in self.model.parameters()}
        row: dict[str, Any] = {
            "frozen": frozen,
            "parameters": sum(tensor_bytes(p) for p in params.values()),
            "gradients": self._last_gradients,
            "optimizer_state": sum(state_bytes(v) for v in getattr(self.optimizer, "state", {}).values()),
            "optimizer_state_released": released,
            "activations": self._last_activations,
            "activation_cache": cache.get("memory", 0),
            "activation_cache_disk": cache.get("disk", 0),
        }
        device = next((p.device for p in params.values() if p.device.type == "cuda"), None)
        if device is not None:
            row["cuda_allocated"] = torch.cuda.memory_allocated(device)
            row["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        return row

    def _record(self, step: int) -> None:
        self.rows.append({"step": step, **self.parts()})

    def remove(self) -> None:
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []


def cache_bytes(cache_stats: dict) -> dict:
    """The activation cache's bytes by tier (``memory``, ``disk``) from ``eg.cache_stats``."""
    out = {"memory": 0, "disk": 0}
    for level in cache_stats.get("levels", {}).values():
        if level.get("tier") in out:
            out[level["tier"]] += int(level.get("bytes") or 0)
    return out


def summary(eg: Egeria) -> dict:
    """``eg``'s memory by part now, in bytes (see the module's text): the parameters,
    optimizer state and cache as they are, the gradients and activations of the latest
    measured step (None before the first step); ``frozen``: the frozen modules' count.
    The demo's table shows one row of it per run."""
    return eg._memory.parts()
