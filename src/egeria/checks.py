"""Argument checks shared by the public entry points: a ValueError that names the value."""

from __future__ import annotations

__all__ = ["check_int"]


def check_int(value: object, what: str, *, minimum: int = 1) -> None:
    """Raises ValueError unless ``value`` is an int (not a bool) >= ``minimum``.

    Args:
        what: how the user spelled it, e.g. ``"EgeriaConfig.window"``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{what}={value!r} must be {kind}")
