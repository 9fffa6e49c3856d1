"""Every path that depends on where the model lives: copies between the training device
and the host, timing on a device, and how a controller process may start.

One small module so that the GPU paths can be reviewed together; the tests run them with
CPU tensors, where every copy is a plain clone, ready at once. Beside a CUDA device:

- :class:`HostCopy` copies a tree of tensors to pinned host memory with non-blocking
  copies on a side stream, and records an event. Forward hooks only start copies; the
  step boundary asks :meth:`HostCopy.ready` (``event.query()``, never a wait) or, where
  the bytes must go out now, :meth:`HostCopy.get`, which waits for that event alone (the
  work queued before the copy, not the whole step).
- :func:`pack_to_host` gathers many tensors into one flat buffer per dtype on the device
  (one kernel each) and copies those: not one pageable copy per tensor.
- :func:`to_device` (the cache's prefetch thread) copies on a side stream too; the
  consumer's stream waits on its event (:func:`wait_for`) before using the tensor.
- :class:`Stopwatch` times work on the device with events, read once they completed.
- :func:`gram_where_it_lives`: a captured activation on an accelerator crosses as its
  ``batch x batch`` Gram matrix (:class:`egeria.knowledge.similarity.Gram`), not whole.
- :class:`LocalCopy` is the same hand-over for a controller on the model's own device
  (``reference_device="model"``): a clone where the tensors live, ready at once;
  :func:`handoff` picks one of the two.
- :func:`safe_start_method`: a process forked after CUDA was initialised cannot use it
  (and may hang), so the controller then starts with ``spawn``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..nested import leaves, map_tensors

__all__ = [
    "HostCopy",
    "LocalCopy",
    "handoff",
    "pack_to_host",
    "to_device",
    "wait_for",
    "Stopwatch",
    "safe_start_method",
    "as_float32",
    "gram_where_it_lives",
]

logger = logging.getLogger(__name__)

_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """One side stream per CUDA device for Egeria's copies."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def _cuda_device(tree: Any) -> torch.device | None:
    """The CUDA device of the tree's tensors (None when they are all on the CPU)."""
    for t in leaves(tree):
        if t.is_cuda:
            return t.device
    return None


