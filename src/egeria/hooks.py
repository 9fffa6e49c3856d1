"""Egeria's own module hooks, marked so that copies of the model leave them out and
``torch.compile`` does not trace them.

Every forward hook Egeria installs on the user's model goes through :func:`mark`; the
controller's snapshot (:func:`egeria.knowledge.weights.float_snapshot`) keeps the user's own hooks
(weight norm, say) and drops the marked ones. Hook handle ids are unique in a process.

Under ``torch.compile`` a traced hook would put guards on Egeria's Python state (the step,
the armed evaluation, a batch's sample keys) and recompile whenever it changes. A marked
hook is wrapped in ``torch.compiler.disable``: the compiled graph calls it as Python, so
a freeze costs only the recompile that changed ``requires_grad`` and training flags cause.
Hooks that only keep module flags (``traced=True``) stay traceable, so they do not split
the graph.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.hooks import RemovableHandle

__all__ = ["mark", "unmark", "is_marked"]

_MARKED: set[int] = set()


def mark(handle: RemovableHandle, *, traced: bool = False) -> RemovableHandle:
    """Marks ``handle``'s hook as Egeria's (kept out of ``torch.compile``'s graphs unless
    ``traced``); returns the handle."""
    _MARKED.add(handle.id)
    if not traced:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = _untraced(hooks[handle.id])
    return handle


def _untraced(hook: Callable[..., Any]) -> Callable[..., Any]:
    try:
        import torch.compiler

        return torch.compiler.disable(hook, recursive=True)
    except (ImportError, AttributeError):  # a torch without the compiler
        return hook


def unmark(handle: RemovableHandle) -> None:
    """Removes ``handle``'s hook and forgets its mark."""
    handle.remove()
    _MARKED.discard(handle.id)


def is_marked(hook_id: int) -> bool:
    """Whether the hook with this id was installed by Egeria."""
    return hook_id in _MARKED
