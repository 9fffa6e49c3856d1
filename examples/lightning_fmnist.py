"""Egeria in PyTorch Lightning, on its defaults: a small ResNet on a slice of Fashion-MNIST
with SGD and a one-cycle schedule stepped every batch; the front layers freeze once they
have settled, and a run stopped halfway resumes from its checkpoint with Egeria's state.

Run (CPU; from the clone after ``pip install -e ".[lightning]"``, with the Fashion-MNIST
files in ``/usr/share/datasets/fashion-mnist`` or ``--data``)::

    python examples/lightning_fmnist.py
    python examples/lightning_fmnist.py --quick --resume   # seconds (what CI runs)
    python examples/lightning_fmnist.py --devices 2        # 2 CPU processes, strategy="ddp" (slower)
    python examples/lightning_fmnist.py --resume           # stop halfway, resume from its checkpoint

The LightningModule keeps its network in ``self.net``, which ``EgeriaCallback(module="net")``
splits into layer modules and freezes; Lightning itself calls the LightningModule with
``(batch, batch_idx)``. Whether and when a module freezes rests on the run's readings: at
the defaults a module still learning freezes late in the schedule, and a short run may end
with nothing frozen (a warning then says why).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
import lightning.pytorch as pl
from torch.utils.data import DataLoader

from egeria.data import load_fashion_mnist
from egeria.data.fashion_mnist import FASHION_MNIST_ROOT
from egeria.integrations.lightning import EgeriaCallback
from egeria.models import resnet


class FashionClassifier(pl.LightningModule):
    """ResNet-8 (width 8) classifying 28x28 Fashion-MNIST images; SGD with a one-cycle schedule
    over ``epochs`` epochs (fixed here, so a run stopped halfway and its resume share one
    schedule)."""

    def __init__(self, epochs: int, lr: float = 0.05) -> None:
        super().__init__()
        self.net = resnet(depth=8, in_channels=1, num_classes=10, width=8)
        self.epochs, self.lr = epochs, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        per_epoch = int(self.trainer.estimated_stepping_batches) // self.trainer.max_epochs  # this rank's batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.epochs * per_epoch)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_trainer(args: argparse.Namespace, callback: EgeriaCallback, max_epochs: int, out: str) -> pl.Trainer:
    saver = pl.callbacks.ModelCheckpoint(dirpath=out, save_last=True)  # out/last.ckpt at each epoch end
    return pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=max_epochs,
        callbacks=[callback, saver],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(FASHION_MNIST_ROOT), help="folder of the Fashion-MNIST IDX files")
    parser.add_argument("--train", type=int, default=4096, help="training images used")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (2 or more: DDP)")
    parser.add_argument("--resume", action="store_true", help="stop halfway, then resume from the checkpoint")
    parser.add_argument("--quick", action="store_true", help="512 images, 2 epochs: seconds (what CI runs)")
    parser.add_argument("--out", default=None, help="checkpoint folder (a temporary one by default)")
    args = parser.parse_args()
    if args.quick:
        args.train, args.epochs = 512, 2

    pl.seed_everything(0, verbose=False)
    train = DataLoader(load_fashion_mnist(args.data, "train", limit=args.train), batch_size=64, shuffle=True)
    val = DataLoader(load_fashion_mnist(args.data, "test", limit=1024), batch_size=256)
    out = args.out or tempfile.mkdtemp(prefix="egeria-lightning-")
    callback = EgeriaCallback(module="net")  # Egeria on its defaults
    model = FashionClassifier(args.epochs)

    ckpt_path = None
    if args.resume:  # a first run that stops halfway; its last checkpoint holds Egeria's state
        half = args.epochs // 2
        make_trainer(args, callback, half, out).fit(model, train, val)
        ckpt_path = f"{out}/last.ckpt"
        callback, model = EgeriaCallback(module="net"), FashionClassifier(args.epochs)
    trainer = make_trainer(args, callback, args.epochs, out)
    trainer.fit(model, train, val, ckpt_path=ckpt_path)

    if trainer.is_global_zero:
        eg = callback.egeria
        print(f"\n{trainer.global_step} optimizer steps, Egeria counted {eg.steps}; layer modules: {eg.modules}")
        for event in eg.events:
            print(f"  step {event.step:4d}: {event.action:8s} {', '.join(event.modules) or '-':30s} {event.reason}")
        print(f"validation accuracy {trainer.callback_metrics['val_acc']:.3f}; checkpoints in {out}")


if __name__ == "__main__":
    main()
