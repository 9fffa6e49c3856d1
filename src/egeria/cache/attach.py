"""Wrapping a training loader for the activation cache: the checks and the wiring behind
``Egeria.cache_loader``."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ..checks import check_int
from ..modes import OwnPasses
from ..partition import Partition
from .datasets import Keyed, random_reason
from .loader import CachedLoader
from .manager import ActivationCache

__all__ = ["attach_loader"]

logger = logging.getLogger(__name__)


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
) -> tuple[Any, ActivationCache | None]:
    """Wraps ``loader`` so that its batches feed ``cache`` (created when None).

    Returns:
        The loader to iterate (``loader`` itself when its data is random, with a warning)
        and the cache.

    Raises:
        ValueError: a bad option, a loader that cannot be wrapped, or a second loader
            with another number of samples.
    """
    for name, value in (("memory_limit", memory_limit), ("disk_limit", disk_limit), ("prefetch", prefetch)):
        check_int(value, f"cache_loader {name}", minimum=0)
    if serve not in ("auto", "always"):
        raise ValueError(f"cache_loader(serve={serve!r}): use 'auto' or 'always'")
    if storage_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"cache_loader(storage_dtype={storage_dtype!r}): use None, torch.bfloat16 or torch.float16")
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
        cache = ActivationCache(
            model,
            partition,
            rows,
            memory_limit=memory_limit,
            disk_limit=disk_limit,
            directory=directory,
            storage_dtype=storage_dtype,
            prefetch=prefetch,
            serve=serve,
            internal=own.is_active,
            eval_forward=own.eval_forward,
        )
        cache.set_frozen(frozen)
    wrapped.on_epoch, wrapped.on_batch = cache.on_epoch, cache.on_batch
    return wrapped, cache
