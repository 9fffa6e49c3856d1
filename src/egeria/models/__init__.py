"""Reference models for Egeria's experiments: CIFAR-style ResNets and a small Transformer LM."""

from __future__ import annotations

from egeria.models.resnet import BasicBlock, ResNet, resnet
from egeria.models.transformer_lm import CausalSelfAttention, TransformerBlock, TransformerLM, next_token_loss

__all__ = [
    "BasicBlock",
    "CausalSelfAttention",
    "ResNet",
    "TransformerBlock",
    "TransformerLM",
    "next_token_loss",
    "resnet",
]
