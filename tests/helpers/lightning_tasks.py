"""A small LightningModule and a recording callback for the Lightning tests (not a test file;
importable by ``ddp_spawn``'s worker processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

from egeria.integrations.lightning import EgeriaCallback
from tiny import Chain

# Bytes each DDP bucket all-reduce sent in this process (the counting comm hook appends).
SENT: list[int] = []


class Task(pl.LightningModule):
    """tiny.Chain as a LightningModule: SGD with momentum and weight decay."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.net = Chain()
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


def loader(repeats: int, *, samples: int = 32, batch: int = 16) -> DataLoader:
    """The same ``samples`` random points ``repeats`` times, in order (so a run is short
    and its loss settles fast)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(samples, 8, generator=g), torch.randint(0, 3, (samples,), generator=g)
    return DataLoader(TensorDataset(x.repeat(repeats, 1), y.repeat(repeats)), batch_size=batch, shuffle=False)


def trainer(callbacks: list, *, accumulate: int = 2, **kw) -> pl.Trainer:
    settings = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
    )
    settings.update(kw)
    return pl.Trainer(callbacks=callbacks, **settings)


def _counting_hook(state, bucket):
    """All-reduces (averages) a bucket as DDP does, and counts its bytes in ``SENT``."""
    buffer = bucket.buffer()
    SENT.append(buffer.numel() * buffer.element_size())
    work = dist.all_reduce(buffer.div_(dist.get_world_size()), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class Recorder(pl.Callback):
    """What the tests check, read after EgeriaCallback's step at every batch (list it after
    the EgeriaCallback).

    Records at the start (global_step, Egeria's steps, frozen names), per optimizer step: (global_step, Egeria's steps, frozen names, bytes
    all-reduced). At each freeze: the frozen parameters and all weights; at each unfreeze:
    whether the frozen parameters stayed bit-identical, and all weights. ``drop_lr_after``:
    steps after the first freeze at which the learning rate drops 10x (once). ``out``: a
    folder for ``rank<R>.pt`` (DDP runs), written at the end of training.
    """

    def __init__(self, egeria: EgeriaCallback, *, drop_lr_after: int | None = None, out: str | None = None) -> None:
        self.egeria = egeria
        self.drop_lr_after = drop_lr_after
        self.out = out
        self.steps: list[tuple] = []
        self.at_freeze: list[dict] = []
        self.at_unfreeze: list[dict] = []
        self._seen = 0
        self._frozen: dict[str, torch.Tensor] = {}
        self._last_global = -1
        self._sent_before = 0
        self._dropped = False

    def on_train_start(self, trainer, pl_module):
        eg = self.egeria.egeria
        self.started = (trainer.global_step, eg.steps, list(eg.frozen))  # a resumed run's, restored
        self._seen = len(eg.events)  # a resumed run's earlier events are not recorded again
        self._last_global = trainer.global_step
        ddp = trainer.strategy.model
        if self.out is not None and ddp is not pl_module:
            ddp.register_comm_hook(None, _counting_hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        eg = self.egeria.egeria
        net = pl_module.net
        for event in eg.events[self._seen :]:
            if event.action == "freeze":
                self._frozen = {n: p.detach().clone() for n, p in self._named_frozen(eg, net).items()}
                self.at_freeze.append({"step": event.step, "weights": _flat(net), "frozen": list(eg.frozen)})
            elif event.action == "unfreeze":
                named = dict(net.named_parameters())
                unchanged = bool(self._frozen) and all(torch.equal(v, named[n]) for n, v in self._frozen.items())
                self.at_unfreeze.append({"step": event.step, "weights": _flat(net), "frozen_unchanged": unchanged})
                self._frozen = {}
        self._seen = len(eg.events)
        if trainer.global_step != self._last_global:  # this batch ended in an optimizer step
            self._last_global = trainer.global_step
            sent = sum(SENT[self._sent_before :])
            self._sent_before = len(SENT)
            self.steps.append((trainer.global_step, eg.steps, list(eg.frozen), sent, _trainable_bytes(net)))
            freezes = [e.step for e in eg.events if e.action == "freeze"]
            if self.drop_lr_after is not None and freezes and not self._dropped:
                if eg.steps == freezes[0] + self.drop_lr_after:
                    for group in trainer.optimizers[0].param_groups:
                        group["lr"] *= 0.1
                    self._dropped = True

    def on_train_end(self, trainer, pl_module):
        self.final = {"weights": _flat(pl_module.net), "frozen_unchanged_to_end": self.frozen_unchanged(pl_module)}
        if self.out is not None:
            record = dict(steps=self.steps, at_freeze=self.at_freeze, at_unfreeze=self.at_unfreeze, final=self.final)
            record["events"] = [e.to_dict() for e in self.egeria.egeria.events]
            record["global_step"] = trainer.global_step
            torch.save(record, f"{self.out}/rank{trainer.global_rank}.pt")

    def frozen_unchanged(self, pl_module) -> bool | None:
        """Whether the parameters frozen at the last freeze are bit-identical now (None:
        nothing is frozen)."""
        if not self._frozen:
            return None
        named = dict(pl_module.net.named_parameters())
        return all(torch.equal(v, named[n]) for n, v in self._frozen.items())

    @staticmethod
    def _named_frozen(eg, net) -> dict[str, torch.Tensor]:
        named = dict(net.named_parameters())
        return {p: named[p] for m in eg.partition.modules if m.name in eg.frozen for p in m.params}


def _flat(net) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in net.parameters()]).clone()


def _trainable_bytes(net) -> int:
    return sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
