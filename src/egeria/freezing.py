"""Freezing mechanics: what freezing a layer module does to the model (paper 5).

Freezing sets ``requires_grad`` to False and drops the gradient, so autograd skips the
module's backward and every torch optimizer skips its parameters (they have no
gradient): momentum buffers, weight decay and Adam moments leave them untouched, and the
optimizer's param groups, schedulers and checkpoints keep their shape. BatchNorm and
dropout inside a frozen module run in eval mode, held there by a forward pre-hook so
that the user's own ``model.train()`` cannot undo it.

Tied input embeddings: when a frozen module holds an ``nn.Embedding`` whose weight a
deeper, trainable module owns (GPT-2's ``wte`` tied to ``lm_head``; see
:attr:`~egeria.partition.LayerModule.detached`), that weight keeps ``requires_grad=True``
and a forward hook detaches the embedding's output. So:

* the optimizer keeps updating the shared weight, with the gradient of its owner's use
  (the output layer) only: the lookup adds nothing to it;
* the frozen module's own parameters (position embeddings, norms, blocks) do not change;
* the lookup reads the shared weight's *current* value, so the frozen module's output still
  moves as the owner trains the weight (the activation cache does not serve such a prefix);
* unfreezing removes the hook: the lookup's gradient flows into the shared weight again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .hooks import mark
from .partition import Partition

if TYPE_CHECKING:
    from .averaging import FreezeToAverage
    from .optimizer_state import ReleasedState

__all__ = ["freeze_parameters", "unfreeze_parameters", "detach_output", "EvalLock", "FrozenPrefix"]


def freeze_parameters(params: Iterable[nn.Parameter]) -> None:
    """Stops training ``params``: no gradient is computed or kept for them."""
    for p in params:
        p.requires_grad_(False)
        p.grad = None


def unfreeze_parameters(params: Iterable[nn.Parameter]) -> None:
    """Trains ``params`` again."""
    for p in params:
        p.requires_grad_(True)


def detach_output(module: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook: the module's output cut from the graph (a tensor; anything else as is)."""
    return output.detach() if isinstance(output, torch.Tensor) else output


class EvalLock:
    """Keeps a module and everything under it in eval mode while the lock is held.

    Args:
        module: the block to hold in eval mode.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._set_eval()
        # traced: it only keeps module flags, which torch.compile guards on anyway
        self._handle: RemovableHandle | None = mark(module.register_forward_pre_hook(self._before_forward), traced=True)

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


class FrozenPrefix:
    """The frozen layer modules of one model: always a prefix of its partition.

    The one owner of the frozen count: the engine, the policies and the cache ask it.

    Args:
        model: the training model.
        partition: its layer modules.
        on_change: called with the new count after every change (the activation cache).

    ``average`` (a :class:`~egeria.averaging.FreezeToAverage`, None by default) gives each
    module its averaged weights as it freezes and restarts the averages at an unfreeze.
    ``optimizer_state`` (a :class:`~egeria.optimizer_state.ReleasedState`, None by default)
    takes the optimizer state of the parameters a freeze stops out of the optimizer and
    gives it back before they train again.
    """

    def __init__(self, model: nn.Module, partition: Partition, on_change: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.partition = partition
        self.on_change = on_change
        # Parameters the user froze stay frozen: Egeria never makes them trainable.
        self.trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        self._params = dict(model.named_parameters())
        self._locks: list[EvalLock] = []
        self._detached: list[RemovableHandle] = []  # hooks on tied embeddings of frozen modules
        self.count = 0
        self.average: FreezeToAverage | None = None
        self.optimizer_state: ReleasedState | None = None

    @property
    def names(self) -> list[str]:
        return self.partition.names[: self.count]

    @property
    def settled(self) -> int:
        """The leading frozen modules whose output is final (what the activation cache may
        hold): all of them, but those frozen to their average whose BatchNorm statistics are
        still being re-estimated, and any after them."""
        return self.count if self.average is None else self.average.settled(self.count)

    def move_to(self, target: int) -> list[tuple[str, tuple[str, ...]]]:
        """Freezes or unfreezes so that the first ``target`` modules (clipped to the
        freezable ones) are frozen; a shallower target unfreezes everything first.

        Returns:
            What changed, in order: ``("unfreeze", names)`` and/or ``("freeze", names)``.
        """
        target = max(0, min(int(target), self.partition.freezable))
        changes: list[tuple[str, tuple[str, ...]]] = []
        if target < self.count:
            changes.append(("unfreeze", tuple(self.names)))
            self._unfreeze_all()
        if target > self.count:
            changes.append(("freeze", tuple(self.partition.names[self.count : target])))
            while self.count < target:
                self._freeze_next()
        if changes and self.on_change is not None:
            self.on_change(self.count)
        return changes

    def _freeze_next(self) -> None:
        module = self.partition.modules[self.count]
        params = [self._params[p] for p in module.params if p in self.trainable]
        freeze_parameters(params)
        if self.optimizer_state is not None:
            self.optimizer_state.release(params)
        self._locks.extend(EvalLock(self.model.get_submodule(b)) for b in module.blocks)
        if self.average is not None:
            # after the eval locks: a BatchNorm's re-estimate hook must run after a lock's on it
            self.average.freeze(module)
        self._detached.extend(
            mark(self.model.get_submodule(name).register_forward_hook(detach_output)) for name in module.detached
        )
        self.count += 1

    def _unfreeze_all(self) -> None:
        for module in self.partition.modules[: self.count]:
            params = [self._params[p] for p in module.params if p in self.trainable]
            if self.optimizer_state is not None:
                self.optimizer_state.restore(params)
            unfreeze_parameters(params)
        if self.average is not None:
            self.average.unfreeze()  # before the locks go: their release gives the modules the model's mode
        self.release_locks(self.model.training)
        self.count = 0

    def release_locks(self, training: bool) -> None:
        """Lets the frozen modules' train/eval mode follow ``training`` again, and tied
        embeddings send their gradient into the shared weight again."""
        for lock in self._locks:
            lock.release(training)
        self._locks = []
        for handle in self._detached:
            handle.remove()
        self._detached = []
