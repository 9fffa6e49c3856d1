"""A data loader that knows each batch's sample keys and the epoch's future order.

:class:`CachedLoader` rebuilds the user's ``DataLoader`` over :class:`~.datasets.Keyed`
data and a batch sampler that draws the whole epoch's order when the epoch starts, so the
prefetcher knows every batch to come. It yields the user's batches unchanged and tells
the cache the keys of each batch just before the loop sees it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import default_collate

from .datasets import Augmented, Keyed

__all__ = ["CachedLoader"]


class _PlannedBatches:
    """A batch sampler that lists the epoch's batches when the epoch starts."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.plan: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        # Drawn at the first batch, as a lazy sampler draws: the loader's generator is
        # used in the same order as without the cache, so batches come in the same order.
        self.plan = [list(b) for b in self.batch_sampler]
        yield from self.plan

    def __len__(self) -> int:
        return len(self.batch_sampler)


class _KeyedCollate:
    """Collates ``(key, item)`` pairs into ``(keys, collate(items))``."""

    def __init__(self, collate: Callable[[list], Any]) -> None:
        self.collate = collate

    def __call__(self, pairs: list[tuple[int, Any]]) -> tuple[torch.Tensor, Any]:
        return torch.tensor([k for k, _ in pairs], dtype=torch.long), self.collate([item for _, item in pairs])


class CachedLoader:
    """Iterates like ``loader``; the cache learns each batch's keys and the future order.

    Args:
        loader: a ``DataLoader`` over a map-style dataset with a batch size.
        on_epoch: called with the epoch's planned keys, a list per batch.
        on_batch: called with a batch's position in the epoch and its keys.

    Raises:
        ValueError: for an iterable-style dataset or a loader without batches, and for
            :class:`~.datasets.Augmented` data with persistent workers (they would not see
            the epoch change).
    """

    def __init__(self, loader: DataLoader, on_epoch: Callable[[list[list[int]]], None], on_batch: Callable[[int, list[int]], None]) -> None:
        if not isinstance(loader, DataLoader):
            raise ValueError(f"cache_loader needs a torch.utils.data.DataLoader, got {type(loader).__name__}")
        if loader.batch_sampler is None:
            raise ValueError("cache_loader needs a DataLoader with batch_size (or batch_sampler), not batch_size=None")
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            raise ValueError("cache_loader needs a map-style dataset (samples addressed by index)")
        dataset = loader.dataset
        if isinstance(dataset, Augmented) and loader.persistent_workers:
            raise ValueError("Augmented data with persistent_workers=True: workers would not see the epoch; turn persistent workers off")
        self.dataset = dataset
        self.keyed = Keyed(dataset)
        self.batches = _PlannedBatches(loader.batch_sampler)
        collate = loader.collate_fn if loader.collate_fn is not None else default_collate
        self.loader = DataLoader(
            self.keyed,
            batch_sampler=self.batches,
            num_workers=loader.num_workers,
            collate_fn=_KeyedCollate(collate),
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context if loader.num_workers else None,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
            persistent_workers=loader.persistent_workers,
        )
        self.on_epoch = on_epoch
        self.on_batch = on_batch
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.dataset, Augmented):
            self.dataset.set_epoch(self.epoch)
        for position, (keys, batch) in enumerate(self.loader):
            if position == 0:  # the epoch's order is drawn by now
                self.on_epoch([[self.keyed.key(i) for i in b] for b in self.batches.plan])
            self.on_batch(position, keys.tolist())
            yield batch
        self.epoch += 1
