"""Egeria's own forward passes: eval mode, no gradients, the user's training flags restored."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["eval_forward"]


@contextlib.contextmanager
def eval_forward(model: nn.Module) -> Iterator[None]:
    """Runs the body with ``model`` in eval mode and without gradients; every submodule's
    training flag is restored afterwards, as the user had set it."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, flag in flags:
            module.training = flag
