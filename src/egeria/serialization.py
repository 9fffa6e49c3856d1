"""Tensors inside JSON: raw bytes in base64, with dtype and shape."""

from __future__ import annotations

import base64

import torch

__all__ = ["encode_tensor", "decode_tensor"]


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
