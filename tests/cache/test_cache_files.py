"""No activation-cache file outlives its run: a disk table's file is unlinked as soon as it is
open, so a killed process and a normal exit without close() leave nothing in its folder; where
an open file cannot be unlinked it is removed at exit. The disk tier is chosen only where its
folder has room for it, and says where it writes."""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cache_worker
from cache_worker import disk_tables, rows_on_disk, train
from egeria.cache.store import FILE_PREFIX, DiskTable

WORKER = Path(cache_worker.__file__)
ROW = 4 * 12 * 12 * 4  # bytes per sample of the first module's output: 4 channels of 12x12 fp32
NEED = 96 * ROW  # the first level's disk table: 96 samples


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(f"{FILE_PREFIX}*")) if folder.exists() else []


def start(mode: str, folder: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def ready(child: subprocess.Popen) -> list[str]:
    """What the worker says once it is ready (blocks until it says it, or ends)."""
    waited, _, _ = select.select([child.stdout], [], [], 300)  # a bound for a hung worker, not a timing
    line = child.stdout.readline() if waited else ""
    if not line.startswith("ready"):
        child.kill()
        out, err = child.communicate()
        pytest.fail(f"the worker did not get ready:\n{line}{out}\n{err[-4000:]}")
    return line.split()[1:]


@pytest.mark.slow
def test_a_process_killed_while_it_caches_to_disk_leaves_no_file(tmp_path):
    folder = tmp_path / "cache"
    child = start("kill", folder, TMPDIR=str(tmp_path))
    pid, fd, path = ready(child)
    assert Path(path).parent == folder
    if os.path.isdir(f"/proc/{pid}/fd"):  # Linux: the rows live in a file the process holds, nameless
        assert os.readlink(f"/proc/{pid}/fd/{fd}") == f"{path} (deleted)"
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert leftovers(folder) == []


@pytest.mark.slow
def test_a_normal_exit_without_close_leaves_no_file_in_the_temporary_folder(tmp_path):
    child = start("exit", tmp_path, TMPDIR=str(tmp_path))
    (directory,) = ready(child)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-4000:]
    assert directory == str(tmp_path)  # the default folder is the system's temporary one
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_where_an_open_file_cannot_be_unlinked_it_is_removed_at_exit(tmp_path):
    child = start("named", tmp_path)
    (path,) = ready(child)
    assert os.path.exists(path) and leftovers(tmp_path) == [Path(path).name]
    _, err = child.communicate("exit\n", timeout=300)
    assert child.returncode == 0, err[-4000:]
    assert leftovers(tmp_path) == []


def test_a_disk_table_has_no_name_in_its_folder_while_it_holds_rows(tmp_path, caplog):
    folder = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="egeria"):
        eg = train(str(folder), stop=rows_on_disk)
    tables = disk_tables(eg)
    assert tables and all(t.written.any() for t in tables)
    assert os.listdir(folder) == []
    for table in tables:
        assert table.unlinked and table.folder == str(folder)
        info = os.fstat(table.fd)
        assert info.st_nlink == 0 and info.st_size > 0
    assert eg.cache_stats["directory"] == str(folder)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "activation cache for" in r.getMessage()]
    assert len(said) == 1 and f"disk in {folder}" in said[0], said
    eg.close()


def test_closing_a_table_that_kept_its_name_removes_the_file(tmp_path, monkeypatch):
    real = os.unlink
    refused = []

    def refuse_once(path, *args, **kwargs):  # as on Windows, for the unlink right after creation
        if not refused:
            refused.append(path)
            raise PermissionError(13, "in use", path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", refuse_once)
    table = DiskTable(8, (4,), torch.float32, directory=str(tmp_path))
    table.write([1], torch.ones(1, 4))
    assert not table.unlinked and refused == [table.path] and os.path.exists(table.path)
    torch.testing.assert_close(table.read([1]), torch.ones(1, 4))
    table.close()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("free,chosen", [(NEED, True), (NEED - 1, False)])
def test_the_disk_tier_is_chosen_only_where_its_folder_has_room(tmp_path, monkeypatch, caplog, free, chosen):
    folder = tmp_path / "cache"
    real = shutil.disk_usage
    asked = []

    def usage(path):
        asked.append(str(path))
        return real(path)._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    # two levels (one module frozen at step 3, two at step 9): a refusal warns once
    with caplog.at_level(logging.INFO, logger="egeria"):
        eg = train(str(folder), plan={3: 1, 9: 2}, epochs=2)
    stats = eg.cache_stats
    eg.close()
    assert asked and set(asked) == {str(folder)}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    levels = list(stats["levels"].values())
    assert len(levels) == 2, levels
    if chosen:
        assert all(level["tier"] == "disk" and level["off"] is None for level in levels), levels
        assert not warnings, warnings
        return
    assert all(level["tier"] is None and "free" in level["off"] for level in levels), levels
    assert stats["served"] == 0 and os.listdir(folder) == []
    assert len(warnings) == 1, warnings
    assert str(folder) in warnings[0]
    assert f"{NEED:,} bytes" in warnings[0] and f"{NEED - 1:,} bytes" in warnings[0]
