"""Word order on Penn Treebank: is this sentence as written, or were its words shuffled?
The fine-tuning task of issue 28's suite (``gpt-ptb-order``) and, tokenized for the pretrained
all-MiniLM-L6-v2, of issue 50's (``minilm-ptb-order``).

Why this task: it is built from real text alone (PTB sentences, no labels to invent), it is
balanced, and it cannot be solved from the words present (both classes hold the same
words): the model must judge word order, which is what language-model pretraining teaches
and what a classifier trained from scratch learns slowly. A pretrained model fine-tunes to
it over the run (the suite's GPT-style model, fine-tuned by hand on 6,400 sentences at lr
1e-4: held-out accuracy 0.71, 0.82 and 0.84 after 50, 100 and 150 steps).

The harder probe first tried, bigram shift (SentEval's BShift: two adjacent words swapped),
did not learn at this scale: the same model stayed at 50% held-out accuracy through a whole
3-epoch run (``benchmarks/results/tta-full/cpu/gpt-ptb-bshift/none-seed0.json``) and by hand
at lr 1e-4 and 5e-4, as the masked (BERT-style) model had.

Each sentence gets label 1 (shuffled) or 0 (as written), exactly half of each; a shuffled
sentence's words, as cut to the encoding's length, are put in a uniformly random order that
differs from the written one (redrawn until it does). Labels and orders come from one
generator seeded by ``data_seed`` (:data:`DATA_SEED` for the task), the same for every
training seed, so the task is fixed and the seeds vary the training alone.

Why the task's seed is not 0: the Trainer draws each epoch's order as ``randperm(n)`` from a
generator seeded with the run's seed, and labels drawn as ``randperm(n)`` from the same seed
are that very order. The first runs of this task (and of bigram shift) labelled with seed 0:
a seed-0 run's first epoch was every shuffled sentence, then every written one, and it sat
at 50% held-out accuracy for that whole epoch (``gpt-ptb-order`` plain and Egeria seed 0 in
``benchmarks/results/superseded/``). Bigram shift stayed at chance in the mixed epochs that
followed as well.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.data import Dataset

from .ptb_sentences import encode

__all__ = ["DATA_SEED", "WordOrder"]

DATA_SEED = 20_261_125
"""The task's labels and orders: a seed no training run uses (see the module's text)."""


class WordOrder(Dataset):
    """Sentences, half of them with their words shuffled, encoded for a pretrained
    classifier: item ``i`` is ``{"input_ids", "attention_mask", "labels"}``.

    Args:
        sentences: word-id tensors (:func:`egeria.bench.ptb_sentences.sentences`).
        length: the encoding's length, ``[CLS]`` and ``[SEP]`` included.
        data_seed: seeds the labels and the orders (:data:`DATA_SEED` by default).
        encoding: ``encoding(words, length) -> (input_ids, attention_mask)`` of a sentence
            (its PTB word ids, as written or shuffled): :func:`~egeria.bench.ptb_sentences.encode`
            by default, the suite's own vocabulary; another model's tokenizer for task (f).

    Attributes:
        orders: per kept sentence, the permutation applied to its words (None: as written).

    Raises:
        ValueError: naming ``length`` when below 4, or when no sentence has two different
            words within it.
    """

    def __init__(self, sentences: Sequence[torch.Tensor], length: int, data_seed: int = DATA_SEED,
                 encoding: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] = encode) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 4:
            raise ValueError(f"WordOrder needs length >= 4 ([CLS], two words, [SEP]), got length={length!r}")
        kept = [s[: length - 2] for s in sentences if len(torch.unique(s[: length - 2])) > 1]
        if not kept:
            raise ValueError(f"WordOrder: none of the {len(sentences)} sentences has two different words")
        g = torch.Generator().manual_seed(data_seed)
        labels = torch.zeros(len(kept), dtype=torch.int64)
        labels[torch.randperm(len(kept), generator=g)[: len(kept) // 2]] = 1
        ids = torch.empty(len(kept), length, dtype=torch.int64)
        masks = torch.empty_like(ids)
        self.orders: list[torch.Tensor | None] = []
        for i, words in enumerate(kept):
            order = None
            if labels[i]:
                order = torch.randperm(len(words), generator=g)
                while torch.equal(words[order], words):  # ends: the sentence has two different words
                    order = torch.randperm(len(words), generator=g)
                words = words[order]
            ids[i], masks[i] = encoding(words, length)
            self.orders.append(order)
        self.input_ids, self.attention_mask, self.labels = ids, masks, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index], "labels": self.labels[index]}
