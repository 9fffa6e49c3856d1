"""Offline datasets for Egeria's experiments: Fashion-MNIST, MNIST-5k, Penn Treebank."""

from __future__ import annotations

from egeria.data.fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist
from egeria.data.mnist5k import MNIST_MEAN, MNIST_STD, load_mnist5k
from egeria.data.ptb import EOS, LMWindows, PTBCorpus, load_ptb

__all__ = [
    "EOS",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "LMWindows",
    "MNIST_MEAN",
    "MNIST_STD",
    "PTBCorpus",
    "load_fashion_mnist",
    "load_mnist5k",
    "load_ptb",
]
