from __future__ import annotations

import pytest
import torch

import egeria
from egeria.models import TransformerLM, resnet
from hf_style import TinyGPTConfig, TinyGPTModel
from tiny import Chain


def partition_of(model, example, **config):
    """The partition as built, without the rule's cap on the computation frozen unless given."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = egeria.EgeriaConfig(eval_interval=10, executor="inline", **{"max_frozen_flops": 1.0, **config})
    eg = egeria.Egeria(model, opt, config=config, example_inputs=example)
    return eg, eg.partition


def test_egerias_rule_freezes_at_most_the_leading_three_quarters_of_the_weight_computation():
    from egeria.models import TransformerLM, resnet
    from egeria.partition import weight_flops

    net = resnet(depth=20, in_channels=1, num_classes=10)
    eg, capped = partition_of(net, (torch.randn(2, 1, 28, 28),), max_frozen_flops=None)  # egeria's default, 0.75
    # conv1..layer2.2 do 68% of ResNet-20's weight computation; with layer3.0 it would be 77%.
    # Under Egeria's rule the modules past the cap freeze only once quiet (record 041).
    assert capped.names[capped.cap - 1] == "layer2.2" and capped.cap == 5
    assert capped.freezable == len(capped) - 1
    flops = eg._layers.module_flops(capped)
    assert sum(flops[:5]) / sum(flops) == pytest.approx(0.676, abs=0.005)
    # The count is each weight's size times its output positions (x2), as torch's own
    # FLOP counter counts the same layers' matrix work.
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    out = conv(torch.randn(2, 3, 10, 10))
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        conv(torch.randn(2, 3, 10, 10))
    assert weight_flops(conv, out) == counter.get_total_flops()
    linear = torch.nn.Linear(6, 4)
    with FlopCounterMode(display=False) as counter:
        out = linear(torch.randn(5, 7, 6))
    assert weight_flops(linear, out) == counter.get_total_flops()
    _, paper = partition_of(net, (torch.randn(2, 1, 28, 28),), rule="paper", max_frozen_flops=None)
    assert paper.freezable == len(paper) - 1 and paper.cap is None  # the paper's rule caps nothing
    lm = TransformerLM(1000, d_model=32, n_heads=2, n_layers=6, d_ff=64, max_len=16, dropout=0.0)
    _, lm_partition = partition_of(lm, (torch.randint(0, 1000, (2, 8)),), max_frozen_flops=None)
    # The token table is a lookup: it computes nothing, so it counts nothing.
    assert lm_partition.names[0] == "embed..layers.0" and lm_partition.freezable >= 1
    with pytest.raises(ValueError, match="max_frozen_flops=1.5"):
        egeria.EgeriaConfig(max_frozen_flops=1.5)


def test_a_run_resumed_before_its_first_forward_pass_caps_as_the_checkpoint_recorded():
    import json

    from egeria.models import resnet

    torch.manual_seed(0)
    eg, capped = partition_of(resnet(depth=20, in_channels=1, num_classes=10), (torch.randn(2, 1, 28, 28),),
                              max_frozen_flops=None)
    state = json.loads(json.dumps(eg.state_dict()))
    eg.close()
    assert len(state["module_flops"]) == len(capped)
    torch.manual_seed(0)
    net = resnet(depth=20, in_channels=1, num_classes=10)
    resumed = egeria.Egeria(net, torch.optim.SGD(net.parameters(), lr=0.1),
                            config=egeria.EgeriaConfig(eval_interval=10, executor="inline"))
    resumed.load_state_dict(state)  # no forward pass yet: no trace to count with
    assert resumed.partition.cap == capped.cap == 5
    assert json.loads(json.dumps(resumed.state_dict()))["module_flops"] == state["module_flops"]
    resumed.close()


def weighted_blocks(model, partition, index=None):
    """Blocks holding parameters, in module order (dropout and the like left out)."""
    modules = partition.modules if index is None else [partition.modules[index]]
    return [b for m in modules for b in m.blocks if any(True for _ in model.get_submodule(b).parameters())]


def assert_covers_every_parameter_once(model, partition):
    owned = [p for m in partition.modules for p in m.params]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())
    assert len(owned) == len(set(owned))
    assert sum(m.num_params for m in partition.modules) == sum(p.numel() for p in model.parameters())


def test_resnet20_modules_follow_execution_order_and_group_blocks():
    model = resnet(depth=20, in_channels=1)
    eg, partition = partition_of(model, (torch.randn(2, 1, 28, 28),))
    blocks = weighted_blocks(model, partition)
    expected = ["conv1", "bn1"] + [f"layer{s}.{i}" for s in (1, 2, 3) for i in range(3)] + ["linear"]
    assert blocks == expected
    assert 2 <= len(partition) <= 8
    assert partition.modules[-1].blocks[-1] == "linear"
    assert_covers_every_parameter_once(model, partition)
    # No module is tiny next to the others (the stem and the classifier are merged in).
    sizes = [m.num_params for m in partition.modules]
    assert min(sizes) >= 0.1 * sorted(sizes)[len(sizes) // 2]


def test_execution_order_not_registration_order():
    model = Chain(depth=4)
    eg, partition = partition_of(model, (torch.randn(4, 8),), max_modules=8)
    blocks = weighted_blocks(model, partition)
    assert blocks == ["stem.0", "stem.1", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert partition.modules[-1].blocks[-1] == "head"
    assert_covers_every_parameter_once(model, partition)


def test_transformer_lm_partition():
    model = TransformerLM(vocab_size=50, d_model=16, n_heads=2, n_layers=6, d_ff=32, max_len=16)
    eg, partition = partition_of(model, (torch.randint(0, 50, (2, 8)),))
    blocks = weighted_blocks(model, partition)
    assert blocks == ["embed", "pos"] + [f"layers.{i}" for i in range(6)] + ["norm", "head"]
    assert_covers_every_parameter_once(model, partition)


def test_a_leading_embedding_module_joins_the_first_layer():
    """A large token embedding is a module of its own by size; leading the partition, it
    would be watched first and hold every layer behind it, so it joins the first layer."""
    model = TransformerLM(vocab_size=5000, d_model=16, n_heads=2, n_layers=6, d_ff=32, max_len=16)
    eg, partition = partition_of(model, (torch.randint(0, 5000, (2, 8)),))
    first = partition.modules[0]
    assert first.name == "embed..layers.0" and {"embed", "pos", "layers.0"} <= set(first.blocks)
    assert partition.modules[1].name == "layers.1"
    assert_covers_every_parameter_once(model, partition)
    # A user's choice is kept as given.
    model = TransformerLM(vocab_size=5000, d_model=16, n_heads=2, n_layers=6, d_ff=32, max_len=16)
    eg, partition = partition_of(model, (torch.randint(0, 5000, (2, 8)),), modules=["embed", "layers.0", "layers.3"])
    assert partition.names[0] == "embed"


def test_hf_style_tied_embedding_is_owned_by_the_head_and_its_lookup_detached_when_frozen():
    config = TinyGPTConfig(vocab_size=40, n_embd=16, n_layer=4, n_head=2, n_positions=16)
    model = TinyGPTModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    eg, partition = partition_of(model, (torch.randint(0, 40, (2, 8)),), max_modules=8)
    blocks = weighted_blocks(model, partition)
    assert blocks[:3] == ["transformer.wte", "transformer.wpe", "transformer.h.0"]
    assert blocks[-1] == "lm_head"
    assert_covers_every_parameter_once(model, partition)
    # The shared weight is owned by the head (never frozen), not by the front module.
    assert "transformer.wte.weight" in partition.modules[-1].params
    assert "transformer.wte.weight" not in partition.modules[0].params
    assert "transformer.wte" in partition.modules[0].blocks
    # Module 0 reads the head's weight through an embedding lookup: it can freeze, detached.
    assert partition.freezable == len(partition) - 1
    assert partition.modules[0].detached == ["transformer.wte"]


def test_tied_and_untied_models_both_freeze_all_but_the_head():
    tied = TinyGPTModel(TinyGPTConfig(vocab_size=40, n_embd=16, n_layer=4, n_head=2, n_positions=16))
    eg, partition = partition_of(tied, (torch.randint(0, 40, (2, 8)),), max_modules=8)
    assert partition.freezable == len(partition) - 1
    restored = egeria.Partition.from_state(tied, partition.to_state())
    assert [m.detached for m in restored.modules] == [m.detached for m in partition.modules]
    untied = TinyGPTModel(
        TinyGPTConfig(vocab_size=40, n_embd=16, n_layer=4, n_head=2, n_positions=16, tie_word_embeddings=False)
    )
    eg, partition = partition_of(untied, (torch.randint(0, 40, (2, 8)),), max_modules=8)
    assert partition.freezable == len(partition) - 1
    assert all(not m.detached for m in partition.modules)


def test_an_embedding_with_max_norm_is_not_a_pure_read_and_keeps_its_module_trainable(caplog):
    model = TinyGPTModel(TinyGPTConfig(vocab_size=40, n_embd=16, n_layer=4, n_head=2, n_positions=16))
    model.transformer.wte.max_norm = 1.0  # renormalises the shared weight in place at every lookup
    with caplog.at_level("WARNING", logger="egeria"):
        eg, partition = partition_of(model, (torch.randint(0, 40, (2, 8)),), max_modules=8)
    assert partition.freezable == 0
    assert "tied weights" in caplog.text and "stay trainable" in caplog.text


def test_weights_shared_across_layers_block_freezing_from_the_first_user():
    model = Chain(depth=4)
    model.blocks[2].fc = model.blocks[0].fc  # ALBERT-style sharing between blocks 0 and 2
    eg, partition = partition_of(model, (torch.randn(4, 8),), max_modules=8)
    first_user = next(i for i, m in enumerate(partition.modules) if "blocks.0" in m.blocks)
    assert partition.freezable == first_user


def test_user_regex_picks_modules_and_trailing_blocks_form_the_head():
    model = resnet(depth=20, in_channels=1)
    eg, partition = partition_of(model, (torch.randn(2, 1, 28, 28),), modules=r"layer\d")
    assert partition.names == ["layer1", "layer2", "layer3", "linear"]
    assert partition.modules[0].blocks == ["conv1", "bn1", "layer1"]
    assert_covers_every_parameter_once(model, partition)


def test_user_list_of_names():
    model = Chain(depth=4)
    eg, partition = partition_of(model, (torch.randn(4, 8),), modules=["blocks.0", "blocks.2", "head"])
    assert partition.names == ["blocks.0", "blocks.2", "head"]
    assert weighted_blocks(model, partition, 0) == ["stem.0", "stem.1", "blocks.0", "blocks.1"]
    assert weighted_blocks(model, partition, 1) == ["blocks.2", "blocks.3"]
    assert "stem.2" in partition.modules[0].blocks  # the dropout runs inside module 0


def test_regex_matching_nothing_lists_available_names():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"matches no module; available names: .*blocks\.0"):
        egeria.Egeria(model, opt, config=egeria.EgeriaConfig(eval_interval=1, modules=r"encoder\.\d+"))


def test_unknown_module_name_is_named_in_the_error():
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'nope'"):
        egeria.Egeria(model, opt, config=egeria.EgeriaConfig(eval_interval=1, modules=["nope", "head"]))
