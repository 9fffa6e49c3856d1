"""One benchmark run through the Hugging Face ``Trainer``, recorded as ``egeria bench``'s
run file (:mod:`egeria.bench.run`, format 2), so ``egeria report`` reads it beside the
others.

The task, ``gpt-ptb-order`` (issue 28's suite, d): the GPT-style model pretrained by
``scripts/pretrain_ptb_lm.py`` (next-word prediction on the PTB training text), loaded with
``AutoModelForSequenceClassification.from_pretrained`` (a fresh classifier, seeded, reading
the last word: ``[SEP]``; a BERT-style folder from ``--arch bert`` loads the same way),
fine-tuned on word order (:mod:`egeria.bench.word_order`) over every PTB training sentence
and judged by accuracy on the validation and test sentences together (7,000 sentences the
pretraining never saw; two splits rather than one to halve the accuracy's sampling noise).
It trains the way the ``Trainer`` trains by default: AdamW, its default linear decay to 0
with no warm-up, weight decay 0, 3 epochs; the learning rate is 1e-4 (the default 5e-5 is
set for BERT-base; small models fine-tune best at 1e-4 and above), batch 32, sentences cut
or padded to 48 ids. Every policy, plain (``none``) included, runs through
:class:`egeria.integrations.hf.EgeriaCallback`, as ``egeria bench`` runs every policy
through one loop.

Recording: a callback after Egeria's evaluates the model every ``steps_per_epoch //
records_per_epoch`` optimizer steps and after the last, outside the timed training. A
record's ``wall_time_s`` is the time since training began (the Trainer's
``on_train_begin``, after Egeria is built) less the evaluations: the Trainer's own work
between steps (its data loading, logging) is counted, as a user's run pays it. FLOPs are
counted (:mod:`egeria.bench.flops`) on the first step and the first after each change of
the frozen set, the forward (the model and its loss) apart from the rest. With ``--cache``
the activation cache serves the frozen prefix through the Trainer's own loader
(``EgeriaCallback(cache=True)``, attached to the Trainer; :mod:`egeria.integrations.hf`).

The task ``minilm-ptb-order`` (issue 50's suite, f) is the same word-order task on the same
PTB sentences for a genuinely pretrained encoder: sentence-transformers' all-MiniLM-L6-v2
(:mod:`egeria.models.pretrained`, the ``pretrained`` extra), the words as text through its
own WordPiece tokenizer, cut or padded to 48 ids (as (d) cuts to 48 words); the first
16,000 training sentences (15,954 items: the task leaves out the few it cannot use), 3
epochs (1,497 steps), batch 32, the Trainer's AdamW at its default 5e-5 with weight decay
0.01 and a linear warm-up over the first 10% of the steps then linear decay to 0
(sentence-transformers' recipe); judged on the 7,000 validation and test sentences.

Command line (the flags of ``egeria bench``)::

    python -m egeria.bench.trainer_run gpt-ptb-order --policy none --seed 0 --layout cpu \\
        --out benchmarks/results/tta-full --records-per-epoch 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..checks import check_int
from ..config import EgeriaConfig
from .allocator import HEAPS, heap_state, steady_heap
from .flops import share
from .layouts import LAYOUTS, pinned, resolve_layout
from .machine import describe_machine, training_device
from .run import FORMAT, POLICY_NAMES, _code_commit

__all__ = ["TRAINER_TASKS", "DEFAULT_INIT", "TrainerTask", "build_trainer_task", "run_trainer_bench", "main"]

logger = logging.getLogger(__name__)

DEFAULT_INIT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "egeria" / "ptb-gpt"
"""Where ``scripts/pretrain_ptb_lm.py`` writes the pretrained model by default."""


@dataclass
class TrainerTask:
    """One fine-tuning task instance for the ``Trainer``.

    Attributes:
        model: the model to fine-tune (an HF ``PreTrainedModel``).
        train: the training dataset (items: dicts of tensors, ``labels`` included).
        evaluate: ``evaluate(model) -> metric`` (the model in eval mode).
        steps_per_epoch: optimizer steps per epoch; batch: the batch size; learning_rate.
        init: the pretrained folder and its weights' SHA-256.
    """

    name: str
    model: nn.Module
    train: torch.utils.data.Dataset
    evaluate: Callable[[nn.Module], float]
    metric: str
    higher_is_better: bool
    epochs: int
    steps_per_epoch: int
    batch: int
    learning_rate: float
    init: dict
    warmup: float = 0.0  # the Trainer's warmup_steps: a share of the run below 1
    weight_decay: float = 0.0


def _accuracy(held_out: torch.utils.data.Dataset) -> Callable[[nn.Module], float]:
    """The classifier's accuracy on ``held_out`` (items with ``input_ids``, ``attention_mask``
    and ``labels``)."""

    @torch.no_grad()
    def accuracy(model: nn.Module) -> float:
        loader = torch.utils.data.DataLoader(held_out, batch_size=256)
        device = next(model.parameters()).device
        correct = total = 0
        for item in loader:
            logits = model(input_ids=item["input_ids"].to(device), attention_mask=item["attention_mask"].to(device)).logits
            correct += int((logits.argmax(-1).cpu() == item["labels"]).sum())
            total += len(item["labels"])
        return correct / total

    return accuracy


def _gpt_ptb_order(*, seed: int, epochs: int | None, limit: int | None, eval_limit: int | None,
                     init: str | Path | None) -> TrainerTask:
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from ..data import load_ptb
    from .word_order import WordOrder
    from .ptb_sentences import sentences

    folder = Path(init) if init is not None else DEFAULT_INIT
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise ValueError(
            f"gpt-ptb-order fine-tunes the model scripts/pretrain_ptb_lm.py makes; {weights} not found "
            f"(run `python scripts/pretrain_ptb_lm.py --out {folder}` first, or pass --init FOLDER)"
        )
    corpus = load_ptb()
    length, batch = 48, 32
    train = WordOrder(sentences(corpus, "train")[:limit], length)
    held_out = WordOrder((sentences(corpus, "valid") + sentences(corpus, "test"))[:eval_limit], length)
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the new pooler and classifier
    try:
        # the folder's own architecture: BERT (pooled [CLS]) or GPT-style (the last word, [SEP])
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    finally:
        hf_logging.set_verbosity(verbosity)

    return TrainerTask(
        "gpt-ptb-order", model, train, _accuracy(held_out), "accuracy", True, epochs or 3, math.ceil(len(train) / batch), batch,
        1e-4, {"path": str(folder), "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()},
    )


def _ptb_words(corpus: Any) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    """An encoding for :class:`~.word_order.WordOrder` through all-MiniLM-L6-v2's tokenizer:
    a sentence's PTB words as text (PTB's ``<unk>`` as the tokenizer's ``[UNK]``), cut or
    padded to ``length`` WordPiece ids, ``[CLS]`` and ``[SEP]`` included."""
    from ..models.pretrained import minilm_tokenizer
    from .ptb_sentences import SPECIALS

    tokenizer = minilm_tokenizer()
    words = [tokenizer.unk_token if w == "<unk>" else w for w in corpus.vocab]

    def encoding(ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        text = " ".join(words[i - len(SPECIALS)] for i in ids.tolist())
        made = tokenizer(text, max_length=length, truncation=True, padding="max_length", return_tensors="pt")
        return made["input_ids"][0], made["attention_mask"][0]

    return encoding


def _minilm_ptb_order(*, seed: int, epochs: int | None, limit: int | None, eval_limit: int | None,
                      init: str | Path | None) -> TrainerTask:
    from ..data import load_ptb
    from ..models.pretrained import minilm_classifier, minilm_folder, weights_sha256
    from .ptb_sentences import sentences
    from .word_order import WordOrder

    if init is not None:
        raise ValueError(f"minilm-ptb-order fine-tunes the packaged all-MiniLM-L6-v2; --init {init} is not taken")
    folder = minilm_folder()
    corpus = load_ptb()
    encoding = _ptb_words(corpus)
    length, batch = MINILM_LENGTH, 32
    train_limit = MINILM_TRAIN if limit is None else limit
    train = WordOrder(sentences(corpus, "train")[:train_limit], length, encoding=encoding)
    held_out = WordOrder((sentences(corpus, "valid") + sentences(corpus, "test"))[:eval_limit], length, encoding=encoding)
    torch.manual_seed(seed)
    model = minilm_classifier(2)
    return TrainerTask(
        "minilm-ptb-order", model, train, _accuracy(held_out), "accuracy", True, epochs or MINILM_EPOCHS,
        math.ceil(len(train) / batch), batch, 5e-5, {"path": str(folder), "weights_sha256": weights_sha256(folder)},
        warmup=0.1, weight_decay=0.01,
    )


MINILM_LENGTH = 48
"""WordPiece ids per sentence in ``minilm-ptb-order`` ([CLS] and [SEP] included; PTB's
sentences average about 21 words)."""
MINILM_TRAIN = 16_000
"""Training sentences of ``minilm-ptb-order`` (the first of PTB's 42,068): with
:data:`MINILM_EPOCHS`, 1,497 steps, a plain run of about 27 minutes of training (1609 s measured) on the
suite's 2-core AMD EPYC VM (1.08 s a step, measured on a plain run of the first 8,000
sentences: 811 s for 750 steps, ``benchmarks/results/tta-full/variants/minilm-8000/``)."""
MINILM_EPOCHS = 3


TRAINER_TASKS: dict[str, Callable[..., TrainerTask]] = {
    "gpt-ptb-order": _gpt_ptb_order,
    "minilm-ptb-order": _minilm_ptb_order,
}


def build_trainer_task(name: str, *, seed: int = 0, epochs: int | None = None, limit: int | None = None,
                       eval_limit: int | None = None, init: str | Path | None = None) -> TrainerTask:
    """Builds Trainer task ``name`` for ``seed``.

    Raises:
        ValueError: an unknown task, or the pretrained weights missing.
    """
    if name not in TRAINER_TASKS:
        raise ValueError(f"unknown Trainer task {name!r}; choose one of {sorted(TRAINER_TASKS)}")
    return TRAINER_TASKS[name](seed=seed, epochs=epochs, limit=limit, eval_limit=eval_limit, init=init)


def run_trainer_bench(
    task_name: str,
    policy: str,
    *,
    seed: int = 0,
    epochs: int | None = None,
    out_dir: str | Path = "benchmarks/results/runs",
    layout: str = "cpu",
    limit: int | None = None,
    eval_limit: int | None = None,
    records_per_epoch: int = 1,
    init: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    command: str | None = None,
    heap: str = "steady",
    cache: bool = False,
    device: str = "cpu",
    average: bool = False,
) -> dict:
    """Fine-tunes ``task_name`` through the ``Trainer`` under ``policy`` and writes
    ``<out_dir>/<layout>/<task>/<policy>-seed<seed>.json`` (and the weights as ``.pt``);
    the arguments as :func:`egeria.bench.run.run_bench`'s (no snapshots; ``cache`` through
    ``EgeriaCallback(cache=True)``; ``device="cuda"`` lets the Trainer train on the GPU;
    ``average`` freezes to the average, ``EgeriaCallback(average=WeightAverage())``).

    Raises:
        ValueError: an unknown task, policy, layout or heap, a bad ``records_per_epoch``
            or override, or missing pretrained weights.
    """
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICY_NAMES)}")
    check_int(records_per_epoch, "records_per_epoch")
    if heap not in HEAPS:
        raise ValueError(f"unknown heap {heap!r}; choose one of {list(HEAPS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: cpu or cuda (the Trainer picks the GPU)")
    training_device(device, f"device {device!r}")
    place = resolve_layout(layout)
    if heap == "steady":
        steady_heap()
    with pinned(place):
        return _run(task_name, policy, seed=seed, epochs=epochs, out=Path(out_dir) / layout, place=place, limit=limit,
                    eval_limit=eval_limit, records_per_epoch=records_per_epoch, init=init, cache=cache,
                    overrides={**place.config_overrides(policy), **(overrides or {})}, command=command,
                    device=device, average=average)


def _run(task_name, policy, *, seed, epochs, out, place, limit, eval_limit, records_per_epoch, init, overrides,
         command, cache, device, average) -> dict:
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ..averaging import WeightAverage
    from ..integrations.hf import EgeriaCallback
    from .tasks import baseline_options

    task = build_trainer_task(task_name, seed=seed, epochs=epochs, limit=limit, eval_limit=eval_limit, init=init)
    if policy == "egeria":
        cfg = EgeriaConfig()
    else:
        cfg = EgeriaConfig(policy=policy, policy_options=baseline_options(task.steps_per_epoch, task.epochs)[policy])
    if overrides:
        cfg = cfg.replace(**overrides)
    egeria_cb = EgeriaCallback(cfg, cache=cache, average=WeightAverage() if average else None)
    total_steps = task.steps_per_epoch * task.epochs
    every = max(1, task.steps_per_epoch // records_per_epoch)
    records: list[dict] = []
    losses: list[float] = []
    flops = _StepFlops(egeria_cb)

    class Recorder(TrainerCallback):
        """Evaluates and records after Egeria's step, outside the timed training."""

        started = 0.0
        evaluating = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.evaluating = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if step % every and step != state.max_steps:
                return
            began = time.perf_counter()
            wall = began - self.started - self.evaluating
            model.eval()
            metric = float(task.evaluate(model))
            model.train()
            eg = egeria_cb.egeria
            partition, frozen = eg.partition, set(eg.frozen)
            total = sum(m.num_params for m in partition.modules)
            trainable = sum(m.num_params for m in partition.modules if m.name not in frozen)
            finite = [v for v in losses if math.isfinite(v)]
            records.append({
                "step": step, "epoch": step / task.steps_per_epoch, "wall_time_s": wall, "metric": metric,
                "loss": sum(finite) / len(finite) if finite else None, "frozen": list(eg.frozen),
                "trainable_share": trainable / total if total else 1.0, "flops_per_step": flops.current.total,
                "backward_flops_per_step": flops.current.backward,
                "backward_share": share(flops.current.backward, flops.first.backward),
            })
            losses.clear()
            self.evaluating += time.perf_counter() - began

    class CountingTrainer(Trainer):
        """Counts a step's FLOPs where the frozen set is new, and keeps each step's loss."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = flops.run(lambda: super(CountingTrainer, self).training_step(model, inputs, num_items_in_batch))
            losses.append(float(loss))
            return loss

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return flops.forward(lambda: super(CountingTrainer, self).compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch))

    with tempfile.TemporaryDirectory(prefix="egeria-trainer-") as scratch:
        args = TrainingArguments(
            output_dir=scratch, num_train_epochs=task.epochs, per_device_train_batch_size=task.batch,
            learning_rate=task.learning_rate, warmup_steps=task.warmup, weight_decay=task.weight_decay, seed=seed,
            data_seed=seed, eval_strategy="no", save_strategy="no",
            logging_strategy="no", report_to="none", use_cpu=device == "cpu", disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = CountingTrainer(model=task.model, args=args, train_dataset=task.train,
                                  callbacks=[egeria_cb, Recorder()])
        egeria_cb.attach(trainer)
        trainer.train()
    eg = egeria_cb.egeria
    partition = eg.partition
    result = {
        "format": FORMAT,
        "task": task_name,
        "policy": policy,
        "policy_options": dict(cfg.policy_options),
        "seed": seed,
        "epochs": task.epochs,
        "command": command or f"python -m egeria.bench.trainer_run {task_name} --policy {policy} --seed {seed} "
        f"--layout {place.name}",
        "machine": describe_machine(device),
        "code": _code_commit(),
        "layout": place.to_dict(),
        "config": cfg.to_dict(),
        "metric": {"name": task.metric, "higher_is_better": task.higher_is_better},
        "steps_per_epoch": task.steps_per_epoch,
        "total_steps": total_steps,
        "limit": limit,
        "eval_limit": eval_limit,
        "cache": cache,
        "average": average,
        "heap": heap_state(),
        "trainer": {
            "transformers": transformers.__version__, "learning_rate": args.learning_rate,
            "lr_scheduler_type": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay, "batch": task.batch,
            "optim": str(getattr(args.optim, "value", args.optim)), "global_steps": trainer.state.global_step,
        },
        "init": task.init,
        "modules": partition.names,
        "freezable": partition.freezable,  # how many leading modules may freeze
        "cap": partition.cap,  # of them, how many may freeze while they still move (None: all)
        "module_params": [m.num_params for m in partition.modules],
        "total_params": sum(m.num_params for m in partition.modules),
        "records": records,
        "events": [d.to_dict() for d in eg.events],
        "plasticity": eg.history,
        "memory": eg.memory_history,  # bytes by part, sampled and around each change (egeria.memory)
        "controller": eg.controller_stats,
        "cache_stats": eg.cache_stats if cache else None,
        "final": {
            "metric": records[-1]["metric"],
            "wall_time_s": records[-1]["wall_time_s"],
            "total_flops": flops.total,
            "total_backward_flops": flops.total_backward,
        },
    }
    target = out / task_name / f"{policy}-seed{seed}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1))
    torch.save(task.model.state_dict(), target.with_suffix(".pt"))
    logger.info("wrote %s", target)
    return result


class _StepFlops:
    """FLOPs of the Trainer's steps: counted under torch's FLOP counter on the first step and
    on the first after each change of the frozen set, carried over to the steps between."""

    def __init__(self, callback: Any) -> None:
        from .flops import StepFlops

        self._callback = callback
        self._counted_for: tuple[str, ...] | None = None
        self._counting = False
        self._forward = 0.0
        self.first = self.current = StepFlops(0.0, 0.0)
        self.total = self.total_backward = 0.0

    def run(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Runs one training step (forward and backward), counting it where due."""
        from torch.utils.flop_counter import FlopCounterMode

        from .flops import StepFlops

        eg = self._callback.egeria
        frozen = tuple(eg.frozen) if eg is not None else ()
        if frozen != self._counted_for:
            self._counting, self._forward = True, 0.0
            try:
                with FlopCounterMode(display=False) as counter:
                    loss = step()
            finally:
                self._counting = False
            all_flops = float(counter.get_total_flops())
            self.current = StepFlops(self._forward, all_flops - self._forward)
            if self._counted_for is None:
                self.first = self.current
            self._counted_for = frozen
        else:
            loss = step()
        self.total += self.current.total
        self.total_backward += self.current.backward
        return loss

    def forward(self, compute: Callable[[], Any]) -> Any:
        """Runs the model and its loss, counting them apart inside a counted step."""
        if not self._counting:
            return compute()
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            out = compute()
        self._forward = float(counter.get_total_flops())
        return out


