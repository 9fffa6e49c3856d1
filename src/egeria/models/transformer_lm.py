"""A small pre-norm causal Transformer language model built from plain ``nn.Linear`` layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalSelfAttention", "TransformerBlock", "TransformerLM", "next_token_loss"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q``/``k``/``v``/``out`` projections.

    Plain ``nn.Linear`` projections (no ``nn.MultiheadAttention``), so that
    ``torch.ao.quantization.quantize_dynamic`` quantizes every one of them.

    Args:
        d_model: model width; must be divisible by ``n_heads``.
        n_heads: attention heads.
        dropout: dropout on the attention weights (training only).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T, d_model)`` to ``(B, T, d_model)``; position t attends to positions <= t."""
        b, t, d = x.shape
        h = self.n_heads

        def heads(proj: torch.Tensor) -> torch.Tensor:
            return proj.view(b, t, h, d // h).transpose(1, 2)  # (B, h, T, d/h)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + ff2(gelu(ff1(ln2(x))))``.

    Args:
        d_model: model width.
        n_heads: attention heads.
        d_ff: hidden width of the feed-forward layer.
        dropout: dropout on attention weights and on each residual branch.
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.ff2 = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, T, d_model)`` to ``(B, T, d_model)``."""
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.ff2(F.gelu(self.ff1(self.ln2(x)))))


class TransformerLM(nn.Module):
    """Decoder-only language model: ``embed + pos``, ``layers``, final ``norm``, ``head``.

    Args:
        vocab_size: number of token ids.
        d_model: model width.
        n_heads: attention heads per layer.
        n_layers: number of :class:`TransformerBlock` s in ``layers``.
        d_ff: feed-forward hidden width.
        max_len: longest sequence; size of the learned positional embedding ``pos``.
        dropout: dropout after the embeddings, on attention weights and residual branches.
        tie_weights: share ``head.weight`` with ``embed.weight`` (the same Parameter).

    Raises:
        ValueError: naming the argument when a size is not positive, ``dropout`` is not in
            ``[0, 1)`` or ``d_model`` is not divisible by ``n_heads``.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 128,
        n_heads: int = 4,
        n_layers: int = 6,
        d_ff: int = 512,
        max_len: int = 256,
        dropout: float = 0.1,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        sizes = {
            "vocab_size": vocab_size,
            "d_model": d_model,
            "n_heads": n_heads,
            "n_layers": n_layers,
            "d_ff": d_ff,
            "max_len": max_len,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={value}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={dropout}")
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, n_heads, d_ff, dropout) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.apply(_gpt_init)
        if tie_weights:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(B, T)`` int64, ``T <= max_len``, to next-token logits ``(B, T, vocab_size)``.

        Raises:
            ValueError: when ``T`` exceeds ``max_len``.
        """
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
        positions = torch.arange(t, device=tokens.device)
        x = self.drop(self.embed(tokens) + self.pos(positions))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of next-token logits ``(B, T, V)`` against targets ``(B, T)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def _gpt_init(module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
