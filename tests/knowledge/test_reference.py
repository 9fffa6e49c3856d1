from __future__ import annotations

import pytest
import torch

import egeria
from egeria.models import TransformerLM, resnet
from egeria.knowledge.reference import ReferenceModel


def reference_for(model, example, precision):
    model.eval()
    partition = egeria.partition_model(model, example)
    ref = ReferenceModel(model, partition, precision)
    last = len(partition) - 2
    batch = (example, {})
    ref.refresh(model.state_dict(), 0, last, batch)
    return partition, ref, last


def training_activation(model, partition, example, index):
    block = model.get_submodule(partition.modules[index].output_block)
    seen = []
    handle = block.register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        model(*example)
    handle.remove()
    return seen[0]


def test_int8_reference_of_a_cnn_is_static_int8_and_close_to_fp32():
    model = resnet(depth=20, in_channels=1)
    example = (torch.randn(32, 1, 28, 28),)
    partition, ref, last = reference_for(model, example, "int8")
    blocks = [b for m in partition.modules[: last + 1] for b in m.blocks if b.startswith("layer")]
    assert all(ref.kinds[b] == "int8-static" for b in blocks)
    for index in (0, last):
        act = ref.activation((example, {}), index)
        expected = training_activation(model, partition, example, index)
        assert act.shape == expected.shape
        assert egeria.sp_loss(act, expected).item() < 1e-4
        assert not torch.equal(act, expected)  # really computed in int8


def test_int8_reference_of_a_transformer_uses_dynamic_int8_linears():
    model = TransformerLM(vocab_size=100, d_model=32, n_heads=2, n_layers=4, d_ff=64, max_len=16, dropout=0.0)
    example = (torch.randint(0, 100, (8, 16)),)
    partition, ref, last = reference_for(model, example, "int8")
    assert ref.kinds["layers.0"] == "int8-dynamic"
    act = ref.activation((example, {}), last)
    expected = training_activation(model, partition, example, last)
    assert egeria.sp_loss(act, expected).item() < 1e-3


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_other_precisions(precision):
    model = resnet(depth=8, in_channels=1, width=8)
    example = (torch.randn(8, 1, 16, 16),)
    partition, ref, last = reference_for(model, example, precision)
    act = ref.activation((example, {}), last)
    expected = training_activation(model, partition, example, last)
    if precision == "fp32":
        torch.testing.assert_close(act, expected)
    else:
        assert egeria.sp_loss(act, expected).item() < 1e-3


def test_reference_stops_at_the_watched_module():
    model = resnet(depth=8, in_channels=1, width=8)
    example = (torch.randn(4, 1, 16, 16),)
    ran = []
    modules = egeria.partition_model(model, example).modules
    # Users' own hooks, which the reference's copy of the model keeps (Egeria's are dropped).
    for name in (modules[-1].blocks[-1], modules[-2].output_block):
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: ran.append(name))
    partition, ref, last = reference_for(model, example, "fp32")
    ran.clear()
    ref.activation((example, {}), 0)
    assert ran == []
    ref.activation((example, {}), last)
    assert ran == [modules[-2].output_block]  # the head never runs


