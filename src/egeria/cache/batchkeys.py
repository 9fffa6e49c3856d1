"""Sample keys carried inside each batch, for a training loop whose loader is not the
user's to wrap (the Hugging Face ``Trainer``'s).

:class:`~.loader.CachedLoader` tells the cache a batch's keys as the loop takes the batch
from the loader. A loop that reads batches ahead (the ``Trainer`` takes every micro-batch
of an optimizer step before the first forward pass, and accelerate's loader one batch more)
would pair keys with the wrong forward pass that way. Here the keys travel in the batch
itself and are read where they are used:

* :class:`KeyedItems` wraps the map-style training dataset: item ``i`` is the dataset's
  own item (a dict, as the ``Trainer`` feeds ``model(**batch)``) as a :class:`KeyedItem`
  that also holds its cache key (:class:`~.datasets.Keyed`'s key: the index, or the
  (index, variant) key of :class:`~.datasets.Augmented` data). The sampler, shuffling and
  lengths are those of the dataset itself.
* :class:`KeyedCollate` wraps the loader's collate function (the ``Trainer``'s, with its
  column removal and the user's data collator inside): it collates the items as before and
  adds the batch's keys under :data:`KEYS`.
* the cache's forward pre-hook, run before any other (``prepend``), pops :data:`KEYS` from
  the model's keyword arguments, so the model never sees it
  (:class:`~.manager.ActivationCache` with ``keys_in_batch``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from .datasets import Augmented, Keyed

__all__ = ["KEYS", "KeyedItem", "KeyedItems", "KeyedCollate", "keyed_items_reason"]

KEYS = "egeria_sample_keys"  # the batch entry that holds the batch's sample keys (a long tensor)


class KeyedItem(dict):
    """A dataset item (a dict, copied shallowly) with its cache key in ``key``."""

    def __init__(self, key: int, item: Mapping) -> None:
        super().__init__(item)
        self.key = key

    def __reduce__(self) -> tuple:  # to and from loader workers with the key
        return KeyedItem, (self.key, dict(self))


class KeyedItems(Dataset):
    """``dataset`` whose item ``i`` is its own item ``i`` as a :class:`KeyedItem`.

    Raises (at reading):
        ValueError: an item that is not a dict.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.keyed = Keyed(dataset)

    @property
    def variants(self) -> int:
        return self.keyed.variants

    @property
    def rows(self) -> int:
        """Sample keys: items times augmentation variants."""
        return len(self) * self.variants

    def set_epoch(self, epoch: int) -> None:
        """Passes the epoch to :class:`~.datasets.Augmented` data (a loop's loader calls it
        at each epoch's start)."""
        if isinstance(self.dataset, Augmented):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> KeyedItem:
        item = self.dataset[index]
        if not isinstance(item, Mapping):
            raise ValueError(
                f"the activation cache under a Trainer needs dataset items that are dicts (the Trainer calls "
                f"model(**batch)); item {index} is a {type(item).__name__}"
            )
        return KeyedItem(self.keyed.key(index), item)


class KeyedCollate:
    """Collates :class:`KeyedItem`s with ``collate`` and adds their keys as ``batch[KEYS]``.

    Raises:
        ValueError: ``collate`` made a batch that is not a dict (the keys have nowhere to go).
    """

    def __init__(self, collate: Callable[[list], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[KeyedItem]) -> Any:
        keys = torch.tensor([item.key for item in items], dtype=torch.long)
        batch = self.collate(items)
        if not isinstance(batch, MutableMapping):
            raise ValueError(
                f"the activation cache under a Trainer needs a data collator that makes dict batches; it made a "
                f"{type(batch).__name__}"
            )
        batch[KEYS] = keys
        return batch


def keyed_items_reason(dataset: Any) -> str | None:
    """Why batches of ``dataset`` cannot carry their keys (not map-style, or its first item
    is not a dict), or None."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return f"the training dataset ({type(dataset).__name__}) is not map-style: its samples have no index to key them"
    if not hasattr(dataset, "__len__") or len(dataset) == 0:
        return f"the training dataset ({type(dataset).__name__}) has no length or no items"
    first = dataset[0]
    if not isinstance(first, Mapping):
        return f"its items are {type(first).__name__}s, not dicts: the Trainer's batches are dicts (model(**batch))"
    return None
