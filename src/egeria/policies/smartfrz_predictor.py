"""SmartFRZ's attention-based freezing predictor and the weights shipped with egeria.

The predictor reads one layer module's window of T weight samples (oldest first, each
normalised by :func:`~egeria.policies.smartfrz_sampling.normalise_window`): the older
T - 1 snapshots give keys and values, the newest the query, each through its own small
MLP to ``dim`` (64) dimensions; scaled dot-product softmax attention over the keys pools
the values, and an MLP maps the pooled vector to two logits, (keep training, freeze)::

    k_t = f_k(x_t), v_t = f_v(x_t)   t < T          q = f_q(x_T)
    a   = softmax_t(q . k_t / sqrt(dim))            z = sum_t a_t v_t
    logits = f_o(z)

The weights are trained once, offline, by ``benchmarks/smartfrz_train.py`` and shipped as
``smartfrz_weights.pt`` beside this module; :func:`load_shipped` checks the file's
SHA-256 and format version before building the predictor.
"""

from __future__ import annotations

import hashlib
import io
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["AttentionPredictor", "load_shipped", "WEIGHTS_FILE", "WEIGHTS_SHA256", "WEIGHTS_VERSION", "pack_weights"]

#: The shipped weights, inside the package.
WEIGHTS_FILE = Path(__file__).with_name("smartfrz_weights.pt")
#: Format version of the weights file (its ``version`` entry).
WEIGHTS_VERSION = 1
#: SHA-256 of the shipped file, written by ``benchmarks/smartfrz_train.py``.
WEIGHTS_SHA256 = "f7ead34a9ed1082f5444bc957023bd8ad5459f47ad32697a8834fba2883f1902"


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


class AttentionPredictor(nn.Module):
    """Window of weight samples -> (keep, freeze) logits.

    Args:
        size: values per snapshot (the sample size S).
        hidden: hidden width of the key, query and value MLPs.
        dim: width of keys, queries and values.
        head_hidden: hidden width of the output MLP.
    """

    def __init__(self, size: int = 1024, hidden: int = 128, dim: int = 64, head_hidden: int = 32) -> None:
        super().__init__()
        self.size, self.hidden, self.dim, self.head_hidden = size, hidden, dim, head_hidden
        self.key = _mlp(size, hidden, dim)
        self.query = _mlp(size, hidden, dim)
        self.value = _mlp(size, hidden, dim)
        self.head = _mlp(dim, head_hidden, 2)

    def config(self) -> dict[str, int]:
        return {"size": self.size, "hidden": self.hidden, "dim": self.dim, "head_hidden": self.head_hidden}

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """Args:
            windows: (B, T, S) normalised windows, oldest snapshot first, T >= 2.

        Returns:
            (B, 2) logits; index 1 is "freeze".
        """
        if windows.dim() != 3 or windows.shape[1] < 2 or windows.shape[2] != self.size:
            raise ValueError(f"windows of shape {tuple(windows.shape)}: expected (batch, T >= 2, {self.size})")
        older, newest = windows[:, :-1], windows[:, -1]
        keys, values = self.key(older), self.value(older)  # (B, T-1, dim)
        query = self.query(newest)  # (B, dim)
        scores = torch.einsum("bd,btd->bt", query, keys) / math.sqrt(self.dim)
        pooled = torch.einsum("bt,btd->bd", scores.softmax(dim=1), values)
        return self.head(pooled)


def pack_weights(predictor: AttentionPredictor, meta: dict[str, Any]) -> bytes:
    """The bytes of a weights file: version, the predictor's shape, its tensors, ``meta``
    (how it was trained: window, sample size, runs)."""
    buffer = io.BytesIO()
    state = {k: v.detach().clone() for k, v in predictor.state_dict().items()}
    torch.save({"version": WEIGHTS_VERSION, "config": predictor.config(), "state": state, "meta": meta}, buffer)
    return buffer.getvalue()


def load_shipped(path: str | Path | None = None, sha256: str | None = None) -> tuple[AttentionPredictor, dict[str, Any]]:
    """The trained predictor (eval mode) and the training metadata stored with it.

    Args:
        path: the weights file; default the one shipped in the package.
        sha256: the file's expected SHA-256; default :data:`WEIGHTS_SHA256` for the
            shipped file, none checked for another path.

    Raises:
        FileNotFoundError: the file is missing (an install without package data).
        ValueError: a checksum or version that does not match, or a malformed file.
    """
    path = Path(path) if path is not None else WEIGHTS_FILE
    if sha256 is None and path == WEIGHTS_FILE:
        sha256 = WEIGHTS_SHA256
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and digest != sha256:
        raise ValueError(
            f"SmartFRZ weights {path} have SHA-256 {digest}, expected {sha256}: the file is damaged or from another "
            "version; reinstall egeria or retrain with benchmarks/smartfrz_train.py"
        )
    saved = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("version") != WEIGHTS_VERSION:
        found = saved.get("version") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"SmartFRZ weights {path}: version {found!r}, this egeria reads version {WEIGHTS_VERSION}")
    predictor = AttentionPredictor(**saved["config"])
    predictor.load_state_dict(saved["state"])
    predictor.eval()
    for param in predictor.parameters():
        param.requires_grad_(False)
    return predictor, dict(saved.get("meta", {}))
