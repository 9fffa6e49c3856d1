"""Similarity-Preserving (SP) loss: the distance Egeria reads plasticity with (paper 4.2.1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["sp_loss", "Gram", "gram_of"]


@dataclass(frozen=True)
class Gram:
    """An activation's row-normalised ``(batch, batch)`` Gram matrix, all :func:`sp_loss`
    needs of it: computed where a large activation lives (an accelerator), it crosses to
    the controller instead of the activation (``batch x batch`` numbers, not
    ``batch x features``)."""

    matrix: torch.Tensor


def gram_of(x: torch.Tensor) -> Gram:
    """The :class:`Gram` of activation ``x`` (shape ``(batch, ...)``), in fp32."""
    if x.dim() == 0:
        raise ValueError("gram_of needs a batched activation, got a scalar")
    return Gram(_normalised_gram(x.float()))


def sp_loss(a: torch.Tensor | Gram, b: torch.Tensor | Gram) -> torch.Tensor:
    """Similarity-Preserving loss of Tung & Mori (ICCV 2019) between two activations.

    Each activation is flattened to ``(batch, -1)``; its ``(batch, batch)`` Gram matrix of
    pairwise sample similarities is L2-normalised row by row; the loss is the squared
    Frobenius norm of the difference of the two normalised Gram matrices divided by
    ``batch ** 2``. It compares *how the batch's samples relate to each other* in the two
    activations, so it is blind to feature order and scale, and works across precisions.

    Args:
        a: activation of shape ``(batch, ...)``, any floating dtype and device, or its
            :class:`Gram` (computed by :func:`gram_of`).
        b: activation (or :class:`Gram`) with the same batch size; its other dimensions
            may differ.

    Returns:
        A 0-dim fp32 tensor on ``a``'s device; differentiable, so it also serves as a
        distillation loss.

    Raises:
        ValueError: when the batch sizes differ or a tensor has no batch dimension.
    """
    ta = a.matrix if isinstance(a, Gram) else a
    tb = b.matrix if isinstance(b, Gram) else b
    if ta.dim() == 0 or tb.dim() == 0:
        raise ValueError(f"sp_loss needs batched activations, got shapes {tuple(ta.shape)} and {tuple(tb.shape)}")
    if ta.shape[0] != tb.shape[0]:
        raise ValueError(f"sp_loss batch sizes differ: {ta.shape[0]} and {tb.shape[0]}")
    batch = ta.shape[0]
    ga = a.matrix.float() if isinstance(a, Gram) else _normalised_gram(a.float())
    gb = b.matrix.float().to(ga.device) if isinstance(b, Gram) else _normalised_gram(b.float().to(ga.device))
    return (ga - gb).pow(2).sum() / (batch * batch)


def _normalised_gram(x: torch.Tensor) -> torch.Tensor:
    """Row-normalised Gram matrix ``(batch, batch)`` of ``x`` flattened to ``(batch, -1)``."""
    flat = x.reshape(x.shape[0], -1)
    return F.normalize(flat @ flat.t(), p=2, dim=1)
