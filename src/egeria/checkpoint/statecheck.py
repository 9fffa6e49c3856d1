"""Checks a saved state before anything takes it: every field's type and range, named by
its path, as one ``ValueError``.

A state comes from ``egeria.json`` (or a user's own checkpoint), so it may be damaged,
truncated, from another model or hostile. Loading it in two steps, check the whole of it
here and only then apply it, is what leaves an Egeria unchanged by a state it refuses.

A spec is a function ``spec(value, path)`` that returns None or raises
:class:`StateError`; the builders below make them::

    WATCH = record({"window": integer(1), "raw": items(number())}, optional=("lr",))
    check(saved, WATCH, "policy_state.watch")
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Any, Callable, Iterable, Mapping

import torch

__all__ = [
    "StateError",
    "Spec",
    "check",
    "anything",
    "integer",
    "number",
    "boolean",
    "text",
    "optional",
    "items",
    "mapping",
    "index_keys",
    "keyed",
    "sequence",
    "record",
    "encoded_tensor",
    "nested",
]

Spec = Callable[[Any, str], None]


class StateError(ValueError):
    """A saved state that cannot be taken: ``path`` names the field, ``value`` is what it held."""

    def __init__(self, path: str, value: Any, problem: str) -> None:
        super().__init__(f"saved Egeria state field {path} = {_shown(value)} {problem}")
        self.path = path


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check(value: Any, spec: Spec, path: str = "state") -> None:
    """Raises :class:`StateError` naming the first field of ``value`` that ``spec`` refuses."""
    try:
        spec(value, path)
    except RecursionError:
        raise StateError(path, "...", "is nested too deeply") from None


def anything(value: Any, path: str) -> None:
    """Any JSON value (kept, never interpreted)."""


def _is_int(value: Any) -> bool:
    return type(value) is int


def _within(value: float, path: str, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise StateError(path, value, f"is below {lo}")
    if hi is not None and value > hi:
        raise StateError(path, value, f"is above {hi}")


def integer(lo: int | None = None, hi: int | None = None) -> Spec:
    """An int (not a bool) in ``[lo, hi]``."""

    def spec(value: Any, path: str) -> None:
        if not _is_int(value):
            raise StateError(path, value, "is not an integer")
        _within(value, path, lo, hi)

    return spec


def number(lo: float | None = None, hi: float | None = None) -> Spec:
    """A finite int or float in ``[lo, hi]``."""

    def spec(value: Any, path: str) -> None:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise StateError(path, value, "is not a finite number")
        _within(value, path, lo, hi)

    return spec


def boolean(value: Any, path: str) -> None:
    if type(value) is not bool:
        raise StateError(path, value, "is not true or false")


def text(choices: Iterable[str] | None = None, pattern: str | None = None) -> Spec:
    """A string, one of ``choices`` or matching ``pattern`` where given."""
    allowed = None if choices is None else frozenset(choices)
    regex = None if pattern is None else re.compile(pattern)

    def spec(value: Any, path: str) -> None:
        if type(value) is not str:
            raise StateError(path, value, "is not a string")
        if allowed is not None and value not in allowed:
            raise StateError(path, value, f"is not one of {sorted(allowed)}")
        if regex is not None and not regex.fullmatch(value):
            raise StateError(path, value, f"does not match {pattern!r}")

    return spec


def optional(inner: Spec) -> Spec:
    """None, or what ``inner`` takes."""

    def spec(value: Any, path: str) -> None:
        if value is not None:
            inner(value, path)

    return spec


def items(inner: Spec, *, most: int | None = None, length: int | None = None, unique: bool = False) -> Spec:
    """A list of what ``inner`` takes, of at most ``most`` entries or exactly ``length``
    (distinct if ``unique``)."""

    def spec(value: Any, path: str) -> None:
        if type(value) not in (list, tuple):  # a tuple where the state was not through JSON
            raise StateError(path, value, "is not a list")
        if length is not None and len(value) != length:
            raise StateError(path, value, f"has {len(value)} entries, not {length}")
        if most is not None and len(value) > most:
            raise StateError(path, value, f"has {len(value)} entries, more than {most}")
        for i, entry in enumerate(value):
            inner(entry, f"{path}[{i}]")
        if unique and len({repr(v) for v in value}) < len(value):
            raise StateError(path, value, "repeats an entry")

    return spec


def mapping(inner: Spec, keys: Spec | None = None) -> Spec:
    """A dict with string keys (each taken by ``keys`` where given) and values ``inner`` takes."""

    def spec(value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise StateError(path, value, "is not a mapping")
        for key, entry in value.items():
            if type(key) is not str:
                raise StateError(path, key, "has a key that is not a string")
            if keys is not None:
                keys(key, f"{path} key")
            inner(entry, f"{path}[{key!r}]")

    return spec


def keyed(specs: Mapping[str, Spec], unknown: str) -> Spec:
    """A dict whose keys are some of ``specs``'s, each value taken by its key's spec; a key
    outside them is refused with ``unknown``."""

    def spec(value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise StateError(path, value, "is not a mapping")
        for key, entry in value.items():
            inner = specs.get(key) if type(key) is str else None
            if inner is None:
                raise StateError(f"{path} key", key, unknown)
            inner(entry, f"{path}[{key!r}]")

    return spec


def sequence(*specs: Spec) -> Spec:
    """A list of exactly ``len(specs)`` entries, each taken by the spec in its place."""

    def spec(value: Any, path: str) -> None:
        if type(value) not in (list, tuple) or len(value) != len(specs):
            raise StateError(path, value, f"is not a list of {len(specs)} entries")
        for i, (entry, inner) in enumerate(zip(value, specs)):
            inner(entry, f"{path}[{i}]")

    return spec


def index_keys(lo: int, hi: int) -> Spec:
    """A key that is an integer in ``[lo, hi]`` written in decimal (as ``str(i)`` writes it)."""
    allowed = integer(lo, hi)

    def spec(value: Any, path: str) -> None:
        if not re.fullmatch(r"-?[0-9]{1,19}", value) or str(int(value)) != value:
            raise StateError(path, value, "is not an integer key")
        allowed(int(value), path)

    return spec


def record(fields: Mapping[str, Spec], *, optional: Iterable[str] = ()) -> Spec:
    """A dict with exactly these keys (those in ``optional`` may be absent)."""
    may_lack = frozenset(optional)

    def spec(value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise StateError(path, value, "is not a mapping")
        unknown = sorted(str(k) for k in value if k not in fields)
        if unknown:
            raise StateError(f"{path}.{unknown[0]}", value[unknown[0]] if unknown[0] in value else None, "is not a field it has")
        for name, inner in fields.items():
            if name not in value:
                if name in may_lack:
                    continue
                raise StateError(f"{path}.{name}", None, "is missing")
            inner(value[name], f"{path}.{name}")

    return spec


_ENCODED = frozenset({"dtype", "shape", "data"})


def encoded_tensor(shape: Iterable[int] | None = None, dtype: torch.dtype | None = None) -> Spec:
    """A tensor as :func:`egeria.checkpoint.serialization.encode_tensor` writes it, whole (its bytes
    fill its shape), of exactly ``shape`` and ``dtype`` where given."""
    want_shape = None if shape is None else list(shape)
    want_dtype = None if dtype is None else str(dtype).removeprefix("torch.")

    def spec(value: Any, path: str) -> None:
        if not isinstance(value, dict) or set(value) != _ENCODED:
            raise StateError(path, value, "is not a saved tensor")
        kind = getattr(torch, value["dtype"], None) if type(value["dtype"]) is str else None
        if not isinstance(kind, torch.dtype):
            raise StateError(f"{path}.dtype", value["dtype"], "is not a torch dtype")
        dims = value["shape"]
        if type(dims) not in (list, tuple) or not all(_is_int(d) and 0 <= d < 2**40 for d in dims) or len(dims) > 16:
            raise StateError(f"{path}.shape", dims, "is not a tensor shape")
        if want_dtype is not None and value["dtype"] != want_dtype:
            raise StateError(f"{path}.dtype", value["dtype"], f"is not this model's {want_dtype}")
        if want_shape is not None and list(dims) != want_shape:
            raise StateError(f"{path}.shape", dims, f"is not this model's {want_shape}")
        if type(value["data"]) is not str:
            raise StateError(f"{path}.data", value["data"], "is not base64 text")
        try:
            size = len(base64.b64decode(value["data"], validate=True))
        except (binascii.Error, ValueError):
            raise StateError(f"{path}.data", value["data"], "is not base64 text") from None
        expected = math.prod(dims) * torch.empty((), dtype=kind).element_size()
        if size != expected:
            raise StateError(f"{path}.data", f"<{size} bytes>", f"does not fill shape {dims} of {value['dtype']} ({expected} bytes)")

    return spec


def nested(leaf: Spec) -> Spec:
    """Lists and string-keyed dicts, to any depth, whose leaves ``leaf`` takes (a saved
    tensor counts as a leaf)."""

    def spec(value: Any, path: str) -> None:
        if isinstance(value, dict) and set(value) != _ENCODED:
            mapping(spec)(value, path)
        elif type(value) in (list, tuple):
            items(spec)(value, path)
        else:
            leaf(value, path)

    return spec
