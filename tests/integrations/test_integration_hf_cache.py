"""The activation cache under the Hugging Face ``Trainer`` (``EgeriaCallback(cache=...)``):
a tiny BERT classifier built from a config, shuffled sentences of several lengths padded by
a data collator, gradient accumulation 2, dropout on. With the cache every training
forward pass sees the batches and gives the outputs of the run without it, bit for bit,
while frozen prefixes are served; a resume from a Trainer checkpoint ends where the
uninterrupted run ends."""

from __future__ import annotations

import gc
import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[hf]')")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (pip install -e '.[hf]')")

from egeria.cache.batchkeys import KEYS  # noqa: E402
from egeria.integrations.hf import EgeriaCallback  # noqa: E402
from tiny import Plan  # noqa: E402

VOCAB, LENGTH, SAMPLES = 40, 12, 48
# 6 optimizer steps an epoch (batch 4, accumulation 2): 2 modules frozen at step 2 (the
# embeddings and layer 0), 3 at step 14 (a deeper level built from the shallower one).
PLAN = {2: 2, 14: 3}
STEPS = 24


class Sentences(torch.utils.data.Dataset):
    """Random "sentences" of 4 to 12 token ids, each with one of 3 labels."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        lengths = torch.randint(4, LENGTH + 1, (SAMPLES,), generator=g).tolist()
        self.ids = [torch.randint(1, VOCAB, (k,), generator=g) for k in lengths]
        self.labels = torch.randint(0, 3, (SAMPLES,), generator=g).tolist()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def padding(to: int | None):
    """A data collator padding every batch to ``to`` ids (None: to its longest sentence)."""

    def collate(items: list[dict]) -> dict:
        length = to or max(len(it["input_ids"]) for it in items)
        ids = torch.zeros(len(items), length, dtype=torch.long)
        for row, it in enumerate(items):
            ids[row, : len(it["input_ids"])] = it["input_ids"]
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([it["labels"] for it in items])}

    return collate


def bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=LENGTH, num_labels=3, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


class Seen(transformers.TrainerCallback):
    """Every training forward pass's keyword arguments and logits, as the model sees them."""

    def __init__(self) -> None:
        self.inputs: list[dict[str, torch.Tensor]] = []
        self.logits: list[torch.Tensor] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        model.register_forward_hook(self._output)
        self.model, self.first_hooks = model, []

    def on_step_end(self, args, state, control, **kwargs):
        self.first_hooks.append(next(iter(self.model._forward_pre_hooks.values())).__name__)

    def _inputs(self, module, args, kwargs):
        if module.training:
            self.inputs.append({k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})

    def _output(self, module, args, output):
        if module.training:
            self.logits.append(output.logits.detach().clone())


def train(out, *, cache, collate=padding(LENGTH), steps=STEPS, save_steps=100, resume=None, workers=0, plan=PLAN):
    callback = EgeriaCallback(policy=Plan(plan), log_signals=False, cache=cache)
    seen = Seen()
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, weight_decay=0.01, warmup_steps=2, save_strategy="steps", save_steps=save_steps,
        logging_strategy="no", report_to="none", use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=workers,
    )
    trainer = transformers.Trainer(model=bert(), args=args, train_dataset=Sentences(), data_collator=collate,
                                   callbacks=[seen])
    if cache is not False:
        callback.attach(trainer)  # the one line the cache needs
    else:
        trainer.add_callback(callback)
    trainer.remove_callback(seen)
    trainer.add_callback(seen)  # after Egeria's: its hooks see what the model sees
    trainer.train(resume_from_checkpoint=resume)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return callback.egeria, seen, weights


def always(**options):
    return {"serve": "always", **options}  # serve wherever possible, untimed: deterministic