class HostCopy:
    """A CPU copy of a tree of tensors (args, kwargs, an activation), started now.

    Args:
        tree: tensors nested in tuples, lists and dicts (other leaves are kept as they are).
        fresh: the device tensors are new ones no later op writes to (a ``torch.cat`` of
            the weights): copied as they are, without the device clone that guards a
            captured activation against a later in-place op.
    """

    def __init__(self, tree: Any, *, fresh: bool = False) -> None:
        device = _cuda_device(tree)
        self._event = None
        if device is None:
            self._tree = map_tensors(tree, lambda t: t.detach().clone())
            return
        # A device clone first, on the training stream: later in-place ops of the forward
        # (a ReLU(inplace=True) after the hooked block) must not reach the copy.
        if not fresh:
            tree = map_tensors(tree, lambda t: t.detach().clone() if t.is_cuda else t.detach())
        current = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(current)  # the copy reads the clones once the training stream made them

        def start(t: torch.Tensor) -> torch.Tensor:
            if not t.is_cuda:
                return t.clone()
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # the allocator keeps the clone until the copy is done
            return host

        self._tree = map_tensors(tree, start)
        self._event = torch.cuda.Event()
        self._event.record(side)

    def ready(self) -> bool:
        """Whether the copy has finished (never waits)."""
        return self._event is None or bool(self._event.query())

    def get(self) -> Any:
        """The host tree, once the copy has finished (waits for it, not for later work)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tree


class LocalCopy:
    """A copy of a tree of tensors that stays on their device (a controller on the model's
    device reads it there): a clone, so later in-place ops of the forward do not reach it."""

    def __init__(self, tree: Any) -> None:
        self._tree = map_tensors(tree, lambda t: t.detach().clone())

    def ready(self) -> bool:
        return True

    def get(self) -> Any:
        return self._tree


def handoff(tree: Any, to_host: bool) -> HostCopy | LocalCopy:
    """The copy of ``tree`` the controller reads: on the host (:class:`HostCopy`) or where
    the tensors live (:class:`LocalCopy`, for a reference on the model's device)."""
    return HostCopy(tree) if to_host else LocalCopy(tree)


def gram_where_it_lives(activation: torch.Tensor) -> bool:
    """Whether a captured training activation is reduced to its Gram matrix where it lives
    before it crosses to the controller: on an accelerator, where that is a cheap kernel
    and spares the copy of ``batch x features`` numbers; not on the CPU, whose cores
    train (the controller computes it there, as before)."""
    return activation.is_cuda


def as_float32(tree: Any) -> Any:
    """Floating tensors of ``tree`` in fp32 (the controller's copies of the model are
    fp32, whatever precision the model trains in); other tensors unchanged."""
    return map_tensors(tree, lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t)


def pack_to_host(tensors: list[torch.Tensor]) -> tuple[dict[torch.dtype, torch.Tensor], list[tuple[torch.dtype, int]]]:
    """One flat host buffer per dtype holding ``tensors``, and each tensor's (dtype, offset).

    On a device the tensors are gathered there first (one ``torch.cat`` per dtype) and
    each buffer crosses in one copy; on the CPU they are copied into fresh buffers.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    where: list[tuple[torch.dtype, int]] = []
    sizes: dict[torch.dtype, int] = {}
    for t in tensors:
        t = t.detach()
        where.append((t.dtype, sizes.get(t.dtype, 0)))
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
        groups.setdefault(t.dtype, []).append(t.reshape(-1))
    if _cuda_device(tensors) is None:
        buffers = {dtype: torch.cat(parts) if parts else torch.empty(0, dtype=dtype) for dtype, parts in groups.items()}
        return buffers, where
    flat = {dtype: torch.cat(parts) for dtype, parts in groups.items()}
    return HostCopy(flat, fresh=True).get(), where  # the cat made new buffers: no second device copy


def to_device(tensor: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
    """``tensor`` copied to ``device`` and the event its consumer must wait on (None: none)."""
    if device.type != "cuda":
        return tensor.to(device), None
    side = _side_stream(device)
    pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
    with torch.cuda.stream(side):
        moved = pinned.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return moved, event


def wait_for(tensor: torch.Tensor, event: Any) -> torch.Tensor:
    """Makes the current stream wait for ``event`` (from :func:`to_device`) before it uses
    ``tensor``; the host does not wait."""
    if event is not None:
        stream = torch.cuda.current_stream(tensor.device)
        stream.wait_event(event)
        tensor.record_stream(stream)
    return tensor


class Stopwatch:
    """Times a stretch of work where it runs: the host clock on the CPU, events on CUDA
    (whose work runs after the host moved on). :meth:`seconds` is None until known."""

    def __init__(self, device: torch.device | None) -> None:
        self._device = device if device is not None and device.type == "cuda" else None
        self._host: tuple[float, float | None] = (time.perf_counter(), None)
        self._stopped = False
        if self._device is not None:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self._device))

    def stop(self) -> None:
        self._stopped = True
        if self._device is not None:
            self._end.record(torch.cuda.current_stream(self._device))
        else:
            self._host = (self._host[0], time.perf_counter())

    def seconds(self) -> float | None:
        """The time between start and :meth:`stop`, or None while the device is still on it."""
        if self._device is not None:
            if not self._stopped:
                return None
            return self._start.elapsed_time(self._end) / 1e3 if self._end.query() else None
        started, stopped = self._host
        return None if stopped is None else stopped - started


def safe_start_method(method: str) -> str:
    """``method``, unless it is ``"fork"`` after CUDA was initialised in this process: a
    forked child cannot use CUDA and may hang on the parent's driver threads; then ``"spawn"``."""
    if method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
        logger.info("Egeria: CUDA is initialised in this process; the controller process starts with spawn, not fork")
        return "spawn"
    return method