def test_reference_does_not_touch_the_training_model():
    model = resnet(depth=8, in_channels=1, width=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = (torch.randn(4, 1, 16, 16),)
    reference_for(model, example, "int8")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class Untraceable(torch.nn.Module):
    """A conv block with data-dependent control flow, which FX cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if y.sum() > 0:
            y = y * 2
        return y


class TwoBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.front = Untraceable()
        self.head = torch.nn.Linear(4 * 8 * 8, 3)

    def forward(self, x):
        return self.head(self.front(x).flatten(1))


def test_block_that_cannot_be_quantized_falls_back_to_fp32_and_says_why(caplog):
    model = TwoBlocks()
    example = (torch.randn(4, 1, 8, 8),)
    with caplog.at_level("INFO", logger="egeria"):
        partition, ref, last = reference_for(model, example, "int8")
    assert ref.kinds["front"] == "fp32"
    assert "front runs in fp32: static quantization failed" in caplog.text
    expected = training_activation(model, partition, example, 0)
    torch.testing.assert_close(ref.activation((example, {}), 0), expected)


def _bf16_numerics(monkeypatch, native: bool) -> None:
    """Makes this CPU look like one with (or without) native bf16 arithmetic."""
    import egeria.knowledge.quantization

    monkeypatch.setattr(egeria.knowledge.quantization, "native_bf16", lambda: native)


@pytest.mark.parametrize("native, kind", [(True, "bf16"), (False, "bf16-rounded")])
def test_a_bf16_reference_casts_where_the_cpu_has_bf16_and_rounds_in_fp32_elsewhere(monkeypatch, native, kind):
    _bf16_numerics(monkeypatch, native)
    model = resnet(depth=8, in_channels=1, width=8)
    example = (torch.randn(8, 1, 16, 16),)
    partition, ref, last = reference_for(model, example, "bf16")
    assert {ref.kinds[b] for j in range(last + 1) for b in partition.modules[j].blocks} == {kind}
    act = ref.activation((example, {}), last)
    torch.testing.assert_close(act, act.bfloat16().float(), rtol=0, atol=0)  # every value is a bf16 value
    expected = training_activation(model, partition, example, last)
    assert 0 < egeria.sp_loss(act, expected).item() < 1e-3


def _bf16_errors(which: str, seed: int) -> dict[str, float]:
    """SP loss against fp32 of a stack of blocks run as CastBlocks and as RoundedBlocks."""
    from egeria.knowledge.quantization import CastBlock, RoundedBlock
    from egeria.knowledge.similarity import sp_loss

    torch.manual_seed(seed)
    if which == "resnet":
        model = resnet(depth=20, in_channels=1, width=16).eval()
        for m in model.modules():  # running statistics away from the identity
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 2.0)
        blocks = [model.conv1, model.bn1, *model.layer1, *model.layer2]
        x = torch.randn(32, 1, 28, 28)
    else:
        model = TransformerLM(vocab_size=500, d_model=128, n_heads=4, n_layers=3, d_ff=512, dropout=0.0).eval()
        blocks = list(model.layers)
        tokens = torch.randint(0, 500, (16, 24))
        with torch.no_grad():
            x = model.embed(tokens) + model.pos(torch.arange(24))
    errors = {}
    with torch.no_grad():
        exact = x
        for block in blocks:
            exact = block(exact)
        for name, make in (("cast", lambda b: CastBlock(b, torch.bfloat16)), ("rounded", RoundedBlock)):
            h = x
            for block in blocks:
                h = make(block)(h)
            errors[name] = sp_loss(exact.reshape(len(x), -1), h.reshape(len(x), -1)).item()
    return errors


@pytest.mark.parametrize("which", ["resnet", "lm"])
def test_rounding_in_fp32_reads_the_error_of_bf16_arithmetic(which):
    """The rule's floor and ceiling ratios are measured against a bf16 reference's error;
    the rounded fp32 blocks must read about the same error. Measured on an AVX2 CPU: within
    10% on ResNet-20 over three seeds, 0.6x to 1.2x on the LM, where the error of one bf16
    computation against another varies that much between seeds. The median ratio of three
    seeds must lie within 1.3x (ResNet) or 2x (LM): CPUs differ in their bf16 kernels."""
    ratios = []
    for seed in range(3):
        errors = _bf16_errors(which, seed)
        assert errors["cast"] > 0, errors
        ratios.append(errors["rounded"] / errors["cast"])
    band = 1.3 if which == "resnet" else 2.0
    assert 1 / band < sorted(ratios)[1] < band, ratios


def test_rounded_blocks_take_named_tuples_any_float_input_and_script_modules():
    from egeria.knowledge.quantization import RoundedBlock

    class Packed(torch.nn.Module):  # an LSTM over a packed sequence: a named tuple between leaves
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(4, 4, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, [x.shape[1]] * len(x), batch_first=True)
            return torch.nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)[0]

    x = torch.randn(3, 5, 4)
    out = RoundedBlock(Packed())(x)
    assert out.shape == (3, 5, 4) and torch.equal(out, out.bfloat16().float())
    conv = torch.nn.Conv2d(1, 2, 3)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):  # inputs in other float dtypes
        assert RoundedBlock(conv)(torch.randn(1, 1, 5, 5).to(dtype)).dtype == torch.float32
    scripted = torch.nn.Sequential(torch.jit.script(torch.nn.Linear(4, 4)), torch.nn.ReLU())
    assert RoundedBlock(scripted)(torch.randn(2, 4)).shape == (2, 4)


@pytest.mark.parametrize("saved_native", [True, False])
def test_a_saved_bf16_reference_loads_on_a_cpu_with_the_other_bf16_arithmetic(monkeypatch, saved_native):
    model = resnet(depth=8, in_channels=1, width=8)
    example = (torch.randn(8, 1, 16, 16),)
    _bf16_numerics(monkeypatch, saved_native)
    partition, ref, last = reference_for(model, example, "bf16")
    with torch.no_grad():  # the model trains on after the refresh: the reference holds older weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    saved = ref.state_dict(model.state_dict())  # saved beside the model's state of now
    assert set(saved["kinds"].values()) == {"bf16"}  # one name for the same numbers: older versions load it
    assert saved["tensors"]
    before = ref.activation((example, {}), last)
    _bf16_numerics(monkeypatch, not saved_native)
    loaded = ReferenceModel(model, partition, "bf16")
    loaded.load_state_dict(saved, model.state_dict())
    assert set(loaded.kinds.values()) == {"bf16" if not saved_native else "bf16-rounded"}
    after = loaded.activation((example, {}), last)
    # the old snapshot's numbers, up to fp32 accumulation order: far under its drift from now
    drift = egeria.sp_loss(before, training_activation(model, partition, example, last)).item()
    assert egeria.sp_loss(before, after).item() < 1e-3 * drift


@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_reference_refreshed_in_place_computes_what_one_built_anew_does(monkeypatch, native):
    _bf16_numerics(monkeypatch, native)
    model = resnet(depth=8, in_channels=1, width=8)
    example = (torch.randn(8, 1, 16, 16),)
    batch = (example, {})
    partition, ref, last = reference_for(model, example, "bf16")
    built = dict(ref._built)
    before = ref.activation(batch, last)
    with torch.no_grad():  # new weights and BatchNorm statistics
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.add_(0.05 * torch.randn_like(t).abs())
    ref.refresh(model.state_dict(), 0, last, batch)
    assert built and all(ref._built[name] is block for name, block in built.items())  # copied in, not rebuilt
    anew = ReferenceModel(model, partition, "bf16")
    anew.refresh(model.state_dict(), 0, last, batch)
    for index in range(last + 1):
        torch.testing.assert_close(ref.activation(batch, index), anew.activation(batch, index), rtol=0, atol=0)
    assert not torch.equal(ref.activation(batch, last), before)
