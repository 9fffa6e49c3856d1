"""Egeria in your own training loop, on its defaults: a small ResNet on Fashion-MNIST with
SGD and a one-cycle schedule (warm-up, then a cosine decay to nearly 0); the front layers
freeze once they have settled, and the frozen prefix's forward pass is served from the
activation cache.

Run (CPU; from the clone after ``pip install -e .``, or ``bash scripts/setup.sh`` and
``.venv/bin/python``)::

    python examples/plain_loop.py            # 12,800 images, 10 epochs: a few minutes on 2 cores
    python examples/plain_loop.py --quick    # 2,048 images, 3 epochs: seconds (what CI runs)

The Fashion-MNIST files are read from ``/usr/share/datasets/fashion-mnist`` (the Debian
package ``scripts/setup.sh`` installs) or ``--data``; without them the example trains on
random images of the same shape and says so (nothing to learn: expect no accuracy).

Whether and when a module freezes rests on the readings of the run, so it differs with the
data, the seed and the length; at the defaults a module that is still learning freezes late
in the schedule, and a short run may end with nothing frozen. The example prints each
decision as ``eg.step`` returns it and, at the end, what Egeria holds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import egeria
from egeria.data.fashion_mnist import FASHION_MNIST_ROOT
from egeria.models import resnet


def datasets(root: str, train: int, test: int) -> tuple[TensorDataset, TensorDataset, bool]:
    """(training data, test data, real): Fashion-MNIST where its files are, else random images."""
    if (Path(root) / "train-labels-idx1-ubyte.gz").exists() or (Path(root) / "train-labels-idx1-ubyte").exists():
        from egeria.data import load_fashion_mnist

        return load_fashion_mnist(root, "train", limit=train), load_fashion_mnist(root, "test", limit=test), True
    g = torch.Generator().manual_seed(0)
    fake = [TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
            for n in (train, test)]
    return fake[0], fake[1], False


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    correct = sum(int((model(x[i : i + 256]).argmax(1) == y[i : i + 256]).sum()) for i in range(0, len(y), 256))
    model.train()
    return correct / len(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a run of seconds (what CI runs)")
    parser.add_argument("--data", default=str(FASHION_MNIST_ROOT), help="folder of the Fashion-MNIST IDX files")
    parser.add_argument("--epochs", type=int, default=None, help="passes over the data (10; quick: 3)")
    args = parser.parse_args()
    train_size, test_size, epochs = (2_048, 1_000, 3) if args.quick else (12_800, 10_000, 10)
    epochs = args.epochs or epochs

    torch.manual_seed(0)
    train, test, real = datasets(args.data, train_size, test_size)
    if not real:
        print(f"no Fashion-MNIST in {args.data}: training on random images (nothing to learn)")
    loader = DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = resnet(depth=8, in_channels=1, num_classes=10, width=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    total_steps = len(loader) * epochs
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)

    # Egeria on its defaults: it reads the learning rate ahead from a copy of the scheduler.
    eg = egeria.Egeria(model, optimizer, lr_scheduler=scheduler, total_steps=total_steps)
    loader = eg.cache_loader(loader)  # optional: the frozen prefix's outputs are served, not recomputed
    print(f"{len(train)} images, {epochs} epochs, {total_steps} optimizer steps, one-cycle schedule")
    for epoch in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            for decision in eg.step(loss):  # the decisions applied at this step boundary
                print(f"  step {decision.step}: {decision.action} {', '.join(decision.modules)} ({decision.reason})")
        print(f"epoch {epoch + 1}: test accuracy {accuracy(model, test):.2%}, "
              f"{len(eg.frozen)} of {len(eg.modules)} layer modules frozen")

    signals = eg.metrics()
    frozen_share = signals.get("egeria/frozen_params_share", 0.0)
    print(f"Egeria counted {eg.steps} optimizer steps of {total_steps}; layer modules: {eg.modules}")
    print(f"frozen at the end: {eg.frozen or 'none'} ({frozen_share:.1%} of parameters)")
    eg.close()


if __name__ == "__main__":
    main()
