"""Tied input embeddings (issue 12 item 6): a GPT-2 whose ``lm_head`` shares ``wte``'s
weight freezes its front; the shared weight then trains through the head only."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import egeria
from tiny import quick_config

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]')")

VOCAB = 48


def gpt2(n_layer: int = 4) -> torch.nn.Module:
    """A tiny GPT-2 built from a config (no download), tied ``wte``/``lm_head``, no dropout."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=n_layer, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model.train()


def token_batches(count: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, 12), generator=g) for _ in range(count)]


def static(count: int, at_step: int) -> egeria.EgeriaConfig:
    return egeria.EgeriaConfig(policy="static", policy_options={"count": count, "at_step": at_step})


def lm_step(model, opt, eg, ids) -> list[egeria.Decision]:
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return eg.step()


def test_gpt2_front_is_freezable_and_the_embedding_lookup_is_marked_detached():
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eg = egeria.Egeria(model, opt, config=quick_config(), total_steps=10, example_inputs=(token_batches(1)[0],))
    partition = eg.partition
    assert partition.freezable == len(partition) - 1
    assert partition.modules[0].detached == ["transformer.wte"]
    assert all(not m.detached for m in partition.modules[1:])
    # The shared weight is owned by the head, never frozen.
    assert "transformer.wte.weight" in partition.modules[-1].params


def test_frozen_front_stays_bit_identical_while_the_tied_weight_trains_through_the_head():
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    eg = egeria.Egeria(model, opt, config=static(2, 2), total_steps=8)
    data = token_batches(8)
    frozen_at = [d.step for ids in data[:2] for d in lm_step(model, opt, eg, ids) if d.action == "freeze"]
    assert frozen_at == [2] and len(eg.frozen) == 2
    params = dict(model.named_parameters())
    frozen_names = [p for m in eg.partition.modules[:2] for p in m.params]
    assert "transformer.wpe.weight" in frozen_names and "transformer.wte.weight" not in frozen_names
    assert all(not params[p].requires_grad for p in frozen_names)
    assert params["transformer.wte.weight"].requires_grad
    before = {name: p.detach().clone() for name, p in params.items()}
    for ids in data[2:]:
        lm_step(model, opt, eg, ids)
    for name in frozen_names:
        assert torch.equal(params[name], before[name]), name
    assert not torch.equal(params["transformer.wte.weight"], before["transformer.wte.weight"])
    eg.close()


def _tied_grad(model, ids, *, lookup_detached: bool) -> torch.Tensor:
    """Gradient of the tied weight, with the input embeddings looked up by hand (not through
    ``wte``'s hooks) and given as ``inputs_embeds``, detached or not."""
    model.zero_grad(set_to_none=True)
    embeds = torch.nn.functional.embedding(ids, model.transformer.wte.weight)
    if lookup_detached:
        embeds = embeds.detach()
    model(inputs_embeds=embeds, labels=ids).loss.backward()
    return model.transformer.wte.weight.grad.clone()


def test_the_tied_weights_gradient_comes_from_the_head_only_while_frozen_and_from_both_after_unfreeze():
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: weights stay, only gradients are compared
    eg = egeria.Egeria(model, opt, config=static(1, 1), total_steps=4)
    ids = token_batches(1)[0]
    lm_step(model, opt, eg, ids)
    assert len(eg.frozen) == 1
    head_only = _tied_grad(model, ids, lookup_detached=True)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    assert_close(model.transformer.wte.weight.grad, head_only)
    both = _tied_grad(model, ids, lookup_detached=False)
    assert not torch.allclose(both, head_only)  # the lookup's share is not negligible
    eg.close()  # unfreezes: the lookup sends its gradient again
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    assert_close(model.transformer.wte.weight.grad, both)


def test_egerias_own_rule_freezes_a_tied_gpt2_front_without_error():
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eg = egeria.Egeria(model, opt, config=quick_config(), total_steps=40)
    ids = token_batches(1)[0]
    decisions = []
    for _ in range(40):  # one batch over and over: the front converges quickly
        decisions.extend(d for d in lm_step(model, opt, eg, ids) if d.action == "freeze")
        if decisions:
            break
    assert decisions and decisions[0].modules[0] == eg.modules[0]
    stats = eg.controller_stats
    assert stats["failure"] is None and stats["answered"] > 0
    eg.close()


def test_a_tied_prefix_is_not_served_from_the_activation_cache():
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eg = egeria.Egeria(model, opt, config=static(1, 1), total_steps=6)
    dataset = torch.utils.data.TensorDataset(torch.cat(token_batches(2)))
    loader = eg.cache_loader(torch.utils.data.DataLoader(dataset, batch_size=4), serve="always", prefetch=0)
    for _ in range(3):
        for (ids,) in loader:
            lm_step(model, opt, eg, ids)
    assert len(eg.frozen) == 1
    stats = eg.cache_stats
    assert stats["served"] == 0
    assert any("tied weights" in str(level.get("off")) for level in stats["levels"].values())
    eg.close()
