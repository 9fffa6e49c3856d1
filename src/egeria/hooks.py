"""Egeria's own module hooks, marked so that copies of the model leave them out.

Every forward hook Egeria installs on the user's model goes through :func:`mark`; the
controller's CPU snapshot (:func:`egeria.weights.cpu_snapshot`) keeps the user's own hooks
(weight norm, say) and drops the marked ones. Hook handle ids are unique in a process.
"""

from __future__ import annotations

from torch.utils.hooks import RemovableHandle

__all__ = ["mark", "unmark", "is_marked"]

_MARKED: set[int] = set()


def mark(handle: RemovableHandle) -> RemovableHandle:
    """Marks ``handle``'s hook as Egeria's; returns the handle."""
    _MARKED.add(handle.id)
    return handle


def unmark(handle: RemovableHandle) -> None:
    """Removes ``handle``'s hook and forgets its mark."""
    handle.remove()
    _MARKED.discard(handle.id)


def is_marked(hook_id: int) -> bool:
    """Whether the hook with this id was installed by Egeria."""
    return hook_id in _MARKED
