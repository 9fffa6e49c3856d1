"""Freezing mechanics: what freezing a layer module does to the model (paper 5).

Freezing sets ``requires_grad`` to False and drops the gradient, so autograd skips the
module's backward and every torch optimizer skips its parameters (they have no
gradient): momentum buffers, weight decay and Adam moments leave them untouched, and the
optimizer's param groups, schedulers and checkpoints keep their shape. BatchNorm and
dropout inside a frozen module run in eval mode, held there by a forward pre-hook so
that the user's own ``model.train()`` cannot undo it.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["freeze_parameters", "unfreeze_parameters", "EvalLock"]


def freeze_parameters(params: Iterable[nn.Parameter]) -> None:
    """Stops training ``params``: no gradient is computed or kept for them."""
    for p in params:
        p.requires_grad_(False)
        p.grad = None


def unfreeze_parameters(params: Iterable[nn.Parameter]) -> None:
    """Trains ``params`` again."""
    for p in params:
        p.requires_grad_(True)


class EvalLock:
    """Keeps a module and everything under it in eval mode while the lock is held.

    Args:
        module: the block to hold in eval mode.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._set_eval()
        self._handle: RemovableHandle | None = module.register_forward_pre_hook(self._before_forward)

    def _set_eval(self) -> None:
        for sub in self._module.modules():
            sub.training = False

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if module.training:
            self._set_eval()

    def release(self, training: bool) -> None:
        """Removes the lock and gives the module the training flag ``training``."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._module.train(training)
