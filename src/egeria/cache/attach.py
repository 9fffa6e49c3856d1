"""Wrapping a training loader for the activation cache: :class:`CacheLoading`, the
engine's ``cache_loader`` and ``cache_stats``, and the checks and wiring behind them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..checks import check_int
from ..modes import OwnPasses
from ..partition import Partition
from .datasets import Keyed, random_reason
from .loader import CachedLoader
from .manager import ActivationCache

if TYPE_CHECKING:
    from ..distributed import Ranks
    from ..freezing import FrozenPrefix
    from ..layers import RunLayers

__all__ = ["CacheLoading", "attach_loader"]

logger = logging.getLogger(__name__)


def _check_options(memory_limit: int, disk_limit: int, prefetch: int, serve: str, storage_dtype: torch.dtype | None) -> None:
    for name, value in (("memory_limit", memory_limit), ("disk_limit", disk_limit), ("prefetch", prefetch)):
        check_int(value, f"cache_loader {name}", minimum=0)
    if serve not in ("auto", "always"):
        raise ValueError(f"cache_loader(serve={serve!r}): use 'auto' or 'always'")
    if storage_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"cache_loader(storage_dtype={storage_dtype!r}): use None, torch.bfloat16 or torch.float16")


def _new_cache(rows: int, frozen: int, own: OwnPasses, **options: Any) -> ActivationCache:
    """An :class:`ActivationCache` of ``rows`` sample keys told the frozen count."""
    cache = ActivationCache(rows=rows, internal=own.is_active, eval_forward=own.eval_forward, **options)
    cache.set_frozen(frozen)
    return cache


def attach_loader(
    loader: Any,
    cache: ActivationCache | None,
    *,
    model: nn.Module,
    partition: Callable[[], Partition | None],
    own: OwnPasses,
    frozen: int,
    memory_limit: int,
    disk_limit: int,
    directory: str | None,
    storage_dtype: torch.dtype | None,
    prefetch: int,
    serve: str,
    agree: Callable[[bool], bool] | None = None,
    steps_left: Callable[[], int | None] | None = None,
) -> tuple[Any, ActivationCache | None]:
    """Wraps ``loader`` so that its batches feed ``cache`` (created when None).

    Returns:
        The loader to iterate (``loader`` itself when its data is random, with a warning)
        and the cache.

    Raises:
        ValueError: a bad option, a loader that cannot be wrapped, or a second loader
            with another number of samples.
    """
    _check_options(memory_limit, disk_limit, prefetch, serve, storage_dtype)
    dataset = getattr(loader, "dataset", None)
    reason = None if dataset is None else random_reason(dataset)
    if reason is not None:
        logger.warning("Egeria: not caching activations: %s", reason)
        return loader, cache
    wrapped = CachedLoader(loader, lambda plan: None, lambda position, keys: None)  # checks the loader
    rows = len(dataset) * Keyed(dataset).variants
    if cache is not None and cache.rows != rows:
        raise ValueError(
            f"cache_loader: this Egeria caches {cache.rows} sample keys, the new loader has {rows}; "
            "wrap one training loader"
        )
    if cache is None:
        cache = _new_cache(
            rows, frozen, own, model=model, partition=partition, memory_limit=memory_limit, disk_limit=disk_limit,
            directory=directory, storage_dtype=storage_dtype, prefetch=prefetch, serve=serve, agree=agree,
            steps_left=steps_left,
        )
    wrapped.on_epoch, wrapped.on_batch = cache.on_epoch, cache.on_batch
    return wrapped, cache


class CacheLoading:
    """The activation cache's methods of :class:`~egeria.engine.Egeria`, which holds the
    attributes below (the cache itself once :meth:`cache_loader` made it) and tells the
    cache every change of the frozen count."""

    model: nn.Module
    _cache: ActivationCache | None
    _compiled: bool
    _fsdp2_ranks: Ranks | None
    _layers: RunLayers
    _own: OwnPasses
    _prefix: FrozenPrefix | None
    steps: int
    total_steps: int | None

    @property
    def cache_stats(self) -> dict:
        """The activation cache's counts (batches served whole, served in part, computed; prefetch hit rate),
        each cache level's tier, size and choice, and each timed choice to serve or compute
        (``decisions``); empty without :meth:`cache_loader`."""
        return {} if self._cache is None else self._cache.summary()

    def cache_loader(
        self,
        loader: Any,
        *,
        memory_limit: int = 2 * 2**30,
        disk_limit: int = 16 * 2**30,
        directory: str | None = None,
        storage_dtype: torch.dtype | None = None,
        prefetch: int = 4,
        serve: str = "auto",
    ) -> Any:
        """Wraps the training ``DataLoader`` so frozen modules' outputs are cached and their
        forward pass is skipped (see :mod:`egeria.cache`). Iterate over what it returns
        instead of ``loader``; batches are unchanged.

        Args:
            memory_limit: bytes of cached activations kept in memory.
            disk_limit: bytes of cached activations kept on disk when memory is too small.
            directory: the folder disk caches go in (the system's temporary folder by
                default: ``$TMPDIR``, else ``/tmp`` on Linux). A disk cache is chosen only
                where the folder has room for it, is named in ``cache_stats["directory"]``
                and an INFO line, and its file is unlinked as soon as it is open, so none
                outlives the process, even one that is killed.
            storage_dtype: ``torch.bfloat16`` or ``torch.float16`` to store floating
                activations in half the bytes; not exact (the default keeps their dtype).
            prefetch: batches read ahead in a background thread (0: none).
            serve: ``"auto"`` serves a frozen prefix from the cache only where a forward
                pass is measured to be faster that way; ``"always"`` serves wherever it can.

        Returns:
            The wrapped loader, or ``loader`` itself when its data is random (a transform
            that is not a pure function of the sample; a warning says why).

        Raises:
            ValueError: for a bad limit, dtype or loader, or a model under ``torch.compile``.

        Under FSDP2 (``fully_shard``) with several ranks every rank must wrap its loader: a
        batch is served only where every rank has its rows (one small all-reduce per
        training forward pass), and then the FSDP2 units wholly inside the frozen prefix are
        not gathered.
        """
        self._check_cacheable()
        # Under FSDP2 a batch is served only where every rank serves it: its frozen units'
        # all-gathers are then skipped on every rank at once.
        ranks = self._fsdp2_ranks
        wrapped, self._cache = attach_loader(
            loader,
            self._cache,
            model=self.model,
            partition=lambda: self._layers.partition,
            own=self._own,
            frozen=0 if self._prefix is None else self._prefix.settled,
            memory_limit=memory_limit,
            disk_limit=disk_limit,
            directory=directory,
            storage_dtype=storage_dtype,
            prefetch=prefetch,
            serve=serve,
            agree=None if ranks is None else lambda flag: ranks.all_true(flag, "a training forward pass"),
            steps_left=self._steps_left,
        )
        return wrapped

    def cache_keyed_batches(
        self,
        rows: int,
        *,
        memory_limit: int = 2 * 2**30,
        disk_limit: int = 16 * 2**30,
        directory: str | None = None,
        storage_dtype: torch.dtype | None = None,
        serve: str = "auto",
    ) -> None:
        """Caches frozen modules' outputs for training batches that carry their own sample
        keys (:mod:`egeria.cache.batchkeys`): the Hugging Face ``Trainer``'s, whose loader
        :class:`egeria.integrations.hf.EgeriaCallback` makes so. The options are
        :meth:`cache_loader`'s; nothing is read ahead (``prefetch`` 0).

        Args:
            rows: the number of sample keys (the dataset's items times its augmentation
                variants; :attr:`egeria.cache.batchkeys.KeyedItems.rows`).

        Raises:
            ValueError: for a bad limit, dtype or count, a second cache, a model under
                ``torch.compile``, or FSDP2 with several ranks (not supported here).
        """
        self._check_cacheable()
        check_int(rows, "cache_keyed_batches rows")
        if self._cache is not None:
            raise ValueError("cache_keyed_batches: this Egeria caches activations already; cache one training loader")
        if self._fsdp2_ranks is not None:
            raise ValueError(
                "cache_keyed_batches does not support FSDP2 with several ranks (the ranks would have to agree on "
                "each batch); train without the cache there"
            )
        _check_options(memory_limit, disk_limit, 0, serve, storage_dtype)
        self._cache = _new_cache(
            rows, 0 if self._prefix is None else self._prefix.settled, self._own, model=self.model,
            partition=lambda: self._layers.partition, memory_limit=memory_limit, disk_limit=disk_limit,
            directory=directory, storage_dtype=storage_dtype, prefetch=0, serve=serve, keys_in_batch=True,
        )

    def _steps_left(self) -> int | None:
        """The training steps the run has still to take (None: its length is not known)."""
        return None if self.total_steps is None else max(self.total_steps - self.steps, 0)

    def _check_cacheable(self) -> None:
        if self._compiled:
            raise ValueError(
                "the activation cache skips the frozen blocks by swapping their forward, which a torch.compile "
                "graph does not see; use cache_loader with an uncompiled model (or compile without the cache)"
            )
