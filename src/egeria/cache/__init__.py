"""Skipping the frozen prefix's forward pass with cached activations (paper 4.3).

``loader = eg.cache_loader(loader)`` is all a training loop needs; :class:`Augmented`
keeps data augmentation compatible with caching.
"""

from .datasets import Augmented, Keyed, random_reason
from .loader import CachedLoader
from .manager import ActivationCache

__all__ = ["ActivationCache", "Augmented", "CachedLoader", "Keyed", "random_reason"]
