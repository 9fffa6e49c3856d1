"""What a checkpoint folder's files go through: a save touches only its own files, saves
into one folder follow each other, and a reader opens only a plain file inside the folder."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading

import pytest
import torch

from egeria.checkpoint.serialization import STATE_FILE, encode_tensor, read_state, saved_steps, write_state


def _state(i: int) -> dict:
    return {"steps": i, "reference": encode_tensor(torch.full((3, 2), float(i)))}


def _tensor_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("egeria-") and p.name.endswith(".pt"))


def _check_loads(folder, expected_steps: set[int]) -> None:
    state = read_state(folder)
    assert state["steps"] in expected_steps
    assert state["reference"] == encode_tensor(torch.full((3, 2), float(state["steps"])))  # its own tensors


def test_a_users_files_beside_the_checkpoint_are_kept(tmp_path):
    mine = {"egeria-best.pt": b"the user's best model", "egeria-0123456789ab.pt.bak": b"a backup",
            ".egeria.json.bak": b"not a temporary file of a save"}
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    for i in range(4):
        write_state(_state(i), tmp_path)
    for name, data in mine.items():
        assert (tmp_path / name).read_bytes() == data
    named = json.loads((tmp_path / STATE_FILE).read_text())["tensors_file"]
    assert [f for f in _tensor_files(tmp_path) if f not in mine] == [named]  # the earlier saves' files went
    assert read_state(tmp_path)["steps"] == 3


def test_a_failed_saves_temporary_files_are_removed_by_the_next(tmp_path):
    write_state(_state(0), tmp_path)
    leftovers = [".egeria.json.k2j3h4.tmp", ".egeria-0123456789ab.pt.x9y8z7.tmp"]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"half written")
    write_state(_state(1), tmp_path)
    assert not any((tmp_path / name).exists() for name in leftovers)


def _save_many(folder: str, start: int, count: int) -> None:
    for i in range(start, start + count):
        write_state(_state(i), folder)


def test_threads_saving_into_one_folder_leave_the_last_complete_save(tmp_path):
    errors: list[BaseException] = []

    def saver(start: int) -> None:
        try:
            _save_many(str(tmp_path), start, 30)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    def reader() -> None:
        try:
            for _ in range(30):
                if (tmp_path / STATE_FILE).exists():
                    read_state(tmp_path)  # never a JSON naming a removed tensor file
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=saver, args=(s,)) for s in (0, 100)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    _check_loads(tmp_path, {29, 129})
    assert len(_tensor_files(tmp_path)) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_processes_saving_into_one_folder_leave_the_last_complete_save(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_save_many, args=(str(tmp_path), s, 20)) for s in (0, 100)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    _check_loads(tmp_path, {19, 119})
    assert len(_tensor_files(tmp_path)) == 1


def _point_at(folder, name: str) -> None:
    saved = json.loads((folder / STATE_FILE).read_text())
    saved["tensors_file"] = name
    (folder / STATE_FILE).write_text(json.dumps(saved))


@pytest.mark.parametrize("name", ["/etc/passwd", "../egeria-0123456789ab.pt", "sub/egeria-0123456789ab.pt", 7, None,
                                  "egeria-0123456789ab.pt\x00", "egeria-best.pt"])
def test_a_tensor_file_outside_the_pattern_or_folder_is_refused(tmp_path, name):
    write_state(_state(1), tmp_path)
    _point_at(tmp_path, name)
    with pytest.raises(ValueError, match="tensor file"):
        read_state(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX")
@pytest.mark.parametrize("kind", ["fifo", "folder", "link"])
def test_a_tensor_file_that_is_not_a_plain_file_is_refused_without_opening_it(tmp_path, kind):
    write_state(_state(1), tmp_path)
    name = "egeria-ffffffffffff.pt"
    if kind == "fifo":
        os.mkfifo(tmp_path / name)  # opening it would wait forever for a writer
    elif kind == "folder":
        (tmp_path / name).mkdir()
    else:
        os.symlink("/etc/passwd", tmp_path / name)
    _point_at(tmp_path, name)
    with pytest.raises(ValueError, match="not a plain file"):
        read_state(tmp_path)


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,
    '{"state": {"steps": ' + "9" * 40 + "}}",
    '{"state": {"steps": true}}',
    '{"state": {"steps": "5"}}',
    '{"state": {"steps": -1}}',
    '{"state": {"steps": 1e400}}',
    '{"state": []}',
    '{"state": {}}',
    "\x00\xff not json",
    "",
])
def test_saved_steps_answers_none_for_anything_it_cannot_read(tmp_path, text):
    (tmp_path / STATE_FILE).write_text(text)
    assert saved_steps(tmp_path) is None


def test_saved_steps_reads_a_good_state(tmp_path):
    write_state(_state(12), tmp_path)
    assert saved_steps(tmp_path) == 12
    assert saved_steps(tmp_path / "missing") is None