def main(argv: list[str] | None = None) -> int:
    """``python -m egeria.bench.trainer_run TASK ...``: ``egeria bench``'s flags for a
    Trainer task (``--snapshots`` refused)."""
    from ..cli import parse_overrides

    p = argparse.ArgumentParser(prog="python -m egeria.bench.trainer_run", description=__doc__.splitlines()[0])
    p.add_argument("task", choices=sorted(TRAINER_TASKS))
    p.add_argument("--policy", default="egeria", choices=POLICY_NAMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/runs", metavar="DIR")
    p.add_argument("--layout", default="cpu", choices=LAYOUTS)
    p.add_argument("--limit", type=int, default=None, help="first N training sentences only (quick runs)")
    p.add_argument("--eval-limit", type=int, default=None,
                   help="first N held-out sentences only (the task built on them alone: its own labels)")
    p.add_argument("--records-per-epoch", type=int, default=1)
    p.add_argument("--init", default=None, metavar="FOLDER", help=f"the pretrained encoder (default {DEFAULT_INIT})")
    p.add_argument("--no-progress", action="store_true", help="accepted for egeria bench's sake; nothing is shown")
    p.add_argument("--cache", action="store_true", help="serve the frozen prefix from the activation cache")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the Trainer trains")
    p.add_argument("--average", action="store_true", help="freeze each module to the average of its recent weights")
    p.add_argument("--heap", choices=HEAPS, default="steady")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides")
    args = p.parse_args(argv)
    command = "python -m egeria.bench.trainer_run " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run_trainer_bench(
        args.task, args.policy, seed=args.seed, epochs=args.epochs, out_dir=args.out, layout=args.layout,
        limit=args.limit, eval_limit=args.eval_limit, records_per_epoch=args.records_per_epoch, init=args.init,
        overrides=parse_overrides(args.overrides), command=command, heap=args.heap, cache=args.cache,
        device=args.device, average=args.average,
    )
    final = result["final"]
    print(f"{args.task} / {args.policy} / seed {args.seed} / {args.layout}: {result['metric']['name']} "
          f"{final['metric']:.4f}, {final['wall_time_s']:.1f} s of training, {final['total_flops']:.3g} FLOPs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
