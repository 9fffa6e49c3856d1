"""Tensors inside JSON (raw bytes in base64, with dtype and shape), and a checkpoint
folder that keeps them as tensors instead: ``egeria.json`` (the state, each tensor
replaced by a reference, and the name of its tensor file) beside ``egeria-<id>.pt`` (the
tensors). The tensor file is written under a new name first, then ``egeria.json`` is
renamed into place (the commit), then older tensor files go: a crash or a full disk at
any point leaves the previous checkpoint whole and never pairs one save's JSON with
another's tensors."""

from __future__ import annotations

import base64
import json
import os
import pickle
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

__all__ = ["encode_tensor", "decode_tensor", "write_state", "read_state", "saved_steps", "STATE_FILE"]

#: The file that commits a checkpoint folder written by :func:`write_state`.
STATE_FILE = "egeria.json"


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_state(state: dict, directory: str | os.PathLike[str]) -> None:
    """Writes a JSON-safe state with encoded tensors as ``egeria.json`` + ``egeria-<id>.pt``."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = _split(state, tensors)
    name = f"egeria-{uuid.uuid4().hex[:12]}.pt"
    _atomic_write(folder / name, lambda f: torch.save(tensors, f))
    _atomic_write(folder / STATE_FILE, lambda f: f.write(json.dumps({"tensors_file": name, "state": meta}).encode()))
    for old in folder.glob("egeria-*.pt"):
        if old.name != name:
            old.unlink(missing_ok=True)


def saved_steps(directory: str | os.PathLike[str]) -> int | None:
    """The optimizer steps of the Egeria state in ``directory`` (read from its JSON alone);
    None where there is no readable one."""
    try:
        return int(json.loads((Path(directory) / STATE_FILE).read_text())["state"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        saved = json.loads((folder / STATE_FILE).read_text())
        tensors = torch.load(folder / saved["tensors_file"], map_location="cpu", weights_only=True)
    except (json.JSONDecodeError, KeyError, TypeError, RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:
        raise ValueError(f"the Egeria checkpoint in {folder} cannot be read: {err}") from err
    return _join(saved["state"], tensors)
