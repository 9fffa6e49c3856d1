"""Pretrain the small language model that issue 28's fine-tuning task (``gpt-ptb-order``,
:mod:`egeria.bench.word_order`) starts from, on the Penn Treebank training text, from scratch,
seeded and deterministic on one machine.

    .venv/bin/python scripts/pretrain_ptb_lm.py                    # about 50 minutes on 2 idle cores
    .venv/bin/python scripts/pretrain_ptb_lm.py --epochs 1 --limit 2000 --out /tmp/gpt  # smoke

Two architectures of the same sizes. ``--arch gpt`` (the default, the task's model): a
causal ``transformers.GPT2LMHeadModel`` trained on next-word prediction at every position;
its next-word accuracy and perplexity on the validation text are logged after every epoch.
``--arch bert``, the first attempt: masked-language modelling gives a sixth of the signal
per step (15% of the positions), and 8 epochs left the encoder near the unigram guess
(masked-word accuracy 0.124, ``benchmarks/results/tta-full/cpu/bert-ptb-bshift/pretraining.json``),
from which fine-tuning stayed at chance. The masked model, for the record:
``transformers.BertForMaskedLM`` from a ``BertConfig`` written here (nothing is
downloaded): 6 layers, width 128, 4 heads, feed-forward 512, 64 positions, PTB's 10,000
words and 4 special tokens (:mod:`egeria.bench.ptb_sentences`), its output layer tied to
the word embeddings. The text: the training split's sentences in order, packed whole into
sequences of at most 64 ids (``[CLS] s1 [SEP] s2 [SEP] ...``). Each epoch masks 15% of the
word positions afresh (of those, 80% become ``[MASK]``, 10% a random word, 10% stay), drawn
from a generator seeded by ``--seed`` and the epoch; the loss is computed on the masked
positions only (the vocabulary projection of the rest is skipped, which makes a step about
a third cheaper). AdamW (lr 5e-4, weight decay 0.01), 6% linear warm-up then linear decay
to 0, batch 128, 8 epochs (1,160 steps of about 70 GFLOPs each: sized to stay
under 30 minutes on 2 cores). The masked-word accuracy on the validation split (one fixed mask) is
logged after every epoch.

Writes ``--out`` (default ``~/.cache/egeria/ptb-gpt``, or ``ptb-bert-mlm`` for bert): the model
(``save_pretrained``: ``config.json``, ``model.safetensors``) and ``pretraining.json`` (the
arguments, per-epoch losses and validation accuracy, training seconds, machine, code
commit, the weights' SHA-256); ``--record`` gets a copy of that JSON (for committing; the
weights are not committed: this script makes them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from egeria.bench import ptb_sentences as ps
from egeria.data import load_ptb
from egeria.bench.machine import describe_machine

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "egeria"
DEFAULT_OUT = {"gpt": CACHE / "ptb-gpt", "bert": CACHE / "ptb-bert-mlm"}


def bert_config(vocab: int, max_len: int):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=max_len, type_vocab_size=1, pad_token_id=ps.PAD,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )


def pack(sentences: list[torch.Tensor], length: int) -> torch.Tensor:
    """Consecutive whole sentences, each followed by ``[SEP]``, after one ``[CLS]``, in rows of
    ``length`` ids (padded); a sentence longer than a row is cut to fit one."""
    rows, row = [], [ps.CLS]
    for s in sentences:
        words = s[: length - 2].tolist()
        if len(row) + len(words) + 1 > length:
            rows.append(row)
            row = [ps.CLS]
        row += words + [ps.SEP]
    if len(row) > 1:
        rows.append(row)
    out = torch.full((len(rows), length), ps.PAD, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def mask_words(ids: torch.Tensor, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of 15% of the word positions: ``(inputs, labels)``, labels -100 where
    no prediction is asked."""
    words = ids >= len(ps.SPECIALS)
    chosen = words & (torch.rand(ids.shape, generator=generator) < 0.15)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    draw = torch.rand(ids.shape, generator=generator)
    random_words = torch.randint(len(ps.SPECIALS), vocab, ids.shape, generator=generator)
    inputs = torch.where(chosen & (draw < 0.8), torch.full_like(ids, ps.MASK), ids)
    inputs = torch.where(chosen & (draw >= 0.8) & (draw < 0.9), random_words, inputs)
    return inputs, labels


