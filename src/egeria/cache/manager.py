"""The activation cache: skip the frozen prefix's forward pass (paper 4.3, Figure 7).

Once modules ``0..f-1`` are frozen, the output of module ``f-1`` for a sample is a pure
function of the sample (frozen weights, BatchNorm and dropout locked in eval mode). A
*level* of the cache holds that output for every sample key, keyed by the loader's keys:

* **recording**: a batch with any key missing runs the prefix as usual; a hook on the
  boundary block writes its output into the level's table. When an older, shallower level
  has the whole batch, its cached output is fed in and only the newly frozen modules run
  (a deeper boundary is built from the old cache). Once the new level holds every key,
  the older levels are dropped.
* **serving**: a batch whose keys are all present skips the prefix: its blocks are
  stubbed for that call and the boundary block returns the cached output, read ahead by
  the prefetcher.
* **serving in part**: a batch the level holds some rows of (after a freeze, the next epoch's
  batches, shuffled, mix rows recorded since the freeze with rows not yet seen) runs the
  prefix on its missing rows only and takes the others from the cache; the computed rows are
  recorded. Checked once per level by running such a batch both ways (whole, and in part
  with the whole run's own rows), since slicing a block's inputs to some rows assumes each of
  its batch-first inputs is per sample; where the outputs differ, such batches are computed
  whole.

Safety, checked per level: the model must be a chain at the boundary (checked once by
running one batch both ways in eval mode and comparing the model's outputs); the
boundary output must be batch-first; the prefix must not read a tied weight that a
trainable module still changes (:attr:`~egeria.partition.LayerModule.detached`); serving
must be cheaper than computing (the first served forward passes are timed against the forward passes computed just before
them, so a load on the machine that comes and goes weighs on both alike; the one that ran the chain check is not timed; when
serving is not faster the level is dropped and keeps computing; the choice is logged and kept in :meth:`ActivationCache.summary`); the table must fit the memory or the disk limit, and
a table on disk the free space of its folder (else the level computes, with one warning naming the folder and the bytes). Any unfreeze
drops every level. A corrupt row is recomputed; a failed write turns caching off with one
warning. None of these change what the model computes.

Under FSDP2 with several ranks a batch is served only where every rank can serve it (each
rank holds the rows of its own samples), agreed by one small all-reduce per training forward
pass; the FSDP2 units wholly inside the frozen prefix then skip their hooks, so their
parameters are not gathered on any rank (docs/decisions/027-fsdp2.md).

Disk tables go in ``directory`` (the system's temporary folder by default), logged once at
INFO and shown by :meth:`ActivationCache.summary`; their files are unlinked as soon as they
are open, so none outlives the process, however it ends (:mod:`egeria.cache.store`).
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from collections import deque
from typing import Any, Callable, ContextManager

import numpy as np
import torch
from torch import nn

from ..hooks import mark
from ..knowledge.device import HostCopy, Stopwatch, to_device, wait_for
from ..partition import Partition
from ..wrappers import fsdp2_units
from .batchkeys import KEYS
from .prefetch import Prefetcher
from .skip import (
    Spec, install_part_stubs, install_stubs, leaves, rebuild, remove_stubs, same_outputs, stubbed, template_of,
)
from .store import CorruptRows, DiskTable, MemoryTable, StoreFull, Table, disk_folder

__all__ = ["ActivationCache"]

logger = logging.getLogger(__name__)

_TIMING_SAMPLES = 5  # served forward passes timed, against as many computed just before them


class _Level:
    """The cache for a frozen prefix of ``frozen`` modules."""

    def __init__(self, frozen: int, partition: Partition) -> None:
        self.frozen = frozen
        self.blocks = [b for m in partition.modules[:frozen] for b in m.blocks]
        self.boundary = partition.modules[frozen - 1].output_block
        self.tables: list[Table] | None = None
        self.template: Any = None
        self.specs: dict[str, Spec] = {}
        self.validated: bool | None = None
        self.sliceable: bool | None = None  # may a batch held in part be served in part (checked once)
        self.serving: bool | None = None  # None: on trial (served, timed) until decided
        # the last forward passes with the whole prefix computed (the trial weighs only those)
        self.compute_s: deque[float] = deque(maxlen=_TIMING_SAMPLES)
        self.serve_s: list[float] = []  # forward passes served from the cache
        self.off: str | None = None  # why this level caches nothing
        self.inputs: list[tuple[int, ...]] | None = None  # per-sample shapes of the model's inputs
        self.handle: Any = None
        self._units: list[nn.Module] | None = None

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The FSDP2 units of ``model`` whose parameters all belong to the prefix's blocks
        (a served batch does not gather them), found once."""
        if self._units is None:
            inside = {id(p) for b in self.blocks for p in model.get_submodule(b).parameters()}
            self._units = [
                u for u in fsdp2_units(model)
                if u is not model and next(u.parameters(), None) is not None and all(id(p) in inside for p in u.parameters())
            ]
        return self._units

    def has(self, keys: list[int]) -> bool:
        return self.tables is not None and self.off is None and all(t.has(keys) for t in self.tables)

    def held(self, keys: list[int]) -> np.ndarray:
        """Which of ``keys`` the level holds, one bool each."""
        if self.tables is None or self.off is not None:
            return np.zeros(len(keys), dtype=bool)
        rows = np.asarray(keys)
        return np.logical_and.reduce([t.written[rows] for t in self.tables])

    @property
    def complete(self) -> bool:
        return self.tables is not None and all(bool(t.written.all()) for t in self.tables)

    @property
    def nbytes(self) -> int:
        return 0 if self.tables is None else sum(t.nbytes for t in self.tables)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        for table in self.tables or []:
            table.close()
        self.tables = None


