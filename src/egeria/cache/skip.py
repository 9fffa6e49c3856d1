"""Skipping the frozen prefix's forward pass without touching the model's ``forward``.

While a batch is served from the cache, every block of the frozen prefix has its
``forward`` replaced for that one call: the boundary block (the prefix's last) returns
the cached output, the other prefix blocks return zeros of the shape they returned when
last computed (their results only feed the boundary block in a chain). Code of the
model's own ``forward`` between blocks (activations, adding position embeddings, masks
for later blocks) still runs. Whether the model really is a chain at the boundary is
checked once per boundary by :func:`same_outputs`. Under FSDP2 the units wholly inside the
prefix also skip FSDP2's hooks for that call: their parameters are not gathered.

A batch the cache holds only some rows of is served in part (:func:`install_part_stubs`):
each prefix block runs on the rows still missing only (its batch-first inputs sliced to
them), and the boundary block puts its computed rows and the cached ones back together, in
the batch's order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..nested import leaves, map_leaves, map_tensors
from ..wrappers import fsdp2_hook

__all__ = [
    "template_of", "Spec", "spec_of", "install_stubs", "install_part_stubs", "remove_stubs", "stubbed", "leaves",
    "rebuild", "same_outputs",
]


class _Slot:
    """Marks where a tensor goes in an output's structure."""

    def __repr__(self) -> str:
        return "<tensor>"


_SLOT = _Slot()


def template_of(output: Any) -> Any:
    """``output`` with each tensor replaced by a slot marker (other values kept)."""
    return map_tensors(output, lambda t: _SLOT)


class Spec:
    """A block output's structure: tensor leaves as (shape, dtype, batch-first)."""

    def __init__(self, output: Any, batch: int) -> None:
        self.template = template_of(output)
        self.tensors = [(tuple(t.shape), t.dtype, t.device, t.dim() > 0 and t.shape[0] == batch) for t in leaves(output)]

    def zeros(self, batch: int) -> Any:
        made = [
            torch.zeros((batch, *shape[1:]) if batch_first else shape, dtype=dtype, device=device)
            for shape, dtype, device, batch_first in self.tensors
        ]
        return rebuild(self.template, made)


def spec_of(output: Any, batch: int) -> Spec:
    return Spec(output, batch)


def rebuild(template: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """``template`` (from :func:`template_of`) with its tensor slots filled in order."""
    it = iter(tensors)
    return map_leaves(template, lambda v: v is _SLOT, lambda slot: next(it))


def install_stubs(
    model: nn.Module, blocks: Sequence[str], boundary: str, output: Any, specs: dict[str, Spec], batch: int,
    silent: Sequence[nn.Module] = (),
) -> list[nn.Module]:
    """Makes ``blocks`` of ``model`` skip their work, ``boundary`` returning ``output``, and
    the FSDP2 units ``silent`` (wholly inside ``blocks``) skip FSDP2's forward hooks, so
    their parameters are not gathered; returns the modules to hand to :func:`remove_stubs`."""
    replaced: list[nn.Module] = []
    for name in blocks:
        module = model.get_submodule(name)
        if name == boundary:
            module.forward = _returning(lambda: output)
        else:
            module.forward = _returning(lambda spec=specs[name]: spec.zeros(batch))
        replaced.append(module)
    for unit in silent:
        # The hook dicts themselves are put back afterwards: FSDP2's handles refer to them.
        unit.__dict__[_SILENCED] = (unit._forward_pre_hooks, unit._forward_hooks)
        unit._forward_pre_hooks = type(unit._forward_pre_hooks)(
            (k, h) for k, h in unit._forward_pre_hooks.items() if not fsdp2_hook(h)
        )
        unit._forward_hooks = type(unit._forward_hooks)((k, h) for k, h in unit._forward_hooks.items() if not fsdp2_hook(h))
        replaced.append(unit)
    return replaced


def install_part_stubs(
    model: nn.Module, blocks: Sequence[str], boundary: str, cached: Sequence[torch.Tensor], there: Sequence[int],
    missing: Sequence[int], batch: int, computed: Callable[[Any], None] | None = None,
) -> list[nn.Module]:
    """Makes ``blocks`` of ``model`` run on the batch's rows ``missing`` only: each block's
    batch-first tensor inputs are sliced to those rows, its real forward runs on them, and
    its output is widened back to ``batch`` rows (zeros in the rows ``there``, which only
    the next block of the chain reads, and which it drops again); the ``boundary`` block fills
    the rows ``there`` from ``cached`` (its output's tensors, rows ``there`` only, in order)
    and hands its computed rows to ``computed`` first. Returns the modules to hand to
    :func:`remove_stubs`."""
    replaced: list[nn.Module] = []
    for name in blocks:
        module = model.get_submodule(name)
        module.forward = _on_rows(
            module.forward, there, missing, batch, cached if name == boundary else None, computed if name == boundary else None
        )
        replaced.append(module)
    return replaced


def _on_rows(
    forward: Callable[..., Any], there: Sequence[int], missing: Sequence[int], batch: int,
    cached: Sequence[torch.Tensor] | None, computed: Callable[[Any], None] | None,
) -> Callable[..., Any]:
    indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in indices:
            indices[device] = (torch.tensor(missing, device=device), torch.tensor(there, device=device))
        return indices[device]

    def narrow(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, rows(t.device)[0]) if t.dim() > 0 and t.shape[0] == batch else t

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = map_tensors((args, kwargs), narrow)
        output = forward(*args, **kwargs)
        if computed is not None:
            computed(output)
        tensors = leaves(output)
        if cached is not None and len(cached) != len(tensors):
            raise RuntimeError(f"the cached output has {len(cached)} tensors, the block returned {len(tensors)}")
        wide = []
        for i, t in enumerate(tensors):
            if t.dim() == 0 or t.shape[0] != len(missing):
                wide.append(t)  # not per sample: as it is
                continue
            out = t.new_zeros((batch, *t.shape[1:]))
            take, keep = rows(t.device)
            out = out.index_copy(0, take, t)
            if cached is not None:
                out = out.index_copy(0, keep, cached[i].to(t.device, t.dtype))
            wide.append(out)
        return rebuild(template_of(output), wide)

    return run


def remove_stubs(modules: Sequence[nn.Module]) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)
        hooks = module.__dict__.pop(_SILENCED, None)
        if hooks is not None:
            module._forward_pre_hooks, module._forward_hooks = hooks


#: Where a silenced FSDP2 unit keeps its own forward hook dicts while a batch is served.
_SILENCED = "_egeria_fsdp2_hooks"


@contextlib.contextmanager
def stubbed(replaced: list[nn.Module]) -> Iterator[None]:
    """The stubs just installed in ``replaced`` (by :func:`install_stubs` or
    :func:`install_part_stubs`) for the body only."""
    try:
        yield
    finally:
        remove_stubs(replaced)


def _returning(make: Callable[[], Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return make()

    return forward


def same_outputs(a: Any, b: Any, *, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    xs, ys = leaves(a), leaves(b)
    return len(xs) == len(ys) and all(x.shape == y.shape and torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol) for x, y in zip(xs, ys))
