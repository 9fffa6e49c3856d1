"""A short run on real Fashion-MNIST: plain PyTorch against Egeria, same seed and data order."""

from __future__ import annotations

import pytest
import torch

import egeria
from egeria.data import load_fashion_mnist
from egeria.bench.harness import classification_loss, train
from egeria.models import resnet
from needs_data import needs_fmnist

pytestmark = needs_fmnist

EPOCHS = 5
# How far Egeria may end below plain. Runs this short are chaotic: over seeds 0-4 the plain
# run's accuracy spans 76.2% to 80.2% (benchmarks/studies/real_data_spread.py, committed in
# benchmarks/results/real_data_spread/). With the same seed Egeria ended 0 to 0.6 points
# below plain on the AMD CI machines, 2.4 points below on an Intel one, where other float
# kernels change the trajectory as another seed would. The margin is the measured plain
# seed range: a loss beyond it is Egeria's, not the seed's.
MARGIN = 0.041


def run(train_ds, test_ds, use_egeria: bool, seed: int = 0):
    """One short run; ``seed`` sets the initial weights and the batch order."""
    torch.manual_seed(seed)
    model = resnet(depth=8, in_channels=1, width=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loader = torch.utils.data.DataLoader(
        train_ds, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(0.8 * EPOCHS * len(loader))], 0.1)
    # Egeria's default rule, which reads the schedule: it freezes once the decay has left
    # little movement to come (steps 144-159 on seeds 0-5 here). The paper's rule with
    # W=5 froze nothing on one seed in seven in this short run (seed 4), and nothing on
    # seed 0 in one full-suite run where the test alone froze at step 81: a run this short
    # is chaotic, and its float sums differ with what the process ran before.
    config = egeria.EgeriaConfig(eval_interval=3, window=5, executor="inline", reference_precision="int8")
    total = EPOCHS * len(loader)
    eg = egeria.Egeria(model, opt, config=config, lr_scheduler=sched, total_steps=total) if use_egeria else None
    train(model, opt, lambda: loader, classification_loss, epochs=EPOCHS, scheduler=sched, egeria=eg)
    model.eval()
    with torch.no_grad():
        x, y = test_ds.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return accuracy, eg


@pytest.mark.slow
def test_front_module_freezes_first_and_accuracy_holds_on_fashion_mnist():
    train_ds = load_fashion_mnist(split="train", limit=4000)
    test_ds = load_fashion_mnist(split="test", limit=2000)
    plain, _ = run(train_ds, test_ds, use_egeria=False)
    frozen_run, eg = run(train_ds, test_ds, use_egeria=True)

    freezes = [e for e in eg.events if e.action == "freeze"]
    assert freezes, f"nothing froze; readings: {eg.history[-5:]}"
    assert freezes[0].modules[0] == eg.modules[0]
    # Between unfreezes, each freeze takes the next modules after those already frozen.
    depth = 0
    for event in eg.events:
        if event.action == "unfreeze":
            depth = 0
        elif event.action == "freeze":
            assert event.modules == tuple(eg.modules[depth : depth + len(event.modules)])
            depth += len(event.modules)
    assert frozen_run >= plain - MARGIN, (plain, frozen_run)