@pytest.mark.parametrize("workers", [0, 2])
def test_the_cache_serves_the_frozen_prefix_with_the_trainers_batches_and_outputs_bit_for_bit(tmp_path, workers):
    plain_eg, plain, plain_weights = train(tmp_path / "plain", cache=False, workers=workers)
    eg, cached, weights = train(tmp_path / "cached", cache=always(), workers=workers)
    assert plain_eg.cache_stats == {}
    stats = eg.cache_stats
    # step 13's micro-batches are served (level 2 complete after epoch 2), the deeper level is built from it
    assert stats["served"] >= 2 and stats["chained"] >= 1, stats
    assert stats["served"] + stats["partly"] + stats["computed"] == stats["batches"] == STEPS * 2 - 2 * 2  # micro-batches after the first freeze
    # The Trainer's shuffling and collation are intact, the keys never reach the model...
    assert len(cached.inputs) == len(plain.inputs) == STEPS * 2
    for got, expected in zip(cached.inputs, plain.inputs):
        # the Trainer adds num_items_in_batch for models that take loss kwargs
        assert got.keys() == expected.keys() and {"input_ids", "attention_mask", "labels"} <= got.keys()
        assert KEYS not in got
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    # ...and every training forward pass, served or computed, gives the full forward's outputs.
    for got, expected in zip(cached.logits, plain.logits):
        assert torch.equal(got, expected)
    for name, value in plain_weights.items():
        assert torch.equal(weights[name], value), name
    assert [(d.step, d.action) for d in eg.events] == [(d.step, d.action) for d in plain_eg.events]


def test_a_resume_from_a_trainer_checkpoint_with_the_cache_ends_as_the_uninterrupted_run(tmp_path):
    plan, at = {2: 2}, 8  # resumed mid-epoch 2 with 2 modules frozen
    _, whole, expected = train(tmp_path / "whole", cache=always(), save_steps=at, plan=plan)
    checkpoint = tmp_path / "whole" / f"checkpoint-{at}"
    shutil.copytree(checkpoint, tmp_path / "resumed" / checkpoint.name)
    eg, resumed, weights = train(tmp_path / "resumed", cache=always(), save_steps=at, plan=plan,
                                 resume=str(tmp_path / "resumed" / checkpoint.name))
    assert eg.steps == STEPS  # (the frozen set is given back when training ends)
    # rebuilt after the resume (the rest of epoch 2 and epoch 3 store every sample), epoch 4 served whole
    assert eg.cache_stats["served"] >= 12, eg.cache_stats
    assert len(resumed.logits) == (STEPS - at) * 2
    for got, expected_logits in zip(resumed.logits, whole.logits[at * 2:]):
        assert torch.equal(got, expected_logits)
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


def test_batches_padded_to_their_own_length_turn_the_cache_off_with_the_fix_and_train_as_without_it(tmp_path, caplog):
    _, _, plain = train(tmp_path / "plain", cache=False, collate=padding(None), steps=8)
    with caplog.at_level(logging.WARNING, logger="egeria"):
        eg, _, weights = train(tmp_path / "cached", cache=always(), collate=padding(None), steps=8)
    assert eg.cache_stats["served"] == 0
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "changed shape" in message and "pad every batch to one length" in message
    for name, value in plain.items():
        assert torch.equal(weights[name], value), name


def test_the_cache_needs_the_attached_trainer_and_known_options(tmp_path):
    with pytest.raises(ValueError, match=r"unknown cache options \['memory'\]"):
        EgeriaCallback(cache={"memory": 1})
    with pytest.raises(ValueError, match="must be True, False or a dict of cache options, got 'yes'"):
        EgeriaCallback(cache="yes")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none")
    callback = EgeriaCallback(policy=Plan(PLAN), cache=True)
    trainer = transformers.Trainer(model=bert(), args=args, train_dataset=Sentences(), data_collator=padding(LENGTH),
                                   callbacks=[callback])  # listed, never attached
    with pytest.raises(ValueError, match=r"call EgeriaCallback.attach\(trainer\) before train\(\)"):
        trainer.train()


def test_keys_come_out_of_the_batch_before_any_other_hook_and_no_heap_is_scanned(tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("gc.get_objects() called")

    monkeypatch.setattr(gc, "get_objects", refused)
    eg, seen, _ = train(tmp_path, cache=always(), steps=4)
    assert seen.inputs and not any(KEYS in kwargs for kwargs in seen.inputs)
    # Egeria's cache hook runs first among the model's forward pre-hooks while training.
    assert seen.first_hooks == ["_take_keys"] * 4
