"""Penn Treebank as sentences of word ids for a BERT-style encoder: the PTB vocabulary with
four special tokens in front, the sentences of a split, and their fixed-length encoding.

Id 0 is ``[PAD]``, 1 ``[CLS]``, 2 ``[SEP]``, 3 ``[MASK]``; the PTB word of id ``w`` (in
:func:`egeria.data.load_ptb`'s vocabulary) is id ``w + 4``. A sentence is a line of the
PTB text, its ``<eos>`` left out. The pretraining (``scripts/pretrain_ptb_lm.py``)
and the fine-tuning task (:mod:`egeria.bench.word_order`) share this encoding.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SPECIALS", "PAD", "CLS", "SEP", "MASK", "vocab_size", "sentences", "encode"]

SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
PAD, CLS, SEP, MASK = range(len(SPECIALS))


def vocab_size(corpus) -> int:
    """Ids in the encoder's vocabulary: the specials and every PTB word (``<eos>`` included,
    never used)."""
    return len(SPECIALS) + corpus.vocab_size


def sentences(corpus, split: str) -> list[torch.Tensor]:
    """The sentences of ``split`` (``"train"``, ``"valid"`` or ``"test"``) of a
    :class:`egeria.data.PTBCorpus`, in the text's order, each an int64 tensor of encoder ids.

    Raises:
        ValueError: naming ``split`` when it is not one of the three.
    """
    if split not in ("train", "valid", "test"):
        raise ValueError(f"unknown PTB split {split!r}; choose 'train', 'valid' or 'test'")
    stream = getattr(corpus, split)
    eos = corpus.vocab.index("<eos>")
    ends = (stream == eos).nonzero().flatten().tolist()
    out, start = [], 0
    for end in ends:
        if end > start:
            out.append(stream[start:end] + len(SPECIALS))
        start = end + 1
    return out


def encode(words: Sequence[int] | torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[CLS] words [SEP]`` padded with ``[PAD]`` (or cut: at most ``length - 2`` words) to
    ``length``; returns ``(input_ids, attention_mask)``, int64 of shape ``(length,)``.

    Raises:
        ValueError: naming ``length`` when it is below 3.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 3:
        raise ValueError(f"encode needs length >= 3 ([CLS], a word, [SEP]), got length={length!r}")
    words = torch.as_tensor(words, dtype=torch.int64)[: length - 2]
    ids = torch.full((length,), PAD, dtype=torch.int64)
    ids[0] = CLS
    ids[1 : 1 + len(words)] = words
    ids[1 + len(words)] = SEP
    mask = (ids != PAD).long()
    return ids, mask
