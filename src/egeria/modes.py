"""Egeria's own forward passes: eval mode, no gradients, the user's training flags restored."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["eval_forward", "OwnPasses"]


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


class OwnPasses:
    """Egeria's own forward passes of the user's model (tracing, cache checks), flagged
    while they run so that Egeria's hooks can tell them from training forwards.

    Args:
        model: the user's model.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.active = False

    def is_active(self) -> bool:
        return self.active

    @contextlib.contextmanager
    def eval_forward(self) -> Iterator[None]:
        """An eval-mode, no-grad forward pass of Egeria's own (see :func:`eval_forward`)."""
        self.active = True
        try:
            with eval_forward(self.model):
                yield
        finally:
            self.active = False
