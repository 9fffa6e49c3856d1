"""Running a model only as far as one block: the forward pass stops at that block's output."""

from __future__ import annotations

from typing import Any

from torch import nn

from .hooks import mark

__all__ = ["run_until"]


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
            handle.remove()
    if block is not None:
        raise RuntimeError(f"block {block} did not run in the forward pass")
    return None
