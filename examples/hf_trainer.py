"""Egeria in a Hugging Face ``Trainer``, on its defaults: a tiny GPT-2 learns a toy language
under the Trainer's warm-up and linear decay, Egeria's callback is attached with its
activation cache, and the run is resumed from its checkpoint.

Run (CPU; from the clone after ``pip install -e ".[hf]"``)::

    python examples/hf_trainer.py                 # 400 steps: a few minutes on 2 cores
    python examples/hf_trainer.py --quick         # 160 steps: well under a minute (what CI runs)
    torchrun --nproc_per_node 2 examples/hf_trainer.py --out /tmp/egeria-hf   # DDP, 2 CPU processes

The model is built from a ``GPT2Config`` (nothing is downloaded); its input embedding is
tied to its output layer, so the front module freezes with the embedding lookup detached
and the shared weight keeps training through ``lm_head``. The text is generated here: a
random first-order Markov chain over ``--vocab`` tokens, a language a small model learns
in a few hundred steps. Whether and when a module freezes rests on the run's readings: at
the defaults a module still learning freezes late in a linear decay, if at all, and a short
run may end with nothing frozen; the callback then says why, once, as a warning.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from egeria.integrations.hf import STATE_FILE, EgeriaCallback


class MarkovText(torch.utils.data.Dataset):
    """``count`` sequences of ``length`` tokens from a random sparse Markov chain."""

    def __init__(self, vocab: int, count: int = 512, length: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        # Each token is followed by one of 3 likely successors: a learnable structure.
        successors = torch.randint(0, vocab, (vocab, 3), generator=g)
        tokens = torch.empty(count, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (count,), generator=g)
        for t in range(1, length):
            pick = torch.randint(0, 3, (count,), generator=g)
            tokens[:, t] = successors[tokens[:, t - 1], pick]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def checkpoint_step(args: argparse.Namespace) -> int:
    """The step of the checkpoint the run is resumed from: three quarters in."""
    return args.steps * 3 // 4


def build_trainer(args: argparse.Namespace, callback: EgeriaCallback):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=32, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,  # Egeria counts optimizer steps, not micro-batches
        learning_rate=3e-3,
        lr_scheduler_type="linear",  # the Trainer's default, after a warm-up
        warmup_steps=args.steps // 10,
        weight_decay=0.01,
        save_strategy="steps",
        save_steps=checkpoint_step(args),
        logging_steps=50,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=MarkovText(args.vocab))
    callback.attach(trainer)  # adds the callback and hands it the Trainer (its DDP under torchrun)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    parser.add_argument("--quick", action="store_true", help="160 steps: well under a minute (what CI runs)")
    parser.add_argument("--vocab", type=int, default=64, help="tokens of the toy language (default 64)")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    args = parser.parse_args()
    if args.quick:
        args.steps = 160
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.out is None:
        parser.error("under torchrun pass --out, a folder every rank sees (rank 0 writes the checkpoints)")
    args.out = args.out or tempfile.mkdtemp(prefix="egeria-hf-")

    # Egeria on its defaults; cache=True serves the frozen prefix through the Trainer's own loader.
    callback = EgeriaCallback(cache=True, on_change=lambda d: print(f"  step {d.step}: {d.action} {d.modules} ({d.reason})"))
    print(f"training {args.steps} steps into {args.out}")
    trainer = build_trainer(args, callback)
    trainer.train()
    eg = callback.egeria
    print(f"layer modules: {eg.modules}")
    print(f"Egeria counted {eg.steps} optimizer steps; the Trainer {trainer.state.global_step}")

    half = os.path.join(args.out, f"checkpoint-{checkpoint_step(args)}")
    with open(os.path.join(half, STATE_FILE)) as f:
        saved = json.load(f)["state"]  # Egeria.state_dict(), its tensors in the .pt beside it
    frozen = eg.modules[: saved["frozen"]]
    print(f"{half}/{STATE_FILE}: step {saved['steps']}, frozen {frozen}")

    print(f"resuming from {half}")
    resumed = EgeriaCallback(cache=True)
    trainer = build_trainer(args, resumed)
    trainer.train(resume_from_checkpoint=half)
    print(f"resumed run ended at step {resumed.egeria.steps} with events:")
    for d in resumed.egeria.events:
        print(f"  step {d.step}: {d.action} {d.modules}")


if __name__ == "__main__":
    main()