class ActivationCache:
    """Serves the frozen prefix's outputs from memory or disk (see the module docstring).

    Args:
        model: the training model.
        partition: returns its layer modules (known after the first forward pass).
        rows: number of sample keys (dataset length x augmentation variants).
        memory_limit, disk_limit: bytes the tables may use in memory / on disk.
        directory: the folder disk tables go in (the system's temporary folder by default:
            ``$TMPDIR``, else ``/tmp`` on Linux); their files are unlinked once open.
        storage_dtype: keep rows in this dtype (e.g. ``torch.bfloat16``) instead of the
            activation's own; not exact.
        prefetch: batches read ahead.
        serve: "auto" (serve where it is faster than computing) or "always".
        internal: true while Egeria runs a forward pass of its own.
        eval_forward: a context for Egeria's own eval-mode, no-grad forward passes.
        agree: under FSDP2 with several ranks, whether every rank says true (a collective
            every rank joins at each training forward pass): a batch is served only where
            every rank serves it, and then the FSDP2 units wholly inside the frozen prefix
            are not gathered (their all-gathers are skipped on every rank at once). None:
            each rank decides alone.
        keys_in_batch: each training batch carries its sample keys as the model's keyword
            argument :data:`~.batchkeys.KEYS` (:mod:`egeria.cache.batchkeys`), which a
            forward pre-hook run before any other takes out; no loader calls
            :meth:`on_batch`, and nothing is read ahead (the epoch's order is not known).
        steps_left: the training steps the run has still to take (None: not known). Where
            it and the epoch's plan are known, a batch computed when no later epoch will
            come is not recorded: none of its rows could be served (:meth:`_seen_again`).
    """

    def __init__(
        self,
        model: nn.Module,
        partition: Callable[[], Partition | None],
        rows: int,
        *,
        memory_limit: int,
        disk_limit: int,
        directory: str | None,
        storage_dtype: torch.dtype | None,
        prefetch: int,
        serve: str = "auto",
        internal: Callable[[], bool],
        eval_forward: Callable[[], ContextManager[None]],
        agree: Callable[[bool], bool] | None = None,
        keys_in_batch: bool = False,
        steps_left: Callable[[], int | None] | None = None,
    ) -> None:
        self.model = model
        self._agree = agree
        self._partition = partition
        self.rows = rows
        self.memory_limit = memory_limit
        self.disk_limit = disk_limit
        self.directory = disk_folder(directory)
        self._space_warned = False
        self.storage_dtype = storage_dtype
        self._internal = internal
        self.serve = serve
        self._eval_forward = eval_forward
        self.frozen = 0
        self.levels: dict[int, _Level] = {}
        self.off: str | None = None
        self.plan: list[list[int]] = []
        self.position = -1
        self._keys: list[int] | None = None
        self._stubs: list[nn.Module] = []
        self._recording: tuple[_Level, list[int]] | None = None
        self._timing: tuple[_Level, str, Stopwatch] | None = None  # (level, "compute"/"serve", watch)
        self._unsettled: list[tuple[_Level, str, Stopwatch, float]] = []  # timed, time not known yet
        self._unwritten: tuple[_Level, list[int], HostCopy] | None = None  # the last boundary output
        self._write_s = 0.0
        self._self_forward = False
        self._steps_left = steps_left
        self._left: int | None = None  # the steps left at the latest training forward pass
        self._in_step = 0  # training forward passes since the steps left last changed
        self._per_step = 0  # the most training forward passes one step has taken (0: none seen whole)
        self._spec_handles: list = []  # output-shape hooks of the forward pass being recorded
        self.prefetcher = Prefetcher(self._read, prefetch) if prefetch > 0 else None
        self.decisions: list[dict] = []  # each level's timed choice between serving and computing
        self.stats = {"served": 0, "partly": 0, "computed": 0, "chained": 0, "prefetch_hits": 0, "prefetch_misses": 0, "corrupt": 0, "batches": 0,
                      "unrecorded": 0}
        self._handles = [
            mark(model.register_forward_pre_hook(self._on_forward_start, with_kwargs=True)),
            mark(model.register_forward_hook(self._on_forward_end, always_call=True)),
        ]
        if keys_in_batch:  # before every other pre-hook: none of them, nor the model, sees the keys
            self._handles.append(mark(model.register_forward_pre_hook(self._take_keys, with_kwargs=True, prepend=True)))

    # -- what the loader and the engine tell it ---------------------------------------

    def on_epoch(self, plan: list[list[int]]) -> None:
        self.plan = plan
        if self.prefetcher is not None:
            self.prefetcher.clear()

    def on_batch(self, position: int, keys: list[int]) -> None:
        self.position = position
        self._keys = keys
        self._prefetch_ahead()

    def set_frozen(self, frozen: int) -> None:
        """The frozen prefix is now ``frozen`` modules; an unfreeze drops every level."""
        self._flush()
        if frozen < self.frozen:
            self._drop(lambda level: True)
            if self.prefetcher is not None:
                self.prefetcher.clear()
        self.frozen = frozen

    # -- hooks -----------------------------------------------------------------------

    def _take_keys(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Takes a batch's sample keys out of the model's keyword arguments (``keys_in_batch``)."""
        if KEYS not in kwargs:
            return None
        kwargs = dict(kwargs)
        keys = kwargs.pop(KEYS)
        self.on_batch(-1, keys.tolist())
        return args, kwargs

    def _on_forward_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._self_forward:
            self._flush()
        self._settle_timings()
        remove_stubs(self._stubs)
        self._stubs = []
        self._recording = None
        self._timing = None
        keys, self._keys = self._keys, None
        training = module.training and not self._self_forward and not self._internal()
        if training:
            self._count_forward()
        if keys is None or not training or self.frozen == 0:
            return  # the same on every rank
        if self._agree is not None:
            self._start_agreed(keys, args, kwargs)
            return
        if self.off:
            return
        level = self._level()
        if level is None or level.off is not None:
            return
        batch = len(keys)
        first = leaves((args, kwargs))
        if not first or first[0].dim() == 0 or first[0].shape[0] != batch:
            self._turn_off(f"the batch's first input does not have the {batch} samples of its keys in dimension 0")
            return
        if not self._same_sample_shapes(level, first):
            return
        self.stats["batches"] += 1
        started = Stopwatch(_device(self.model))
        if level.has(keys) and level.serving is not False:
            checked_now = level.validated is None
            output = self._cached(level, keys, args, kwargs)
            if output is not None:
                self._stubs = install_stubs(self.model, level.blocks, level.boundary, output, level.specs, batch)
                self.stats["served"] += 1
                if not checked_now:  # the chain check's own two forward passes are not serving's cost
                    self._timing = (level, "serve", started)
                return
        older = self._older_with(keys, level)
        if older is not None:
            output = self._cached(older, keys, args, kwargs)
            if output is not None:
                self._stubs = install_stubs(self.model, older.blocks, older.boundary, output, older.specs, batch)
                self.stats["chained"] += 1
        elif self._serve_part(level, keys, args, kwargs, batch, started):
            return
        self.stats["computed"] += 1
        self._record(level, keys)
        self._write_s = 0.0
        if not self._stubs:
            self._timing = (level, "compute", started)
        self._capture_specs(level, batch)

    def _record(self, level: _Level, keys: list[int]) -> None:
        """The batch being computed is recorded at the level's boundary, where a later epoch
        can serve it (:meth:`_seen_again`)."""
        if self._seen_again():
            self._recording = (level, keys)
        else:
            self.stats["unrecorded"] += 1

    def _count_forward(self) -> None:
        """Counts a training forward pass: per step (a change of the steps left marks a new
        step), so that the run's forward passes still to come are known under gradient
        accumulation too."""
        left = None if self._steps_left is None else self._steps_left()
        if left != self._left:
            if self._left is not None:
                self._per_step = max(self._per_step, self._in_step)
            self._left, self._in_step = left, 0
        self._in_step += 1

    def _seen_again(self) -> bool:
        """Whether a batch computed now can still be served: the run's training forward
        passes go on past this epoch's last batch, so its keys come again (True where the
        run's length, the epoch's plan or the forward passes of a step are not known). A
        row recorded in the run's last epoch is a copy never read: on the cut (b) such
        copies cost about 6% of the run's time (docs/decisions/036-cache-last-epoch.md)."""
        if self._left is None or not self._per_step or not self.plan or self.position < 0:
            return True
        to_come = self._left * self._per_step - self._in_step  # after this one
        return to_come > len(self.plan) - self.position - 1

    def _same_sample_shapes(self, level: _Level, inputs: list[torch.Tensor]) -> bool:
        """Whether the batch's inputs have the per-sample shapes of the level's first batch
        (a cached row has one shape); if not, the level is turned off, with a warning."""
        shapes = [tuple(t.shape[1:]) for t in inputs]
        if level.inputs is None:
            level.inputs = shapes
        if shapes == level.inputs:
            return True
        level.off = (
            f"a sample's inputs changed shape, from {level.inputs} to {shapes} (batches padded to their own longest "
            "sample?): a cached row has one shape; pad every batch to one length"
        )
        logger.warning("Egeria: activation cache off for %s: %s", level.boundary, level.off)
        level.close()
        return False

    def _start_agreed(self, keys: list[int], args: tuple, kwargs: dict) -> None:
        """A training forward pass under FSDP2 with several ranks: served only where every
        rank has the batch's rows (and, the first time, every rank finds the model a chain
        at the boundary), the prefix's FSDP2 units then not gathered; else computed (and
        recorded) on every rank, never through an older level."""
        level = None if self.off else self._level()
        output = None
        started = Stopwatch(_device(self.model))
        if level is not None and level.off is None:
            first = leaves((args, kwargs))
            if not first or first[0].dim() == 0 or first[0].shape[0] != len(keys):
                self._turn_off(f"the batch's first input does not have the {len(keys)} samples of its keys in dimension 0")
            elif self._same_sample_shapes(level, first):
                self.stats["batches"] += 1
                if level.has(keys) and level.serving is not False:
                    output = self._cached(level, keys, args, kwargs, check=False)
        checked_now = False
        if not self._agree(output is not None):
            output = None
        elif level.validated is None:  # every rank runs the same two forward passes
            checked_now = True
            level.validated = self._agree(self._validate(level, args, kwargs, len(keys)))
            if not level.validated and level.off is None:
                level.off = f"the model is not a chain at {level.boundary} on another rank"
                level.close()
        if output is not None and level.validated:
            self._stubs = install_stubs(
                self.model, level.blocks, level.boundary, output, level.specs, len(keys), level.units(self.model)
            )
            self.stats["served"] += 1
            if not checked_now:
                self._timing = (level, "serve", started)
            return
        if level is None or level.off is not None or self.off:
            return
        self.stats["computed"] += 1
        self._record(level, keys)  # each rank's own rows: no collective
        self._write_s = 0.0
        self._timing = (level, "compute", started)
        self._capture_specs(level, len(keys))

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._self_forward:
            return
        if self._timing is not None:
            level, kind, watch = self._timing
            watch.stop()
            self._unsettled.append((level, kind, watch, self._write_s))
            self._settle_timings()
        self._timing = None
        remove_stubs(self._stubs)
        self._stubs = []
        self._recording = None
        for handle in self._spec_handles:
            handle.remove()
        self._spec_handles = []

    def _on_boundary(self, level: _Level) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            recording = self._recording
            if recording is None or recording[0] is not level or self.off:
                return
            _, keys = recording
            started = time.perf_counter()
            self._unwritten = (level, keys, HostCopy(output))  # written at the next forward's start
            self._write_s += time.perf_counter() - started

        return hook

    def _flush(self) -> None:
        """Writes the boundary output copied during the previous forward pass (the copy had
        that long to finish, so a device's copy rarely makes the host wait)."""
        if self._unwritten is None:
            return
        (level, keys, copy), self._unwritten = self._unwritten, None
        if self.off or level.off is not None or self.levels.get(level.frozen) is not level:
            return  # the level was dropped or turned off (e.g. computing is cheaper) meanwhile
        try:
            self._write(level, keys, copy.get())
        except StoreFull as err:
            self._turn_off(f"a cache write failed ({err})")

    def _settle_timings(self) -> None:
        """Counts the timed forward passes whose time is known by now (on a device, once
        its events completed: the host never waits for them)."""
        waiting = []
        for level, kind, watch, write_s in self._unsettled:
            seconds = watch.seconds()
            if seconds is None:
                waiting.append((level, kind, watch, write_s))
                continue
            if kind == "compute":
                if level.serve_s:  # the trial compares serving with the computing just before it
                    continue
                level.compute_s.append(seconds - write_s)  # the cache's own copy excluded
            else:
                level.serve_s.append(seconds)
            if level.serving is None and self.serve == "auto":
                self._decide(level)
        self._unsettled = waiting

    def _capture_specs(self, level: _Level, batch: int) -> None:
        missing = [b for b in level.blocks if b not in level.specs]
        handles = []
        for name in missing:
            def grab(module: nn.Module, args: tuple, output: Any, name: str = name) -> None:
                level.specs[name] = Spec(output, batch)

            handles.append(mark(self.model.get_submodule(name).register_forward_hook(grab)))
        self._spec_handles = handles

    # -- levels ----------------------------------------------------------------------

    def _level(self) -> _Level | None:
        if self.frozen not in self.levels:
            partition = self._partition()
            if partition is None:
                return None
            level = _Level(self.frozen, partition)
            tied = [e for m in partition.modules[: self.frozen] for e in m.detached]
            if tied:  # the prefix reads a weight its owner still trains: its output is not fixed
                level.off = f"the frozen prefix reads tied weights through {', '.join(tied)}"
                logger.info("activation cache off for %s: %s", level.boundary, level.off)
            level.handle = mark(self.model.get_submodule(level.boundary).register_forward_hook(self._on_boundary(level)))
            self.levels[self.frozen] = level
        return self.levels[self.frozen]

    def _older_with(self, keys: list[int], level: _Level) -> _Level | None:
        older = [lv for f, lv in self.levels.items() if f < level.frozen and lv.validated and lv.has(keys)]
        return max(older, key=lambda lv: lv.frozen) if older else None

    def _write(self, level: _Level, keys: list[int], output: Any) -> None:
        tensors = leaves(output)
        if level.tables is None:
            if not self._make_tables(level, output, len(keys)):
                return
        for table, tensor in zip(level.tables, tensors):
            table.write(keys, tensor)
        if level.complete:  # shallower levels are no longer needed to build this one
            self._drop(lambda lv: lv.frozen < level.frozen)

    def _make_tables(self, level: _Level, output: Any, batch: int) -> bool:
        tensors = leaves(output)
        if not tensors or any(t.dim() == 0 or t.shape[0] != batch for t in tensors):
            level.off = "the boundary block's output is not batch-first"
            logger.info("activation cache off for %s: %s", level.boundary, level.off)
            return False
        storage = self.storage_dtype
        need = sum(
            self.rows * Table.row_bytes(t.shape[1:], storage if storage and t.is_floating_point() else t.dtype) for t in tensors
        )
        in_memory = sum(lv.nbytes for lv in self.levels.values() if lv.tables and lv.tables[0].kind == "memory")
        on_disk = sum(lv.nbytes for lv in self.levels.values() if lv.tables and lv.tables[0].kind == "disk")
        if in_memory + need <= self.memory_limit:
            make = lambda shape, dtype, st: MemoryTable(self.rows, shape, dtype, st)  # noqa: E731
            tier = "memory"
        elif on_disk + need <= self.disk_limit:
            short = self._short_of_space(need)
            if short is not None:
                level.off = short
                if not self._space_warned:
                    self._space_warned = True
                    logger.warning(
                        "Egeria: activation cache off for %s: %s; its frozen prefix is computed as without the cache",
                        level.boundary, short,
                    )
                else:
                    logger.info("activation cache off for %s: %s", level.boundary, short)
                return False
            make = lambda shape, dtype, st: DiskTable(self.rows, shape, dtype, st, directory=self.directory)  # noqa: E731
            tier = f"disk in {self.directory} (files unlinked once open)"
        else:
            level.off = (
                f"it needs {need / 2**20:.0f} MiB, over the memory limit ({self.memory_limit / 2**20:.0f} MiB) "
                f"and the disk limit ({self.disk_limit / 2**20:.0f} MiB)"
            )
            logger.info("activation cache off for %s: %s", level.boundary, level.off)
            return False
        try:
            level.tables = [
                make(t.shape[1:], t.dtype, storage if storage and t.is_floating_point() else None) for t in tensors
            ]
        except OSError as err:
            self._turn_off(f"a cache file could not be created ({err})")
            return False
        level.template = template_of(output)
        logger.info(
            "activation cache for %s: %s, %.1f MiB (%d keys, %.1f KiB each)",
            level.boundary, tier, need / 2**20, self.rows, need / self.rows / 1024,
        )
        return True

    def _short_of_space(self, need: int) -> str | None:
        """Why the disk folder cannot hold ``need`` more bytes, or None when it can (or its
        free space cannot be read: creating the file then fails, and says why)."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return None
        if free >= need:
            return None
        return (
            f"its disk table needs {need:,} bytes ({need / 2**20:.1f} MiB) and {self.directory} has "
            f"{free:,} bytes ({free / 2**20:.1f} MiB) free; pass cache_loader(directory=...) a folder with room, "
            "or lower disk_limit"
        )

    def _drop(self, which: Callable[[_Level], bool]) -> None:
        for frozen in [f for f, lv in self.levels.items() if which(lv)]:
            self.levels.pop(frozen).close()

    # -- reading ---------------------------------------------------------------------

    def _read(self, level: _Level, keys: list[int]) -> tuple[Any, list[Any]]:
        """The level's output for ``keys`` on the model's device, and the copy events its
        user must wait on (:func:`egeria.knowledge.device.wait_for`; none on the CPU). Runs in the
        prefetch thread too."""
        assert level.tables is not None
        device = _device(self.model)
        moved = [to_device(t.read(keys), device) for t in level.tables]
        return rebuild(level.template, [t for t, _ in moved]), [(t, e) for t, e in moved if e is not None]

    def _cached(self, level: _Level, keys: list[int], args: tuple, kwargs: dict, check: bool = True) -> Any:
        """The level's output for ``keys`` (prefetched, or read now), after the level's
        one-time checks (unless not ``check``: the caller runs them); None when it must be
        computed instead."""
        found, arrival, error = (False, None, None)
        if self.prefetcher is not None:
            found, arrival, error = self.prefetcher.take(level, self.position)
        if not found:
            self.stats["prefetch_misses"] += 1
            try:
                arrival = self._read(level, keys)
            except CorruptRows as err:
                error = err
        else:
            self.stats["prefetch_hits"] += 1
        output = None
        if arrival is not None:
            output, pending = arrival
            for tensor, event in pending:
                wait_for(tensor, event)
        if error is not None:
            self._forget_corrupt(level, keys, error)
            return None
        if level.validated is None and check:
            level.validated = self._validate(level, args, kwargs, len(keys))
            if not level.validated:
                return None
        return output if level.serving is not False else None

    def _forget_corrupt(self, level: _Level, keys: list[int], error: CorruptRows) -> None:
        """A read of ``keys`` found a corrupt row: the batch is computed, and its rows recorded again."""
        self.stats["corrupt"] += 1
        logger.warning("activation cache: %s; recomputing the batch", error)
        for table in level.tables or []:
            table.forget(keys)

    def _serve_part(self, level: _Level, keys: list[int], args: tuple, kwargs: dict, batch: int, started: Stopwatch) -> bool:
        """Serves the rows of the batch the level holds and runs the prefix on the others,
        recording them; False when the batch is to be computed whole (the level holds none of
        it, or all of it, serving lost its trial, or serving in part failed its check). A
        batch served at least half from the cache is timed as served."""
        if level.serving is False or level.sliceable is False or level.validated is False or level.tables is None:
            return False
        held = level.held(keys)
        if not held.any() or held.all():
            return False
        there, missing = np.flatnonzero(held).tolist(), np.flatnonzero(~held).tolist()
        try:
            output, pending = self._read(level, [keys[i] for i in there])
        except CorruptRows as err:
            self._forget_corrupt(level, keys, err)
            return False
        for tensor, event in pending:
            wait_for(tensor, event)
        checked_now = level.sliceable is None
        if checked_now and not self._check_part(level, args, kwargs, batch, there, missing):
            return False
        computed_keys = [keys[i] for i in missing]

        keep = self._seen_again()

        def record(rows: Any) -> None:  # written at the next forward's start, as a recorded batch is
            if keep:
                self._unwritten = (level, computed_keys, HostCopy(rows))

        self._stubs = install_part_stubs(
            self.model, level.blocks, level.boundary, leaves(output), there, missing, batch, record
        )
        self.stats["partly"] += 1
        if not checked_now and 2 * len(there) >= batch:
            self._timing = (level, "serve", started)
        return True

    def _check_part(self, level: _Level, args: tuple, kwargs: dict, batch: int, there: list[int], missing: list[int]) -> bool:
        """Runs the batch whole and in part (eval mode, no gradients), the part's held rows
        taken from the whole run's own boundary output: do the model's outputs agree? Sets
        ``level.sliceable``; a model that does not (a block input that is batch-sized but not
        per sample) has such batches computed whole, and the level serves whole batches still."""
        ok, why = self._both_ways(
            args, kwargs, level.boundary,
            lambda exact: install_part_stubs(
                self.model, level.blocks, level.boundary, [t[there] for t in leaves(exact)], there, missing, batch
            ),
            "running the prefix on some rows gives other model outputs",
        )
        level.sliceable = ok
        if ok:
            logger.info("activation cache for %s: a batch held in part is served in part", level.boundary)
        else:
            logger.info("activation cache for %s: a batch held in part is computed whole (%s)", level.boundary, why)
        return ok

    def _validate(self, level: _Level, args: tuple, kwargs: dict, batch: int) -> bool:
        """Runs the batch both ways (eval mode, no gradients): is the model a chain here?"""
        # the boundary's own output, not the stored one: a lower storage precision is not a
        # reason to call the model a non-chain
        ok, why = self._both_ways(
            args, kwargs, level.boundary,
            lambda exact: install_stubs(self.model, level.blocks, level.boundary, exact, level.specs, batch),
            "feeding the cached output gives other model outputs",
        )
        if not ok:
            level.off = f"the model is not a chain at {level.boundary} ({why})"
            logger.warning("activation cache off for %s: %s", level.boundary, level.off)
            level.close()
        return ok

    def _both_ways(
        self, args: tuple, kwargs: dict, boundary: str, stub: Callable[[Any], list[nn.Module]], differ: str
    ) -> tuple[bool, str]:
        """Runs the batch whole, then with the stubs ``stub`` installs given the boundary
        block's own output (eval mode, no gradients, none of the cache's hooks acting):
        whether the model's outputs agree, and why not (``differ``, or the error raised)."""
        self._self_forward = True
        exact: list[Any] = []
        handle = mark(self.model.get_submodule(boundary).register_forward_hook(lambda m, a, out: exact.append(out)))
        try:
            with self._eval_forward():
                whole = self.model(*args, **kwargs)
                handle.remove()
                with stubbed(stub(exact[0])):
                    skipped = self.model(*args, **kwargs)
        except Exception as err:
            return False, f"{type(err).__name__}: {err}"
        finally:
            handle.remove()
            self._self_forward = False
        return same_outputs(whole, skipped), differ

    def _decide(self, level: _Level) -> None:
        """Serve or compute, once serving has been timed a few times: the median forward
        pass served from the cache against the median of as many computed just before the
        first of them (not the level's whole history: a load that came and went since the
        level began recording would decide the choice, not the cache)."""
        if len(level.serve_s) < _TIMING_SAMPLES:
            return
        serve = statistics.median(level.serve_s)
        if not level.compute_s:  # every recording pass ran through an older level: nothing to weigh
            level.serving = True
            self.decisions.append({"boundary": level.boundary, "frozen": level.frozen,
                                   "serve_ms": round(1e3 * serve, 2), "compute_ms": None, "serving": True})
            logger.info("activation cache for %s: serving from the cache (no forward pass computed its whole prefix "
                        "to compare with)", level.boundary)
            return
        compute = statistics.median(list(level.compute_s)[-_TIMING_SAMPLES:])
        level.serving = serve < compute
        self.decisions.append({
            "boundary": level.boundary, "frozen": level.frozen, "serve_ms": round(1e3 * serve, 2),
            "compute_ms": round(1e3 * compute, 2), "serving": level.serving,
        })
        logger.info(
            "activation cache for %s: a forward pass takes %.1f ms served from the cache, %.1f ms computing the "
            "prefix just before: %s", level.boundary, 1e3 * serve, 1e3 * compute,
            "serving from the cache" if level.serving else "computing is cheaper, computing",
        )
        if not level.serving:
            level.off = "computing the prefix is cheaper than reading the cache"
            level.close()  # frees its memory or disk; the level records nothing more
            if self.prefetcher is not None:
                self.prefetcher.clear()

    def _prefetch_ahead(self) -> None:
        if self.prefetcher is None or self.off:
            return
        level = self.levels.get(self.frozen)
        if level is None or level.off or level.serving is False:
            return
        for position in range(self.position + 1, min(self.position + 1 + self.prefetcher.depth, len(self.plan))):
            keys = self.plan[position]
            if level.has(keys):
                self.prefetcher.schedule(level, position, keys)

    # -- life cycle ---------------------------------------------------------------------

    def _turn_off(self, reason: str) -> None:
        if self.off is None:
            self.off = reason
            logger.warning("Egeria: activation caching turned off: %s; training goes on computing every layer", reason)
        self._drop(lambda level: True)

    def summary(self) -> dict:
        """Counts, prefetch hit rate, the folder disk tables go in, and each level's tier,
        bytes, files and choice."""
        served = self.stats["prefetch_hits"] + self.stats["prefetch_misses"]
        return {
            **self.stats,
            "prefetch_hit_rate": self.stats["prefetch_hits"] / served if served else None,
            "off": self.off,
            "directory": self.directory,  # where disk tables go (their files are unlinked once open)
            "decisions": list(self.decisions),  # a level's times and choice outlive the level
            "levels": {
                lv.boundary: {
                    "frozen": lv.frozen,
                    "tier": None if not lv.tables else lv.tables[0].kind,
                    "bytes": lv.nbytes,
                    # disk tables: (file, bytes per row) of each output tensor; the file was
                    # created under that name and unlinked at once (it lives while it is open)
                    "files": [(t.path, t.stride) for t in lv.tables or [] if t.kind == "disk"],
                    "complete": lv.complete,
                    "serving": lv.serving,
                    "off": lv.off,
                }
                for lv in self.levels.values()
            },
        }

    def close(self) -> None:
        remove_stubs(self._stubs)
        self._stubs = []
        self._unwritten = None
        for handle in self._handles:
            handle.remove()
        self._drop(lambda level: True)
        if self.prefetcher is not None:
            self.prefetcher.close()


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
