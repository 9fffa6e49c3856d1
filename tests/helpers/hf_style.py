"""A tiny GPT-2-like model laid out the Hugging Face way, without depending on transformers.

Test helper (not a test file): mimics what adapters meet in HF causal LMs -- a config
object, ``model.transformer.{wte, wpe, drop, h, ln_f}``, ``model.lm_head`` tied to
``wte``, and blocks that take ``attention_mask`` by keyword and return a tuple.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyGPTBlock", "TinyGPTConfig", "TinyGPTModel", "TinyGPTTransformer"]


@dataclass(frozen=True)
class TinyGPTConfig:
    """Sizes of a :class:`TinyGPTModel`, named as in ``transformers.GPT2Config``."""

    # Number of token ids.
    vocab_size: int = 64
    # Hidden width.
    n_embd: int = 32
    # Number of blocks in ``transformer.h``.
    n_layer: int = 2
    # Attention heads; must divide n_embd.
    n_head: int = 4
    # Longest sequence (size of ``wpe``).
    n_positions: int = 32
    # Share ``lm_head.weight`` with ``transformer.wte.weight``.
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


class TinyGPTBlock(nn.Module):
    """Pre-norm GPT-2 block; ``forward(hidden_states, attention_mask=None) -> (hidden_states,)``."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.mlp_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor]:
        """Causal block over ``(B, T, n_embd)``.

        Args:
            hidden_states: ``(B, T, n_embd)``.
            attention_mask: optional additive mask ``(B, 1, 1, T)`` (0 to keep a key,
                a large negative number to drop it), applied on top of the causal mask.

        Returns:
            A 1-tuple ``(hidden_states,)`` with ``(B, T, n_embd)``, as HF blocks return.
        """
        b, t, d = hidden_states.shape
        q, k, v = self.c_attn(self.ln_1(hidden_states)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            neg = torch.finfo(q.dtype).min
            causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            bias = torch.zeros(t, t, dtype=q.dtype, device=q.device).masked_fill(~causal, neg)
            bias = (bias + attention_mask.to(q.dtype)).clamp(min=neg)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        hidden_states = hidden_states + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        mlp = self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(hidden_states))))
        return (hidden_states + mlp,)


class TinyGPTTransformer(nn.Module):
    """The ``model.transformer`` trunk: ``wte``, ``wpe``, ``drop``, ``h``, ``ln_f``."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(TinyGPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Map ``input_ids (B, T)`` (and a 0/1 padding mask ``(B, T)``) to ``(B, T, n_embd)``."""
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(positions))
        extended = None
        if attention_mask is not None:
            keep = attention_mask[:, None, None, :].to(hidden_states.dtype)
            extended = (1.0 - keep) * torch.finfo(hidden_states.dtype).min
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask=extended)[0]
        return self.ln_f(hidden_states)


class TinyGPTModel(nn.Module):
    """GPT-2-like causal LM: ``transformer`` trunk plus a bias-free ``lm_head``."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = TinyGPTTransformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Map ``input_ids (B, T)`` int64 to logits ``(B, T, vocab_size)``."""
        return self.lm_head(self.transformer(input_ids, attention_mask=attention_mask))
