"""Tensors inside JSON (raw bytes in base64, with dtype and shape), and a checkpoint
folder that keeps them as tensors instead: ``egeria.json`` (the state, each tensor
replaced by a reference, and the name of its tensor file) beside ``egeria-<id>.pt`` (the
tensors, ``<id>`` 12 hex digits).

A save holds ``.egeria.lock`` (``flock``) so that saves into one folder (every rank of a
job, two threads) follow each other: the tensor file is written under a new name first,
then ``egeria.json`` is renamed into place (the commit) and the folder synced, then the
tensor file the *previous* ``egeria.json`` named goes. A crash or a full disk at any point
leaves the previous checkpoint whole and never pairs one save's JSON with another's
tensors; the last complete save is the one that loads. A save removes nothing but that one
file and its own leftover temporary files (exact names): a user's ``egeria-best.pt`` beside
them stays.

A reader opens only a plain file named inside the folder (no path, no link out, no FIFO),
and :func:`saved_steps` answers None for anything it cannot read."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import re
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

__all__ = ["encode_tensor", "decode_tensor", "write_state", "read_state", "saved_steps", "STATE_FILE"]

#: The file that commits a checkpoint folder written by :func:`write_state`.
STATE_FILE = "egeria.json"
_TENSORS = re.compile(r"egeria-[0-9a-f]{12}\.pt")  # the tensor files a save writes, exactly
_LOCK = ".egeria.lock"
_TEMP_PREFIXES = (f".{STATE_FILE}.", ".egeria-")  # _atomic_write's temporary files of both


def encode_tensor(tensor: torch.Tensor) -> dict:
    """A JSON-safe dict holding ``tensor`` exactly (any dtype, any shape)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes()
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "data": base64.b64encode(raw).decode("ascii"),
    }


def decode_tensor(entry: dict) -> torch.Tensor:
    """The tensor stored by :func:`encode_tensor`, on the CPU."""
    dtype = getattr(torch, entry["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {entry['dtype']!r} in saved state")
    raw = bytearray(base64.b64decode(entry["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(entry["shape"]).clone()


def _is_encoded(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"dtype", "shape", "data"}


def _split(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with each encoded tensor moved into ``tensors`` and replaced by its key."""
    if _is_encoded(value):
        key = f"t{len(tensors)}"
        tensors[key] = decode_tensor(value)
        return {"tensor": key}
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # a tuple comes back a list, as from JSON
        return [_split(v, tensors) for v in value]
    return value


def _join(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor"}:
        try:
            return encode_tensor(tensors[value["tensor"]])
        except KeyError:
            raise ValueError(f"the checkpoint's egeria.pt lacks tensor {value['tensor']!r}") from None
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join(v, tensors) for v in value]
    return value


def _atomic_write(path: Path, write: Any) -> None:
    """Writes through a temporary file in the same folder, then renames it over ``path``:
    a crash or a full disk leaves the previous file whole."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sync_folder(folder: Path) -> None:
    """Makes the renames in ``folder`` durable (where the platform can open a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(folder: Path, *, shared: bool = False):
    """Holds the folder's save lock: exclusive for a save (one at a time, across threads
    and processes), shared for a read (no save removes the tensor file it is reading). A
    reader that cannot open the lock (a read-only folder) reads without it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: saves are not serialised across processes
        yield
        return
    try:
        handle = open(folder / _LOCK, "r" if shared else "a")
    except OSError:
        if not shared:
            raise
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _named_tensor_file(folder: Path) -> str | None:
    """The tensor file ``egeria.json`` names now, where it is one a save wrote."""
    try:
        name = json.loads((folder / STATE_FILE).read_text())["tensors_file"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return name if isinstance(name, str) and _TENSORS.fullmatch(name) else None


def write_state(state: dict, directory: str | os.PathLike[str]) -> None:
    """Writes a JSON-safe state with encoded tensors as ``egeria.json`` + ``egeria-<id>.pt``
    (see the module's docstring for what it removes: only its own files)."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = _split(state, tensors)
    name = f"egeria-{uuid.uuid4().hex[:12]}.pt"
    with _locked(folder):
        previous = _named_tensor_file(folder)
        _atomic_write(folder / name, lambda f: torch.save(tensors, f))
        try:
            _atomic_write(folder / STATE_FILE, lambda f: f.write(json.dumps({"tensors_file": name, "state": meta}).encode()))
        except BaseException:
            (folder / name).unlink(missing_ok=True)  # never committed: ours, and no use to anyone
            raise
        _sync_folder(folder)
        if previous is not None and previous != name:
            (folder / previous).unlink(missing_ok=True)
        for leftover in folder.iterdir():  # a crashed save's temporary files (we hold the lock)
            if leftover.name.startswith(_TEMP_PREFIXES) and leftover.name.endswith(".tmp"):
                leftover.unlink(missing_ok=True)


def saved_steps(directory: str | os.PathLike[str]) -> int | None:
    """The optimizer steps of the Egeria state in ``directory`` (read from its JSON alone);
    None where there is no readable one, whatever is wrong with it."""
    try:
        steps = json.loads((Path(directory) / STATE_FILE).read_text())["state"]["steps"]
    except Exception:  # noqa: BLE001 - any damage means "no state here"
        return None
    return steps if type(steps) is int and 0 <= steps < 2**63 else None


def _tensor_file(folder: Path, saved: Any) -> Path:
    """The tensor file ``egeria.json`` names: a plain file directly inside ``folder``."""
    name = saved.get("tensors_file") if isinstance(saved, dict) else None
    if not isinstance(name, str) or not _TENSORS.fullmatch(name):
        raise ValueError(f"egeria.json names the tensor file {name!r}, not egeria-<12 hex digits>.pt in the folder")
    path = folder / name
    try:
        mode = os.lstat(path).st_mode
    except OSError as err:
        raise ValueError(f"the tensor file {name!r} that egeria.json names cannot be read: {err}") from err
    if not stat.S_ISREG(mode):
        raise ValueError(f"the tensor file {name!r} that egeria.json names is not a plain file")
    return path


def read_state(directory: str | os.PathLike[str]) -> dict:
    """The state written by :func:`write_state`.

    Raises:
        FileNotFoundError: the folder lacks one of the files.
        ValueError: the files do not belong together or cannot be read.
    """
    folder = Path(directory)
    if not (folder / STATE_FILE).is_file():
        raise FileNotFoundError(f"{folder} has no Egeria checkpoint: missing {STATE_FILE}")
    try:
        with _locked(folder, shared=True):
            saved = json.loads((folder / STATE_FILE).read_text())
            tensors = torch.load(_tensor_file(folder, saved), map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict) or "state" not in saved:
            raise ValueError("it does not hold a state and a dict of tensors")
        return _join(saved["state"], tensors)
    except ValueError as err:
        raise ValueError(f"the Egeria checkpoint in {folder} cannot be read: {err}") from err
    except (KeyError, TypeError, RuntimeError, EOFError, OSError, RecursionError, pickle.UnpicklingError) as err:
        raise ValueError(f"the Egeria checkpoint in {folder} cannot be read: {err!r}") from err
