"""A restart changes nothing (issue 74, item 4): a torchrun job of 2 gloo ranks, one rank
killed with SIGKILL mid-run and the job resumed by ``--max-restarts=1`` from its newest
checkpoint, makes the same freezes at the same steps as the uninterrupted job, ends on
the same weights bit for bit, and loses no checkpoint.

The job is ``tests/helpers/restart_worker.py`` (Egeria's default rule with the inline
executor and a pinned ``eval_interval``, so its decisions are a function of the run). Where
it is killed is chosen from the uninterrupted job's own freezes, so that a freeze is decided
after the resume (the controller's restored state decides it), or so that the resume
restores a frozen prefix; the tests read nothing of the clock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import egeria
import restart_worker as worker
from tiny import Chain

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

STEPS, EVERY, INTERVAL = 200, 20, 5
ALL_CHECKPOINTS = [f"step-{s:06d}" for s in range(EVERY, STEPS + 1, EVERY)]


def _torchrun(out: Path, kill: str | None = None) -> subprocess.CompletedProcess:
    """The job under torchrun on loopback (a free port the rendezvous picks), this
    egeria on its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = [str(Path(egeria.__file__).resolve().parents[1]), str(Path(worker.__file__).parent)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    # torch 2.4+ shares torchrun's rendezvous store with the workers and keeps it across
    # restarts: the restarted ranks' gloo group reads the killed attempt's addresses and hangs
    # (pytorch/pytorch#135712). Rank 0 hosts a fresh store each attempt instead.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1",
        worker.__file__, "--out", str(out), "--steps", str(STEPS), "--every", str(EVERY), "--interval", str(INTERVAL),
    ]
    if kill is not None:
        cmd += ["--kill", kill]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def _finished(out: Path, proc: subprocess.CompletedProcess) -> list[dict]:
    """Both ranks' results; the job's output in the failure where it did not end well."""
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]


def _attempts(out: Path) -> list[tuple[int, int, str | None]]:
    rows = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    return sorted((r["attempt"], r["rank"], r["resumed_from"]) for r in rows)


def _freezes(events: list[dict]) -> list[tuple[int, str, list[str]]]:
    return [(e["step"], e["action"], e["modules"]) for e in events if e["action"] != "guided"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    zero, one = _finished(out, _torchrun(out))
    assert _attempts(out) == [(0, 0, None), (0, 1, None)]
    freezes = _freezes(zero["events"])
    # The default rule freezes on this job: else the comparisons below compare nothing.
    assert [f for f in freezes if f[1] == "freeze"], zero["events"]
    # Rank 0 decides, both apply (rank 1 records no "guided" event and names rank 0 in the reasons).
    assert _freezes(one["events"]) == freezes and zero["frozen"] == one["frozen"] != []
    assert zero["params"] == one["params"]  # replicas agree (BatchNorm statistics are each rank's own)
    assert zero["checkpoints"] == ALL_CHECKPOINTS
    return {"out": out, "result": zero, "freezes": [f[0] for f in freezes if f[1] == "freeze"]}


def _resumed_equals_uninterrupted(out: Path, kill: str, resumed_from: int, uninterrupted: dict) -> None:
    proc = _torchrun(out, kill)
    zero, one = _finished(out, proc)  # exit status 0: the job ended well after the restart
    expected = uninterrupted["result"]
    # One restart (torchrun's attempt 1), both ranks resumed from the newest complete checkpoint.
    start = f"step-{resumed_from:06d}"
    assert _attempts(out) == [(0, 0, None), (0, 1, None), (1, 0, start), (1, 1, start)]
    # The same decisions at the same steps, and the same final weights, bit for bit.
    assert _freezes(zero["events"]) == _freezes(expected["events"])
    assert zero["events"] == expected["events"]  # reasons and evaluation steps too
    assert _freezes(one["events"]) == _freezes(expected["events"])
    assert zero["frozen"] == expected["frozen"]
    assert zero["digest"] == expected["digest"]
    assert zero["params"] == one["params"] == expected["params"]
    # No checkpoint lost: every folder is there, and each equals the uninterrupted job's.
    assert zero["checkpoints"] == ALL_CHECKPOINTS
    for name in ALL_CHECKPOINTS:
        _assert_same_checkpoint(out / "ckpt" / name, uninterrupted["out"] / "ckpt" / name)


def _assert_same_checkpoint(folder: Path, twin: Path) -> None:
    """``folder`` loads whole (the model, optimizer and scheduler, then Egeria) and holds
    what the uninterrupted job's checkpoint of that step holds."""
    model, _, opt, sched = _plain(folder)
    eg = egeria.Egeria(model, opt, config=worker.config(INTERVAL), lr_scheduler=sched, total_steps=STEPS)
    eg.load(folder)
    step = worker.step_of(folder)
    assert eg.steps == step
    mine, theirs = (torch.load(f / "train.pt", weights_only=True) for f in (folder, twin))
    assert mine["step"] == theirs["step"] == step
    for key, tensor in theirs["model"].items():
        assert torch.equal(mine["model"][key], tensor), (folder.name, key)
    assert mine["scheduler"] == theirs["scheduler"]
    twin_model, _, twin_opt, _ = _plain(twin)
    twin_eg = egeria.Egeria(twin_model, twin_opt, config=worker.config(INTERVAL), total_steps=STEPS)
    twin_eg.load(twin)
    assert [d.to_dict() for d in eg.events] == [d.to_dict() for d in twin_eg.events]
    assert eg.frozen == twin_eg.frozen
    eg.close()
    twin_eg.close()


def _plain(folder: Path):
    """A fresh model, optimizer and scheduler (no process group) with ``folder``'s state."""
    model = Chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[STEPS // 2, 3 * STEPS // 4], gamma=0.1)
    worker.load(folder, model, opt, sched)
    return model, None, opt, sched


def test_a_rank_killed_mid_step_resumes_into_the_same_freezes_at_the_same_steps(uninterrupted, tmp_path):
    # Resume from the last checkpoint before the last freeze: that freeze is decided after
    # the restart, from the controller's restored state. Rank 1 dies halfway to the next one.
    resumed_from = EVERY * ((uninterrupted["freezes"][-1] - 1) // EVERY)
    assert resumed_from >= EVERY, uninterrupted["freezes"]
    kill_at = resumed_from + EVERY // 2
    _resumed_equals_uninterrupted(tmp_path, f"1:{kill_at}", resumed_from, uninterrupted)


def test_a_rank_killed_while_saving_loses_no_checkpoint_and_resumes_frozen(uninterrupted, tmp_path):
    # Resume from the first checkpoint after the first freeze (a frozen prefix restored):
    # rank 0 dies while writing the next one, before its rename, so that one is redone.
    resumed_from = EVERY * -(-uninterrupted["freezes"][0] // EVERY)
    assert resumed_from + EVERY <= STEPS, uninterrupted["freezes"]
    kill_at = resumed_from + EVERY
    _resumed_equals_uninterrupted(tmp_path, f"0:{kill_at}:save", resumed_from, uninterrupted)
    assert not [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(worker.TEMPORARY)]
