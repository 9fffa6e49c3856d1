"""Image augmentation for the benchmark tasks: a random crop of a padded image and a
random horizontal flip, drawn from a generator (so that :class:`egeria.cache.Augmented`
makes it a pure function of the sample and its variant)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["crop_flip"]


def crop_flip(pad: int, fill: float = 0.0) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """``transform(image, generator)``: pads a ``(C, H, W)`` image by ``pad`` pixels of value
    ``fill`` on every side, crops an ``H x W`` window at an offset drawn uniformly from
    ``0..2*pad`` in each direction, and flips it left-right with probability 1/2.

    Args:
        pad: pixels of padding (the largest shift), ``>= 0``.
        fill: the padding's value, in the image's units (for normalised images, the
            normalised value of a black pixel).

    Raises:
        ValueError: naming ``pad`` when it is not a non-negative integer.
    """
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"crop_flip pad must be a non-negative integer, got pad={pad!r}")

    def transform(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if image.dim() != 3:
            raise ValueError(f"crop_flip takes one (C, H, W) image, got shape {tuple(image.shape)}")
        height, width = image.shape[-2:]
        dy, dx = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,), generator=generator))
        flip = bool(torch.rand((), generator=generator) < 0.5)
        padded = F.pad(image, (pad, pad, pad, pad), value=fill) if pad else image
        out = padded[:, dy : dy + height, dx : dx + width]
        return out.flip(-1) if flip else out.contiguous()

    return transform
