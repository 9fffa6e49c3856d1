"""Walking nested call arguments and outputs (tuples, lists, dicts) to their leaves."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["map_leaves", "map_tensors", "leaves", "first_tensor"]


def map_leaves(value: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to each leaf (``is_leaf``), through tuples (named
    tuples such as ``PackedSequence`` keep their type), lists and dict values; anything
    else is kept as it is."""
    if is_leaf(value):
        return fn(value)
    if isinstance(value, tuple):
        mapped = [map_leaves(v, is_leaf, fn) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else tuple(mapped)
    if isinstance(value, list):
        return [map_leaves(v, is_leaf, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_leaves(v, is_leaf, fn) for k, v in value.items()}
    return value


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to each tensor in it."""
    return map_leaves(value, _is_tensor, fn)


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, in order."""
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def first_tensor(output: object) -> torch.Tensor | None:
    """The activation of a block: its output tensor, or the first tensor it returns."""
    return next(iter(leaves(output)), None)
