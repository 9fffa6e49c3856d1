"""A small VGG-style network: stacks of 3x3 convolution units with max pooling between
stages, no residual connections, global average pooling into one linear classifier."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ConvUnit", "VGG", "vgg"]


class ConvUnit(nn.Module):
    """``relu(bn(conv3x3(x)))``, the network's repeated block (one layer module's worth).

    Args:
        in_channels, out_channels: channels in and out; the spatial size is kept.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, in_channels, H, W)`` to ``(B, out_channels, H, W)``."""
        return F.relu(self.bn(self.conv(x)))


class VGG(nn.Module):
    """Stages of :class:`ConvUnit` s, each stage but the last followed by 2x2 max pooling,
    then global average pooling and ``classifier``.

    Args:
        stages: per stage, the output channels of its units, e.g. ``((64, 64), (128, 128))``.
        in_channels: image channels.
        num_classes: classifier outputs.
        dropout: dropout before the classifier (training only).
    """

    def __init__(self, stages: Sequence[Sequence[int]], in_channels: int, num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for i, widths in enumerate(stages):
            for width in widths:
                layers.append(ConvUnit(channels, width))
                channels = width
            if i < len(stages) - 1:
                layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(channels, num_classes)
        _kaiming_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(B, in_channels, H, W)`` to logits ``(B, num_classes)``."""
        out = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.classifier(self.drop(out))


def vgg(
    stages: Sequence[Sequence[int]] = ((32, 32), (64, 64), (128, 128), (256,)),
    in_channels: int = 1,
    num_classes: int = 10,
    dropout: float = 0.0,
) -> VGG:
    """Build a :class:`VGG`; the default is a 7-convolution net for 28x28 images
    (28 -> 14 -> 7 -> 3 pixels across its four stages).

    Raises:
        ValueError: naming the argument when there is no stage, a stage is empty, a size
            is not a positive integer or ``dropout`` is not in ``[0, 1)``.
    """
    stages = [tuple(s) for s in stages]
    if not stages:
        raise ValueError("vgg needs at least one stage, got stages=()")
    for i, widths in enumerate(stages):
        if not widths:
            raise ValueError(f"stage {i} of vgg has no units: stages={stages}")
        bad = [w for w in widths if not isinstance(w, int) or isinstance(w, bool) or w < 1]
        if bad:
            raise ValueError(f"vgg stage {i} widths must be positive integers, got {bad} in stages={stages}")
    for name, value in (("in_channels", in_channels), ("num_classes", num_classes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got dropout={dropout!r}")
    return VGG(stages, in_channels, num_classes, dropout)


def _kaiming_init(model: nn.Module) -> None:
    """He-normal convolutions (fan_out, ReLU), unit-weight zero-bias BN, zero-bias classifier."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
