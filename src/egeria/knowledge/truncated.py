"""Running a model only as far as one block: the forward pass stops at that block's output."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..hooks import mark, unmark
from ..nested import first_tensor

__all__ = ["run_until", "outputs_until"]


class _Stop(BaseException):
    """Carries a block's output out of a forward pass that can end there.

    A BaseException, so a model's own ``except Exception`` cannot swallow it."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


def run_until(model: nn.Module, block: str | None, args: tuple, kwargs: dict) -> Any:
    """Calls ``model(*args, **kwargs)`` and returns ``block``'s output as soon as it exists.

    The layers after ``block`` never run. ``block=None`` runs the whole model and
    returns None.

    Raises:
        RuntimeError: when ``block`` did not run in the forward pass.
    """
    handle = None
    if block is not None:
        def stop(module: nn.Module, inputs: tuple, output: Any) -> None:
            raise _Stop(output)

        handle = mark(model.get_submodule(block).register_forward_hook(stop))
    try:
        model(*args, **kwargs)
    except _Stop as stopped:
        return stopped.output
    finally:
        if handle is not None:
            unmark(handle)
    if block is not None:
        raise RuntimeError(f"block {block} did not run in the forward pass")
    return None


def outputs_until(model: nn.Module, blocks: Sequence[str], args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The activations (first output tensors) of ``blocks``, given in execution order,
    from one forward pass of ``model`` that stops at the last of them.

    Raises:
        RuntimeError: when a block did not run or returned no tensor.
    """
    seen: dict[str, torch.Tensor] = {}

    def keeper(name: str):
        def keep(module: nn.Module, inputs: tuple, output: Any) -> None:
            tensor = first_tensor(output)
            if tensor is not None:
                seen.setdefault(name, tensor)

        return keep

    last = list(dict.fromkeys(blocks))
    handles = [mark(model.get_submodule(b).register_forward_hook(keeper(b))) for b in last[:-1]]
    try:
        seen.setdefault(last[-1], first_tensor(run_until(model, last[-1], args, kwargs)))
    finally:
        for handle in handles:
            unmark(handle)
    missing = [b for b in blocks if seen.get(b) is None]
    if missing:
        raise RuntimeError(f"blocks {missing} did not run or returned no tensor")
    return [seen[b] for b in blocks]
