"""Sample keys for the activation cache, and augmentation that survives caching.

A cached activation is only correct when a sample's input is the same every time it is
read. :class:`Augmented` makes augmentation a pure function of (sample index, variant):
each sample has ``variants`` fixed augmented versions and the epoch picks one of them,
so the cache holds ``variants`` entries per sample and the training still sees varied
inputs. :func:`random_reason` tells a transform that is random in any other way.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from ..checks import check_int
from ..nested import map_tensors

__all__ = ["Augmented", "Keyed", "random_reason"]

_MIX = 0x9E3779B97F4A7C15  # a large odd constant for mixing seeds


def _position(index: int, length: int) -> int:
    """``index`` as a position in ``0..length-1``: a negative index names the same sample
    as ``index + length``, so it gets the same variant, transform and cache key."""
    position = index + length if index < 0 else index
    if not 0 <= position < length:
        raise IndexError(f"index {index} is out of range for a dataset of {length} items")
    return position


class Augmented(Dataset):
    """``dataset`` with a pure, keyed augmentation.

    Item ``i`` in epoch ``e`` is ``transform(sample, generator)`` where ``generator`` is
    seeded from ``(seed, i, v)`` and the variant ``v`` in ``0..variants-1`` is drawn from
    ``(seed, e, i)``. The same (index, variant) always gives the same input.

    Args:
        dataset: items ``(x, *rest)``; the transform applies to ``x``.
        transform: ``transform(x, generator) -> x``, drawing randomness only from ``generator``.
        variants: augmented versions cached per sample.
        seed: seed of the variants.
    """

    def __init__(self, dataset: Dataset, transform: Callable[[Any, torch.Generator], Any], *, variants: int = 4, seed: int = 0) -> None:
        check_int(variants, "variants")
        self.dataset = dataset
        self.transform = transform
        self.variants = variants
        self.seed = seed
        self.epoch = 0
        # The epoch's variants drawn so far (-1: not yet): through the activation cache a
        # sample's variant is read three times an epoch (the loader's plan, its key, its
        # transform), and each draw seeds a fresh generator (a fifth of suite task (b)'s
        # crop-and-flip per sample): drawn once, read from here after.
        self._drawn = array("i")

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch``: its variants are drawn afresh from ``(seed, epoch, i)``."""
        if epoch != self.epoch:
            self._drawn = array("i")
        self.epoch = epoch

    def variant(self, index: int) -> int:
        """The variant, in ``0..variants-1``, item ``index`` takes this epoch."""
        return self._variant_at(_position(index, len(self)))

    def _variant_at(self, position: int) -> int:
        """The variant of the sample at ``position`` (in ``0..len-1``) this epoch."""
        if self.variants == 1:
            return 0
        if not self._drawn:
            self._drawn = array("i", [-1]) * len(self)
        drawn = self._drawn[position]
        if drawn < 0:
            g = torch.Generator().manual_seed((self.seed * _MIX + self.epoch * 1_000_003 + position) % (2**63))
            drawn = self._drawn[position] = int(torch.randint(self.variants, (1,), generator=g))
        return drawn

    def key(self, index: int) -> int:
        """The cache key of item ``index`` in the current epoch."""
        position = _position(index, len(self))
        return position * self.variants + self._variant_at(position)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        position = _position(index, len(self))
        sample = self.dataset[position]
        g = torch.Generator().manual_seed((self.seed * _MIX + position * 7919 + self._variant_at(position)) % (2**63))
        if isinstance(sample, tuple):
            return (self.transform(sample[0], g), *sample[1:])
        return self.transform(sample, g)


class Keyed(Dataset):
    """``dataset`` whose item ``i`` is ``(key, item)``: the key is ``i``, or for
    :class:`Augmented` data the (index, variant) key of the current epoch."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.variants = dataset.variants if isinstance(dataset, Augmented) else 1

    def key(self, index: int) -> int:
        if isinstance(self.dataset, Augmented):
            return self.dataset.key(index)
        return _position(index, len(self))

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return self.key(index), self.dataset[index]


def random_reason(dataset: Dataset, probes: int = 2) -> str | None:
    """Why ``dataset`` is not a pure function of the index (two reads of the same items
    differ), or None. :class:`Augmented` data is pure within an epoch by construction."""
    if isinstance(dataset, Augmented):
        return None
    for index in range(min(probes, len(dataset))):  # type: ignore[arg-type]
        first, second = dataset[index], dataset[index]
        if not _same(first, second):
            return (
                f"reading item {index} twice gave different inputs: its transform is random; wrap the data in "
                "egeria.cache.Augmented(dataset, transform, variants=V) so that augmentation is a pure "
                "function of (sample, variant)"
            )
    return None


def _same(a: Any, b: Any) -> bool:
    leaves_a: list = []
    leaves_b: list = []
    map_tensors(a, lambda t: leaves_a.append(t) or t)
    map_tensors(b, lambda t: leaves_b.append(t) or t)
    if len(leaves_a) != len(leaves_b):
        return False
    if not all(torch.equal(x, y) for x, y in zip(leaves_a, leaves_b)):
        return False
    strip = lambda v: map_tensors(v, lambda t: None)  # noqa: E731
    return strip(a) == strip(b)
