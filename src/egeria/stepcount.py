"""Which calls of ``Egeria.step()`` are training steps: those after an optimizer step
(:class:`OptimizerSteps`), and the loss the model's own output carried over the step
(:class:`OutputLosses`).

Egeria counts steps from the optimizer itself (``optimizer.register_step_post_hook``), so
a loop may call ``eg.step()`` after every micro-batch (gradient accumulation, a
framework's per-batch callback) or after a step that ``GradScaler`` skipped (it does not
call ``optimizer.step()`` when gradients overflow; for a fused optimizer it does, with
``optimizer.found_inf`` set, and the kernel skips the update: such a step is read as
skipped at the boundary, one scalar read): such calls count nothing. A call after
two or more optimizer steps is an error (Egeria would miss step boundaries). An optimizer
without step hooks (not a ``torch.optim.Optimizer``) counts every call, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from .hooks import mark

__all__ = ["OptimizerSteps", "OutputLosses"]


class OptimizerSteps:
    """Counts ``optimizer.step()`` calls and tells each ``Egeria.step()`` whether it is a
    step boundary."""

    def __init__(self, optimizer: Any) -> None:
        self.taken = 0  # optimizer steps since this counter was made
        self.counted = 0  # of those, the ones Egeria.step() has accounted for
        self._found_inf: list[torch.Tensor] = []  # GradScaler's flags of fused steps since then
        register = getattr(optimizer, "register_step_post_hook", None)
        self._handle = register(self._on_step) if callable(register) else None

    @property
    def follows_optimizer(self) -> bool:
        """Whether steps come from the optimizer (else every ``Egeria.step()`` counts)."""
        return self._handle is not None

    def boundary(self) -> bool:
        """True when an ``Egeria.step()`` call now ends a training step (and accounts for it).

        Raises:
            ValueError: the optimizer stepped more than once since the previous call.
        """
        if self._handle is None:
            return True
        skipped = sum(1 for flag in self._found_inf if bool(flag.item() > 0))
        self._found_inf = []
        pending = self.taken - self.counted - skipped
        if pending > 1:
            raise ValueError(
                f"the optimizer stepped {pending} times since the last Egeria.step(): call eg.step() once after "
                "every optimizer.step() (calls between optimizer steps, e.g. per micro-batch, are fine)"
            )
        self.counted = self.taken
        return pending == 1

    def settle(self) -> None:
        """Accounts for every optimizer step so far (a checkpoint was just loaded)."""
        self.counted = self.taken
        self._found_inf = []

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.taken += 1
        found = getattr(optimizer, "found_inf", None)  # set by GradScaler around a fused step
        if isinstance(found, torch.Tensor):
            self._found_inf.append(found.detach().clone())


class OutputLosses:
    """The losses a model's training forwards return in their output (``output.loss`` or
    ``output["loss"]``, as Hugging Face models do), summed between step boundaries without
    a copy or a device sync; forwards of Egeria's own (``own_pass()``) are not counted."""

    def __init__(self, model: nn.Module, own_pass: Callable[[], bool]) -> None:
        self._own_pass = own_pass
        self._sum: tuple[Any, int] | None = None  # (sum, count) of this step's output losses
        self._hook = mark(model.register_forward_hook(self._capture))

    def take(self) -> torch.Tensor | None:
        """The mean of the losses since the previous call (None: none was seen); the next
        step's micro-batches count afresh."""
        taken, self._sum = self._sum, None
        if taken is None:
            return None
        total, count = taken
        return total / count

    def remove(self) -> None:
        self._hook.remove()

    def _capture(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Keeps the loss a training forward returns in its output (no copy, no sync)."""
        if not module.training or self._own_pass():
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().reshape(())
            total, count = self._sum or (0.0, 0)
            self._sum = (loss + total, count + 1)
