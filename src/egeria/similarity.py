"""Similarity-Preserving (SP) loss: the distance Egeria reads plasticity with (paper 4.2.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sp_loss"]


def sp_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Similarity-Preserving loss of Tung & Mori (ICCV 2019) between two activations.

    Each activation is flattened to ``(batch, -1)``; its ``(batch, batch)`` Gram matrix of
    pairwise sample similarities is L2-normalised row by row; the loss is the squared
    Frobenius norm of the difference of the two normalised Gram matrices divided by
    ``batch ** 2``. It compares *how the batch's samples relate to each other* in the two
    activations, so it is blind to feature order and scale, and works across precisions.

    Args:
        a: activation of shape ``(batch, ...)``, any floating dtype and device.
        b: activation with the same batch size; its other dimensions may differ.

    Returns:
        A 0-dim fp32 tensor on ``a``'s device; differentiable, so it also serves as a
        distillation loss.

    Raises:
        ValueError: when the batch sizes differ or a tensor has no batch dimension.
    """
    if a.dim() == 0 or b.dim() == 0:
        raise ValueError(f"sp_loss needs batched activations, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"sp_loss batch sizes differ: {a.shape[0]} and {b.shape[0]}")
    batch = a.shape[0]
    ga = _normalised_gram(a.float())
    gb = _normalised_gram(b.float().to(ga.device))
    return (ga - gb).pow(2).sum() / (batch * batch)


def _normalised_gram(x: torch.Tensor) -> torch.Tensor:
    """Row-normalised Gram matrix ``(batch, batch)`` of ``x`` flattened to ``(batch, -1)``."""
    flat = x.reshape(x.shape[0], -1)
    return F.normalize(flat @ flat.t(), p=2, dim=1)
