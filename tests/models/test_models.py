"""Reference models: output shapes, ResNet depth validation, FX-traceable blocks, causality, tying."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from egeria.models import BasicBlock, TransformerLM, resnet
from hf_style import TinyGPTBlock, TinyGPTConfig, TinyGPTModel

# --- ResNet ------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [20, 32, 56])
def test_resnet_depth_gives_6n_plus_2_layers_and_logits_on_28x28_gray(depth: int) -> None:
    model = resnet(depth, in_channels=1, num_classes=10).eval()
    n = (depth - 2) // 6
    assert [len(model.layer1), len(model.layer2), len(model.layer3)] == [n, n, n]
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) + 1 == depth  # 3x3 convs + the linear head
    with torch.no_grad():
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_resnet_on_32x32_rgb_with_other_width_and_classes() -> None:
    model = resnet(20, in_channels=3, num_classes=100, width=8).eval()
    with torch.no_grad():
        out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 100)
    assert model.linear.in_features == 32


def test_resnet_stage_shapes_and_shortcuts() -> None:
    model = resnet(20, in_channels=1).eval()
    first2, rest2 = model.layer2[0], model.layer2[1]
    assert isinstance(first2.shortcut[0], torch.nn.Conv2d) and first2.shortcut[0].stride == (2, 2)
    assert isinstance(first2.shortcut[1], torch.nn.BatchNorm2d)
    assert len(rest2.shortcut) == 0 and len(model.layer1[0].shortcut) == 0
    with torch.no_grad():
        x = torch.relu(model.bn1(model.conv1(torch.randn(2, 1, 28, 28))))
        x1 = model.layer1(x)
        x2 = model.layer2(x1)
        x3 = model.layer3(x2)
    assert x1.shape == (2, 16, 28, 28) and x2.shape == (2, 32, 14, 14) and x3.shape == (2, 64, 7, 7)


@pytest.mark.parametrize("depth", [0, 8 - 6, 21, 33, 100])
def test_resnet_bad_depth_raises_naming_it(depth: int) -> None:
    with pytest.raises(ValueError, match=f"depth={depth}"):
        resnet(depth)


def test_every_basic_block_is_fx_traceable_and_equal_to_eager() -> None:
    model = resnet(20, in_channels=1).eval()
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    assert len(blocks) == 9
    x = torch.relu(model.bn1(model.conv1(torch.randn(2, 1, 28, 28))))
    with torch.no_grad():
        for block in blocks:
            traced = torch.fx.symbolic_trace(block)
            torch.testing.assert_close(traced(x), block(x))
            x = block(x)


def test_resnet_convs_are_kaiming_initialised() -> None:
    torch.manual_seed(0)
    conv = resnet(56).layer3[0].conv2  # 64 -> 64, fan_out = 64 * 9
    expected_std = (2.0 / (64 * 9)) ** 0.5
    assert abs(conv.weight.std().item() - expected_std) / expected_std < 0.05


# --- TransformerLM -----------------------------------------------------------------------


def _lm(**kwargs: object) -> TransformerLM:
    defaults = dict(vocab_size=50, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=16, dropout=0.0)
    defaults.update(kwargs)
    return TransformerLM(**defaults).eval()


def test_transformer_lm_logits_shape_and_layout() -> None:
    model = _lm()
    tokens = torch.randint(0, 50, (3, 11))
    assert model(tokens).shape == (3, 11, 50)
    assert len(model.layers) == 2
    assert isinstance(model.pos, torch.nn.Embedding) and model.pos.num_embeddings == 16
    assert isinstance(model.norm, torch.nn.LayerNorm)


def test_transformer_lm_default_sizes() -> None:
    model = TransformerLM(vocab_size=100)
    assert len(model.layers) == 6 and model.embed.embedding_dim == 128
    assert model.layers[0].ff1.out_features == 512 and model.pos.num_embeddings == 256


def test_transformer_lm_is_causal() -> None:
    model = _lm()
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    t = 7
    changed[:, t] = (tokens[:, t] + 1) % 50
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t], after[:, t])


def test_transformer_lm_tied_weights_share_one_parameter() -> None:
    tied = _lm(tie_weights=True)
    assert tied.head.weight is tied.embed.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    untied = _lm(tie_weights=False)
    assert untied.head.weight is not untied.embed.weight
    assert sum(p.numel() for p in untied.parameters()) == n_tied + 50 * 32


def test_transformer_lm_attention_is_plain_linear_layers_for_dynamic_quantization() -> None:
    model = _lm()
    quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    n_dynamic = sum(type(m).__name__ == "Linear" and "dynamic" in type(m).__module__ for m in quantized.modules())
    assert n_linear == 2 * 6 + 1 and n_dynamic == n_linear  # q, k, v, out, ff1, ff2 per layer + head
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        ref, q = model(tokens), quantized(tokens)
    assert q.shape == ref.shape and (q - ref).abs().max() < 0.1 * ref.abs().max() + 0.05


def test_transformer_lm_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="n_heads=3"):
        _lm(n_heads=3)
    with pytest.raises(ValueError, match="max_len=16"):
        _lm()(torch.zeros(1, 17, dtype=torch.int64))


# --- TinyGPT (HF-style test helper) ------------------------------------------------------


def _tiny(**kwargs: object) -> TinyGPTModel:
    return TinyGPTModel(TinyGPTConfig(**kwargs)).eval()


def test_tiny_gpt_logits_shape_and_hf_layout() -> None:
    model = _tiny(vocab_size=40, n_embd=16, n_layer=3, n_head=2, n_positions=12)
    assert model(torch.randint(0, 40, (2, 10))).shape == (2, 10, 40)
    assert len(model.transformer.h) == 3
    for name in ("wte", "wpe", "drop", "ln_f"):
        assert hasattr(model.transformer, name)
    assert model.lm_head.bias is None


def test_tiny_gpt_blocks_return_a_tuple_and_take_the_mask_by_keyword() -> None:
    model = _tiny()
    block = model.transformer.h[0]
    assert isinstance(block, TinyGPTBlock)
    hidden = torch.randn(2, 5, 32)
    out = block(hidden, attention_mask=None)
    assert isinstance(out, tuple) and len(out) == 1 and out[0].shape == (2, 5, 32)
    seen: list[object] = []
    block.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    model(torch.randint(0, 64, (2, 5)), attention_mask=torch.ones(2, 5))
    assert len(seen) == 1 and "attention_mask" in seen[0]


def test_tiny_gpt_padding_mask_hides_masked_keys() -> None:
    model = _tiny()
    ids = torch.randint(0, 64, (1, 6))
    other = ids.clone()
    other[0, 2] = (ids[0, 2] + 1) % 64
    mask = torch.ones(1, 6)
    mask[0, 2] = 0
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask), model(other, attention_mask=mask)
        full = model(ids, attention_mask=torch.ones(1, 6))
        plain = model(ids)
    torch.testing.assert_close(a[0, 3:], b[0, 3:])  # later positions no longer see token 2
    torch.testing.assert_close(full, plain)  # an all-ones mask is the causal model


def test_tiny_gpt_tied_and_untied_head() -> None:
    tied = _tiny()
    assert tied.lm_head.weight is tied.transformer.wte.weight
    untied = _tiny(tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
