"""A script without the ``if __name__ == "__main__":`` guard trains once: the spawned controller
process that re-runs it stops at ``Egeria(...)`` with an exit code the trainer reads, and the
trainer warns once and runs the controller in a thread."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import egeria
from egeria.knowledge.mainguard import CONTROLLER_NAME, GUARD_EXIT
import tiny
from tiny import Chain

HELPERS = Path(tiny.__file__).resolve().parent  # the scripts import tiny from there
GUARD = 'if __name__ == "__main__":'

# A script as a user writes it without the guard. It records the controller processes it
# starts, trains until the trainer has replaced its controller (an event, not a time), and
# says what became of them.
SCRIPT = """
import logging, multiprocessing, sys
sys.path.insert(0, {helpers!r})
import torch, egeria
import egeria.knowledge.executors as executors
from tiny import Chain, batches, quick_config, train

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
started = []
_init = executors.ProcessExecutor.__init__


def recorded(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    started.append(self.process)


executors.ProcessExecutor.__init__ = recorded
model = Chain()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
eg = egeria.Egeria(model, opt, config=quick_config(executor="process", start_method="spawn"))
print("TRAINING STARTS", flush=True)
train(model, opt, eg, batches(1) * 2)
{until}
eg.close()
print("CONTROLLERS", " ".join(f"{{p.pid}}:{{p.exitcode}}" for p in started), flush=True)
print("FALLBACKS", len(eg.controller_stats["fallbacks"]), flush=True)
print("ACTIVE CHILDREN", len(multiprocessing.active_children()), flush=True)
print("RUN COMPLETED", flush=True)
"""

# trains on; each step boundary polls the controller, so the first one after its exit sees it
TRAIN_UNTIL_REPLACED = """
while not eg.controller_stats["fallbacks"] and eg.controller_stats["failure"] is None:
    train(model, opt, eg, batches(1) * 5)
"""
# waits for the controller process to end without a step boundary in between: close() says why
WAIT_THEN_CLOSE = """
started[0].join()
"""


def run_script(tmp_path: Path, until: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train_without_guard.py"
    script.write_text(textwrap.dedent(SCRIPT).format(helpers=str(HELPERS), until=until.strip()))
    assert GUARD not in script.read_text()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a bound for a hung run, not a timing: the script waits for events only
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def check_trained_once(done: subprocess.CompletedProcess) -> list[str]:
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert done.stdout.count("TRAINING STARTS") == 1, done.stdout  # the spawned process did not train
    assert out.count(GUARD) == 1, out[-4000:]  # one warning, from the trainer
    assert "RUN COMPLETED" in done.stdout
    assert "ACTIVE CHILDREN 0" in done.stdout
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith("CONTROLLERS"))
    controllers = lines["CONTROLLERS"].split()
    assert [c.split(":")[1] for c in controllers] == [str(GUARD_EXIT)], controllers  # one started; it exited so
    for c in controllers:
        pid = int(c.split(":")[0])
        if os.path.isdir("/proc"):
            assert not _alive(pid)
    return [line for line in done.stderr.splitlines() if GUARD in line]


@pytest.mark.slow
def test_a_script_without_the_guard_trains_once_and_is_told_the_fix(tmp_path):
    done = run_script(tmp_path, TRAIN_UNTIL_REPLACED)
    (warning,) = check_trained_once(done)
    assert warning.startswith("WARNING egeria.knowledge.link: Egeria: the controller's new process re-ran the script")
    assert str(tmp_path / "train_without_guard.py") in warning
    assert "the controller now runs in a thread of this process" in warning
    assert "FALLBACKS 1" in done.stdout


@pytest.mark.slow
def test_a_run_closed_before_it_saw_the_controller_end_still_says_why(tmp_path):
    done = run_script(tmp_path, WAIT_THEN_CLOSE)
    (warning,) = check_trained_once(done)
    assert warning.startswith("WARNING egeria.knowledge.executors: Egeria: the controller's new process re-ran the script")
    assert "FALLBACKS 0" in done.stdout


def _egeria() -> egeria.Egeria:
    model = Chain()
    return egeria.Egeria(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_egeria_refuses_to_start_in_a_process_that_re_runs_the_main_script(monkeypatch):
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=r'`if __name__ == "__main__":`'):
        _egeria()


def test_the_controller_process_re_running_the_script_exits_with_the_guard_code(monkeypatch):
    class Exited(Exception):
        pass

    def exit_now(code):
        raise Exited(code)

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    monkeypatch.setattr(multiprocessing.current_process(), "name", CONTROLLER_NAME)
    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(Exited) as exited:
        _egeria()
    assert exited.value.args == (GUARD_EXIT,)


def test_egeria_starts_where_no_script_is_being_re_run():
    assert not getattr(multiprocessing.current_process(), "_inheriting", False)
    _egeria().close()
