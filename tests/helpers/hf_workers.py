"""The tiny GPT-2 and data of the Hugging Face Trainer tests, and the worker of their
2-process DDP test (not a test file). Each worker writes what it saw to ``<out>/rank<R>.pt``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers

from egeria.integrations.hf import EgeriaCallback
from tiny import quick_config

VOCAB = 48


class Tokens(torch.utils.data.Dataset):
    """32 fixed random sequences for causal LM training (labels are the inputs); with
    ``distinct``, only that many different sequences, repeated (an easy task that
    converges, and so freezes, well within a short run)."""

    def __init__(self, distinct: int = 32, count: int = 32, length: int = 12) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (distinct, length), generator=g).repeat(count // distinct, 1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=4, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class _DDPRecorder(transformers.TrainerCallback):
    """Per optimizer step: the frozen set, the bytes DDP all-reduced, the bytes of the
    trainable parameters, and the first layer module's weights."""

    def __init__(self, callback: EgeriaCallback, world: int) -> None:
        self.callback, self.world = callback, world
        self.steps: list[dict] = []
        self.sent: list[int] = []
        self.trainer: transformers.Trainer | None = None  # set once the Trainer is built

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        ddp = self.trainer.model_wrapped  # the Trainer's DDP, which Egeria rebuilds in place
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
        ddp.register_comm_hook(None, self._count)
        self.model = model

    def _count(self, _state, bucket):
        buffer = bucket.buffer()
        self.sent.append(buffer.numel() * buffer.element_size())
        work = dist.all_reduce(buffer.div_(self.world), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def on_step_end(self, args, state, control, **kwargs):
        eg = self.callback.egeria
        named = dict(self.model.named_parameters())
        first = torch.cat([named[p].detach().flatten() for p in eg.partition.modules[0].params])
        trainable = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        self.steps.append({"step": state.global_step, "frozen": list(eg.frozen), "sent": sum(self.sent),
                           "trainable": trainable, "first_module": first.clone()})
        self.sent.clear()


def train_two_ranks(rank: int, world: int, port: int, out: str) -> None:
    """Two DDP ranks on CPU over gloo, as torchrun starts them: accumulation 2, Egeria's own
    rule on a task that converges, and a 10x LR drop 3 steps after the first freeze, which
    unfreezes. (The drop follows the recorder, not a scheduler's count: accelerate steps a
    scheduler once per process at every optimizer step.)"""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    callback = EgeriaCallback(quick_config(tolerance_ratio=1.0))
    recorder = _DDPRecorder(callback, world)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=40, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        use_cpu=True, ddp_backend="gloo", seed=0, data_seed=0, save_strategy="no", logging_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
    )
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def lr_factor(_: int) -> float:
        frozen_for = sum(1 for r in recorder.steps if r["frozen"])
        return 0.1 if frozen_for >= 3 else 1.0

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(distinct=4),
                                   callbacks=[callback, recorder], optimizers=(opt, schedule))
    callback.attach(trainer)
    import gc

    def refused(*args, **kwargs):
        raise AssertionError("gc.get_objects() called: EgeriaCallback must not scan the heap")

    gc.get_objects = refused  # this rank's process only
    recorder.trainer = trainer
    trainer.train()
    torch.save({
        "events": [e.to_dict() for e in callback.egeria.events],
        "steps": recorder.steps,
        "weights": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]),
        "wrapped": type(trainer.model_wrapped).__name__,
    }, os.path.join(out, f"rank{rank}.pt"))
