"""Fashion-MNIST (Xiao et al. 2017) from the four IDX files, as a normalised TensorDataset."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .files import open_data, packed_or_plain

__all__ = [
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_ROOT",
    "FASHION_MNIST_STD",
    "load_fashion_mnist",
    "read_idx",
]

logger = logging.getLogger(__name__)

#: Where the Debian package ``dataset-fashion-mnist`` installs the files.
FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
#: Pixel mean and standard deviation of the training images, on the [0, 1] scale.
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

_PREFIX = {"train": "train", "test": "t10k"}

# Third byte of the magic number -> big-endian numpy dtype of the payload.
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file, gzipped (by its ``.gz`` suffix) or not, into a numpy array.

    The format: two zero bytes, a dtype code, the number of dimensions ``ndim``; then
    ``ndim`` big-endian uint32 sizes; then the payload in C order, big-endian.

    Args:
        path: the file to read.

    Returns:
        An array of shape ``(d0, d1, ...)`` as declared by the header, in native byte order.

    Raises:
        ValueError: naming the file when the magic number is not an IDX one, or when the
            payload size disagrees with the declared dimensions.
    """
    path = Path(path)
    try:
        with open_data(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"cannot read IDX file {path}: {exc}") from exc
    if len(raw) < 4:
        raise ValueError(f"IDX file {path} is too short ({len(raw)} bytes) to hold a header")
    zero0, zero1, code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise ValueError(
            f"IDX file {path} has bad magic number 0x{int.from_bytes(raw[:4], 'big'):08x}"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"IDX file {path} is truncated inside its {ndim}-dimension header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) - header_len
    if actual != expected:
        raise ValueError(
            f"IDX file {path} declares dims {dims} ({expected} payload bytes) "
            f"but holds {actual} payload bytes"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def load_fashion_mnist(
    root: str | Path = FASHION_MNIST_ROOT,
    split: str = "train",
    limit: int | None = None,
) -> TensorDataset:
    """Load a Fashion-MNIST split: 60,000 training or 10,000 test 28x28 images, 10 classes.

    Reads ``{train,t10k}-images-idx3-ubyte`` and ``{train,t10k}-labels-idx1-ubyte`` from
    ``root``, each gzipped (``.gz``, preferred when both exist) or plain. Pixels are scaled
    to [0, 1] and then normalised with :data:`FASHION_MNIST_MEAN` / :data:`FASHION_MNIST_STD`.

    Args:
        root: directory holding the four IDX files.
        split: ``"train"`` or ``"test"``.
        limit: keep only the first ``limit`` samples (file order) when given.

    Returns:
        A ``TensorDataset`` of ``images`` float32 ``(N, 1, 28, 28)`` and ``labels`` int64
        ``(N,)`` with values in ``0..9``.

    Raises:
        ValueError: on a bad ``split`` or ``limit``, or a corrupted file (the message
            names the file).
        FileNotFoundError: when ``root`` or a file is missing; the message says how to
            install the data.
    """
    if split not in _PREFIX:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    root = Path(root)
    prefix = _PREFIX[split]
    images_path = _find(root, f"{prefix}-images-idx3-ubyte")
    labels_path = _find(root, f"{prefix}-labels-idx1-ubyte")

    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise ValueError(
            f"IDX file {images_path} should hold uint8 images (N, 28, 28), "
            f"got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError(
            f"IDX file {labels_path} should hold {images.shape[0]} labels, got shape {labels.shape}"
        )
    if labels.size and int(labels.max()) > 9:
        raise ValueError(f"IDX file {labels_path} holds label {int(labels.max())}, outside 0..9")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]

    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32).div_(255.0)
    x = x.sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    logger.debug("loaded Fashion-MNIST %s: %d samples from %s", split, len(y), root)
    return TensorDataset(x, y)


def _find(root: Path, name: str) -> Path:
    """Path of ``name.gz`` or ``name`` under ``root``; FileNotFoundError with install hint."""
    hint = (
        "install the Debian package with `apt-get install dataset-fashion-mnist` "
        f"(files land in {FASHION_MNIST_ROOT}), or pass root= a directory holding the "
        "four IDX files (gzipped or not)"
    )
    if not root.is_dir():
        raise FileNotFoundError(f"Fashion-MNIST directory {root} does not exist: {hint}")
    found = packed_or_plain(root, name)
    if found is not None:
        return found
    raise FileNotFoundError(f"Fashion-MNIST file {name}[.gz] not found in {root}: {hint}")
