"""Bigram shift on Penn Treebank: is this sentence as written, or were two adjacent words
swapped? The fine-tuning task of issue 28's suite (``gpt-ptb-bshift``).

Why this task: it is built from real text alone (PTB sentences, no labels to invent), it is
balanced, and it cannot be solved from the words present (both classes hold the same
words): the model must judge word order, which is syntax, what masked-language
pretraining teaches and what a classifier trained from scratch on 40,000 sentences learns
slowly. It is SentEval's "BShift" probing task (Conneau et al., 2018) rebuilt on PTB. Some
swaps leave a grammatical sentence ("he said yesterday" / "yesterday he said" are rare, but
"N N" numbers or coordinated nouns swap freely), so no model reaches 100%: the ceiling is
below it and is the same for every run.

Each sentence gets label 1 (swapped) or 0 (as written), exactly half of each; a swapped
sentence has two adjacent *different* words exchanged at a position drawn uniformly from
those that survive the cut to the encoding's length. Labels and positions come from one
generator seeded by ``data_seed`` (0 for the task), the same for every training seed, so
the task is fixed and the seeds vary the training alone.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import Dataset

from .ptb_sentences import encode

__all__ = ["BigramShift"]


class BigramShift(Dataset):
    """Sentences, half of them with one adjacent pair of words swapped, encoded for a
    pretrained classifier: item ``i`` is ``{"input_ids", "attention_mask", "labels"}``.

    Args:
        sentences: word-id tensors (:func:`egeria.bench.ptb_sentences.sentences`).
        length: the encoding's length, ``[CLS]`` and ``[SEP]`` included.
        data_seed: seeds the labels and the swap positions.

    Attributes:
        swaps: per kept sentence, the position swapped (with the next one), or -1.

    Raises:
        ValueError: naming ``length`` when below 4, or when no sentence has two adjacent
            different words within it.
    """

    def __init__(self, sentences: Sequence[torch.Tensor], length: int, data_seed: int = 0) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 4:
            raise ValueError(f"BigramShift needs length >= 4 ([CLS], two words, [SEP]), got length={length!r}")
        kept, positions = [], []
        for s in sentences:
            words = s[: length - 2]
            where = (words[:-1] != words[1:]).nonzero().flatten()
            if len(where):
                kept.append(words)
                positions.append(where)
        if not kept:
            raise ValueError(f"BigramShift: none of the {len(sentences)} sentences has two adjacent different words")
        g = torch.Generator().manual_seed(data_seed)
        labels = torch.zeros(len(kept), dtype=torch.int64)
        labels[torch.randperm(len(kept), generator=g)[: len(kept) // 2]] = 1
        ids = torch.empty(len(kept), length, dtype=torch.int64)
        masks = torch.empty_like(ids)
        self.swaps = []
        for i, (words, where) in enumerate(zip(kept, positions)):
            j = int(where[torch.randint(len(where), (1,), generator=g)]) if labels[i] else -1
            if j >= 0:
                words = words.clone()
                words[j], words[j + 1] = words[j + 1].clone(), words[j].clone()
            ids[i], masks[i] = encode(words, length)
            self.swaps.append(j)
        self.input_ids, self.attention_mask, self.labels = ids, masks, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index], "labels": self.labels[index]}
