"""CIFAR-style ResNet of He et al. (CVPR 2016, section 4.2): depth 6n+2, widths w, 2w, 4w."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BasicBlock", "ResNet", "resnet"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection: ``relu(bn2(conv2(relu(bn1(conv1 x)))) + s(x))``.

    The shortcut ``s`` is the identity (an empty ``nn.Sequential``) when the shape is kept,
    and a 1x1 strided conv + BN (option B of the paper) when it changes. ``forward`` has no
    data-dependent control flow, so ``torch.fx.symbolic_trace`` traces each block alone.

    Args:
        in_planes: input channels.
        planes: output channels.
        stride: stride of the first conv (and of the projection shortcut).
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, in_planes, H, W)`` to ``(B, planes, ceil(H / stride), ceil(W / stride))``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem ``conv1``/``bn1``, three stages ``layer1..3`` of ``n`` blocks, pool, ``linear``.

    Stage widths are ``width, 2*width, 4*width``; stages 2 and 3 halve the resolution. Any
    input of at least 8x8 works (28x28 gives 28 -> 14 -> 7, 32x32 gives 32 -> 16 -> 8).

    Args:
        num_blocks: blocks per stage, ``n = (depth - 2) / 6``.
        in_channels: image channels (3 for CIFAR, 1 for (Fashion-)MNIST).
        num_classes: outputs of the ``linear`` head.
        width: channels of the stem and the first stage.
    """

    def __init__(
        self, num_blocks: int, in_channels: int = 3, num_classes: int = 10, width: int = 16
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = _stage(width, width, num_blocks, stride=1)
        self.layer2 = _stage(width, 2 * width, num_blocks, stride=2)
        self.layer3 = _stage(2 * width, 4 * width, num_blocks, stride=2)
        self.linear = nn.Linear(4 * width, num_classes)
        _kaiming_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(B, in_channels, H, W)`` to logits ``(B, num_classes)``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def resnet(depth: int = 20, in_channels: int = 3, num_classes: int = 10, width: int = 16) -> ResNet:
    """Build the CIFAR ResNet of ``depth = 6n + 2`` layers (20, 32, 44, 56, 110, ...).

    Args:
        depth: total weighted layers; must be ``6n + 2`` with ``n >= 1``.
        in_channels: image channels.
        num_classes: classifier outputs.
        width: channels of the first stage (16 in the paper).

    Returns:
        A :class:`ResNet` with ``n`` :class:`BasicBlock` s per stage, Kaiming-initialised.

    Raises:
        ValueError: naming ``depth`` when it is not ``6n + 2``, or a non-positive size.
    """
    if depth < 8 or (depth - 2) % 6 != 0:
        raise ValueError(f"ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, 56, 110, ...), got depth={depth}")
    for name, value in (("in_channels", in_channels), ("num_classes", num_classes), ("width", width)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {name}={value}")
    return ResNet((depth - 2) // 6, in_channels=in_channels, num_classes=num_classes, width=width)


def _stage(in_planes: int, planes: int, num_blocks: int, stride: int) -> nn.Sequential:
    """``num_blocks`` blocks; only the first changes width / resolution."""
    blocks = [BasicBlock(in_planes, planes, stride)]
    blocks += [BasicBlock(planes, planes, 1) for _ in range(num_blocks - 1)]
    return nn.Sequential(*blocks)


def _kaiming_init(model: nn.Module) -> None:
    """He-normal convs (fan_out, ReLU), unit-weight zero-bias BN, He-uniform linear."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.kaiming_uniform_(module.weight, nonlinearity="linear")
            nn.init.zeros_(module.bias)