def gpt_config(vocab: int, max_len: int):
    """The causal (GPT-style) model of ``--arch gpt``: the encoder's sizes (6 layers, width
    128, 4 heads, feed-forward 512), PTB's ids and specials, the output layer tied."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab, n_embd=128, n_layer=6, n_head=4, n_inner=512, n_positions=max_len,
        pad_token_id=ps.PAD, bos_token_id=ps.CLS, eos_token_id=ps.SEP,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )


def causal_loss(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-word cross-entropy and argmax hits over every position whose next id is a word
    or ``[SEP]`` (padding is never a target)."""
    hidden = model.transformer(input_ids=ids, attention_mask=(ids != ps.PAD).long()).last_hidden_state
    targets = ids[:, 1:]
    where = targets != ps.PAD
    logits = model.lm_head(hidden[:, :-1][where])
    return F.cross_entropy(logits, targets[where]), (logits.argmax(-1) == targets[where]).sum()


def masked_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and argmax hits over the masked positions only."""
    hidden = model.bert(input_ids=inputs, attention_mask=(inputs != ps.PAD).long()).last_hidden_state
    where = labels != -100
    logits = model.cls(hidden[where])
    return F.cross_entropy(logits, labels[where]), (logits.argmax(-1) == labels[where]).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("gpt", "bert"), default="gpt",
                        help="bert: masked-language modelling (BertForMaskedLM); gpt: next-word prediction (GPT2LMHeadModel)")
    parser.add_argument("--out", type=Path, default=None, help="default: ~/.cache/egeria/ptb-gpt (ptb-bert-mlm for bert)")
    parser.add_argument("--record", type=Path, default=None, help="also copy pretraining.json here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--limit", type=int, default=None, help="first LIMIT training sentences only (smoke runs)")
    args = parser.parse_args()
    if args.out is None:
        args.out = DEFAULT_OUT[args.arch]
    from transformers import BertForMaskedLM, GPT2LMHeadModel, get_linear_schedule_with_warmup

    corpus = load_ptb()
    vocab = ps.vocab_size(corpus)
    train = pack(ps.sentences(corpus, "train")[: args.limit], args.length)
    valid = pack(ps.sentences(corpus, "valid"), args.length)
    valid_inputs, valid_labels = mask_words(valid, vocab, torch.Generator().manual_seed(1234))
    causal = args.arch == "gpt"

    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(gpt_config(vocab, args.length)) if causal else BertForMaskedLM(bert_config(vocab, args.length))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(train) / args.batch)
    total = steps_per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, round(0.06 * total), total)
    order = torch.Generator().manual_seed(args.seed)
    print(f"{len(train)} rows of {args.length} ids, {steps_per_epoch} steps per epoch, {total} steps", flush=True)

    epochs, train_s = [], 0.0
    for epoch in range(args.epochs):
        model.train()
        masking = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        inputs_all, labels_all = mask_words(train, vocab, masking)
        perm = torch.randperm(len(train), generator=order)
        started, losses = time.perf_counter(), []
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch : (i + 1) * args.batch]
            loss, _ = causal_loss(model, train[idx]) if causal else masked_loss(model, inputs_all[idx], labels_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        train_s += time.perf_counter() - started
        model.eval()
        with torch.no_grad():
            if causal:
                parts = [causal_loss(model, x) for x in valid.split(256)]
                counts = [int((x[:, 1:] != ps.PAD).sum()) for x in valid.split(256)]
                hits, asked = sum(int(h) for _, h in parts), sum(counts)
                nats = sum(float(loss) * n for (loss, _), n in zip(parts, counts)) / asked
            else:
                hits = sum(int(masked_loss(model, x, y)[1]) for x, y in zip(valid_inputs.split(256), valid_labels.split(256)))
                asked = int((valid_labels != -100).sum())
        accuracy = hits / asked
        kind = "next-word" if causal else "masked-word"
        epochs.append({"epoch": epoch + 1, "train_loss": sum(losses) / len(losses),
                       "valid_next_word_accuracy" if causal else "valid_masked_accuracy": accuracy, "train_s": train_s})
        if causal:
            epochs[-1]["valid_perplexity"] = math.exp(nats)
        print(f"epoch {epoch + 1}: loss {epochs[-1]['train_loss']:.3f}, valid {kind} accuracy {accuracy:.4f}"
              + (f", perplexity {math.exp(nats):.1f}" if causal else "") + f", {train_s:.0f} s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    weights = args.out / "model.safetensors"
    record = {
        "script": "scripts/pretrain_ptb_lm.py",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": model.config.to_diff_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "rows": len(train), "steps": total, "epochs": epochs, "train_s": train_s,
        "machine": describe_machine(), "code": _commit(),
        "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
    }
    (args.out / "pretraining.json").write_text(json.dumps(record, indent=1))
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.out / "pretraining.json", args.record)
    print(f"wrote {args.out} ({train_s:.0f} s of training)")


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


if __name__ == "__main__":
    main()
