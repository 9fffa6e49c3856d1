"""A training process with the activation cache on disk, for tests/cache/test_cache_files.py (not
a test file). Usage: ``python cache_worker.py MODE FOLDER``.

Modes:
    kill: trains until the cache has rows on disk (``directory=FOLDER``), prints
        ``ready PID FD PATH`` and waits on stdin for the test to kill it.
    exit: the same with the default directory (the test sets TMPDIR=FOLDER), prints
        ``ready DIRECTORY`` and exits normally without ``eg.close()``.
    named: a disk table whose file cannot be unlinked while open (as on Windows), rows
        written, prints ``ready PATH`` while the file is there, waits for a line on stdin
        and exits without closing it.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import egeria
from egeria.cache import store
from tiny import Plan, tiny_cnn


KEEP: list = []  # alive until interpreter exit: nothing is collected before it


def disk_tables(eg):
    return [t for lv in eg._cache.levels.values() for t in lv.tables or [] if t.kind == "disk"]


def train(directory: str | None, *, plan: dict[int, int] | None = None, stop=lambda eg: False, epochs: int = 4) -> egeria.Egeria:
    """Trains a tiny CNN with the cache on disk (memory_limit=0) until ``stop(eg)``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(96, 1, 12, 12, generator=g), torch.randint(0, 3, (96,), generator=g))
    model = tiny_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    eg = egeria.Egeria(model, opt, policy=Plan(plan or {3: 1}))
    loader = eg.cache_loader(
        torch.utils.data.DataLoader(data, batch_size=16), memory_limit=0, directory=directory, prefetch=0, serve="always"
    )
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            eg.step(loss)
            if stop(eg):
                return eg
    return eg


def rows_on_disk(eg: egeria.Egeria) -> bool:
    tables = disk_tables(eg)
    return bool(tables) and all(t.written.any() for t in tables)


def train_until_rows_on_disk(directory: str | None) -> tuple[egeria.Egeria, list]:
    eg = train(directory, stop=rows_on_disk)
    if not rows_on_disk(eg):
        raise SystemExit("no cache rows were written to disk")
    return eg, disk_tables(eg)


def main(mode: str, folder: str) -> None:
    if mode == "kill":
        eg, tables = train_until_rows_on_disk(folder)
        print("ready", os.getpid(), tables[0].fd, tables[0].path, flush=True)
        sys.stdin.read()  # killed here
    elif mode == "exit":
        eg, tables = train_until_rows_on_disk(None)
        KEEP.append(eg)
        print("ready", eg.cache_stats["directory"], flush=True)
    elif mode == "named":
        real = os.unlink

        def refuse_once(path, *args, **kwargs):
            store.os.unlink = real  # only the unlink right after creation fails, as on Windows
            raise PermissionError(13, "The process cannot access the file because it is being used", path)

        store.os.unlink = refuse_once
        table = store.DiskTable(8, (4,), torch.float32, directory=folder)
        table.write([0, 1], torch.ones(2, 4))
        assert not table.unlinked and os.path.exists(table.path)
        KEEP.append(table)
        print("ready", table.path, flush=True)
        sys.stdin.readline()  # the test looks at the file, then lets it exit
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
