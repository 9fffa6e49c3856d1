"""AutoFreeze (Liu et al., 2021): freeze the front modules whose gradients stopped changing."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..checkpoint.saved_state import SavedContext
from ..checkpoint.statecheck import Spec, items, number, optional, record
from ..checks import check_int
from .base import Binding, StepInfo

__all__ = ["AutoFreeze"]


@dataclass
class AutoFreeze:
    """Every ``interval`` steps, compares each active module's gradient norm with the
    previous interval's; modules whose relative change is at or below the ``percentile``
    of the active modules' changes are converged, and the contiguous front run of them
    freezes.

    The gradient norm of a module is the L2 norm of all its parameters' gradients, read
    just before each optimizer step (``optimizer.register_step_pre_hook``) and summed over
    the interval: the gradients are then complete (all micro-batches of an accumulation
    summed), unscaled by ``GradScaler`` (which unscales before stepping), and a step that
    ``GradScaler`` skips for overflowing gradients never reaches the hook; the order of
    ``optimizer.zero_grad()`` and ``Egeria.step`` does not matter.

    Args:
        interval: steps between two decisions (AutoFreeze's evaluation interval).
        percentile: in (0, 100]; 50 (the median) as in AutoFreeze.
    """

    interval: int = 100
    percentile: float = 50.0
    name: str = "autofreeze"
    previous: list[float] | None = None
    _sums: list[torch.Tensor] = field(default_factory=list, repr=False)
    _params: list[list[torch.Tensor]] = field(default_factory=list, repr=False)
    _handles: list = field(default_factory=list, repr=False)
    #: It reads the model's gradient norms (refused under FSDP2: :class:`~egeria.policies.PolicyView`).
    reads_model: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int(self.interval, "AutoFreeze interval")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"AutoFreeze percentile={self.percentile!r} must be in (0, 100]")

    def bind(self, binding: Binding) -> None:
        partition = binding.partition
        named = dict(binding.model.named_parameters())
        self._sums = [torch.zeros((), dtype=torch.float64) for _ in partition.modules]
        self._params = [[named[name] for name in module.params] for module in partition.modules[: partition.freezable]]
        register = getattr(binding.optimizer, "register_step_pre_hook", None)
        if not callable(register):
            raise ValueError(
                f"the autofreeze policy reads gradients from optimizer step hooks, which "
                f"{type(binding.optimizer).__name__} lacks; use a torch.optim.Optimizer"
            )
        self._handles.append(register(self._add_step))

    def _add_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Adds this step's squared gradient norm of each freezable module (frozen ones
        have no gradients). A fused optimizer stepped by ``GradScaler`` still holds scaled
        gradients (``optimizer.grad_scale``) and skips the update itself when they
        overflowed (``optimizer.found_inf``): unscaled here, and such a step adds nothing
        (no host sync)."""
        scale = getattr(optimizer, "grad_scale", None)
        found = getattr(optimizer, "found_inf", None)
        for index, params in enumerate(self._params):
            grads = [p.grad.detach() for p in params if p.grad is not None]
            if grads:
                squared = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
                if isinstance(scale, torch.Tensor):
                    squared = squared / scale.to(squared.device).double().pow(2)
                if isinstance(found, torch.Tensor):
                    squared = torch.where(found.to(squared.device) > 0, torch.zeros_like(squared), squared)
                self._sums[index] = self._sums[index].to(squared.device) + squared

    def unbind(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def target(self, info: StepInfo) -> int | None:
        if info.step % self.interval != 0:
            return None
        norms = [math.sqrt(float(s)) for s in self._sums]  # one device sync per interval
        self._sums = [torch.zeros((), dtype=torch.float64) for _ in self._sums]
        previous, self.previous = self.previous, norms
        if previous is None:
            return None
        return self.front_run(previous, norms, info.frozen, info.freezable)

    def front_run(self, previous: list[float], norms: list[float], frozen: int, freezable: int) -> int | None:
        """The rule on one interval's per-module gradient norms against the previous
        interval's: how many leading modules should be frozen (None: no change known)."""
        active = range(frozen, freezable)
        changes = {i: abs(norms[i] - previous[i]) / previous[i] for i in active if previous[i] > 0}
        if not changes:
            return None
        threshold = _percentile(sorted(changes.values()), self.percentile)
        target = frozen
        for i in active:
            if i not in changes or changes[i] > threshold:
                break
            target = i + 1
        return target

    def state_dict(self) -> dict:
        return {"previous": self.previous, "sums": [float(s) for s in self._sums]}

    def state_spec(self, context: SavedContext) -> Spec:
        """A saved state fits a model of ``len(context.partition)`` modules."""
        count = len(context.partition)
        per_module = items(number(0), length=count)
        return record({"previous": optional(per_module), "sums": per_module})

    def load_state_dict(self, state: dict) -> None:
        self.previous = state["previous"]
        self._sums = [torch.tensor(v, dtype=torch.float64) for v in state["sums"]]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-100) of sorted values."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = q / 100 * (len(sorted_values) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)
