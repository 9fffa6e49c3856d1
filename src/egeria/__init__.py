"""egeria: knowledge-guided layer freezing for faster DNN training (EuroSys'23), on PyTorch."""

from __future__ import annotations

from .averaging import WeightAverage
from .config import EgeriaConfig
from .decision import Decision
from .engine import Egeria
from .knowledge import KnowledgeGuided, LRDropRule, UnfreezeContext, derive_eval_interval, sp_loss
from .partition import LayerModule, Partition, partition_model

__all__ = [
    "Egeria",
    "EgeriaConfig",
    "Decision",
    "sp_loss",
    "LRDropRule",
    "WeightAverage",
    "UnfreezeContext",
    "derive_eval_interval",
    "KnowledgeGuided",
    "partition_model",
    "Partition",
    "LayerModule",
]

__version__ = "0.1.0"
