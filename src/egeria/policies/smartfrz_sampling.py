"""SmartFRZ's "layer tailoring": a fixed, seeded random sample of each layer module's
weights, read at step boundaries into a window of snapshots.

One predictor then serves layer modules and models of any size: every module is seen
through the same number of values (``size``, 1,024 as in SmartFRZ). The sample is drawn
once per module from a ``torch.Generator`` seeded by ``(seed, module index)``, so it is the
same set of weights in every process and every run (no Python hash randomisation, no
global RNG touched). Reading a sample copies ``size`` values per module with one
``index_select`` per parameter tensor; no whole layer is ever copied.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from ..partition import Partition

__all__ = ["ModuleSample", "sample_indices", "build_samples", "read_sample", "normalise_window", "Windows"]

_MIX = 1_000_003  # seed * _MIX + index: distinct generator seeds per (seed, module index)


@dataclass(frozen=True)
class ModuleSample:
    """Which of one layer module's weights are sampled.

    Attributes:
        params: the sampled parameters' names (its weight matrices and kernels: the
            parameters of two or more dimensions; all of its parameters where it has none).
        picks: for each of ``params``, the flat indices read from it, in sample order.
    """

    params: tuple[str, ...]
    picks: tuple[torch.Tensor, ...]


def sample_indices(total: int, size: int, seed: int, index: int) -> torch.Tensor:
    """``size`` flat indices into ``total`` values, sorted: distinct where ``total >= size``,
    drawn with replacement from a smaller module.

    Args:
        total: how many values the module's sampled parameters hold.
        size: how many to read.
        seed: the policy's sampling seed.
        index: the module's position in the partition (each module gets its own draw).
    """
    if total <= 0:
        raise ValueError(f"a layer module with {total} weights cannot be sampled")
    generator = torch.Generator().manual_seed(seed * _MIX + index)
    if total >= size:
        picks = torch.randperm(total, generator=generator)[:size]
    else:
        picks = torch.randint(total, (size,), generator=generator)
    return picks.sort().values


def build_samples(model: nn.Module, partition: Partition, count: int, size: int, seed: int) -> list[ModuleSample]:
    """The samples of the first ``count`` layer modules of ``partition``."""
    named = dict(model.named_parameters())
    samples = []
    for index, module in enumerate(partition.modules[:count]):
        params = [name for name in module.params if name in named]
        matrices = [name for name in params if named[name].dim() >= 2]
        chosen = matrices or params
        sizes = [named[name].numel() for name in chosen]
        flat = sample_indices(sum(sizes), size, seed, index)
        picks, start = [], 0
        for numel in sizes:  # split the flat indices over the parameters they fall in
            inside = flat[(flat >= start) & (flat < start + numel)] - start
            picks.append(inside)
            start += numel
        samples.append(ModuleSample(tuple(chosen), tuple(picks)))
    return samples


@torch.no_grad()
def read_sample(named: dict[str, torch.Tensor], sample: ModuleSample) -> torch.Tensor:
    """The sampled values of one module now, float32, on the parameters' device: shape (size,)."""
    parts = []
    for name, picks in zip(sample.params, sample.picks):
        if picks.numel():
            flat = named[name].detach().reshape(-1)
            parts.append(flat.index_select(0, picks.to(flat.device)).float())
    return torch.cat(parts)


def normalise_window(window: torch.Tensor, unit: float = 0.01) -> torch.Tensor:
    """What the predictor reads of a window: each weight's motion, scale-free.

    Each snapshot becomes its deviation from the window's mean of that weight, in units of
    ``unit`` times the newest snapshot's standard deviation across the sample, passed
    through ``asinh`` (linear near 0, logarithmic beyond). The weights' own values are
    removed (a predictor cannot learn the weights of the runs it was trained on), only how
    far and how consistently they moved is left, comparable across layers of any size and
    initialisation scale.

    Args:
        window: (..., T, S) snapshots, oldest first.
        unit: the deviation read as 1 (1% of the layer's weight spread).

    Returns:
        (..., T, S) float32.
    """
    window = window.float()
    spread = window[..., -1:, :].std(dim=-1, keepdim=True).clamp_min(1e-12)
    deviation = (window - window.mean(dim=-2, keepdim=True)) / (spread * unit)
    return torch.asinh(deviation)


class Windows:
    """The last ``length`` samples of each watched module (oldest first)."""

    def __init__(self, modules: int, length: int) -> None:
        self.length = length
        self.snapshots: list[deque[torch.Tensor]] = [deque(maxlen=length) for _ in range(modules)]

    def add(self, index: int, values: torch.Tensor) -> None:
        self.snapshots[index].append(values)

    def full(self, index: int) -> bool:
        return len(self.snapshots[index]) == self.length

    def stacked(self, index: int) -> torch.Tensor:
        """(held, size) float32 on the CPU."""
        return torch.stack([s.to("cpu") for s in self.snapshots[index]])

    def clear(self, index: int) -> None:
        self.snapshots[index].clear()
