"""Every example script runs end to end in its quick mode, on Egeria's defaults, as its
docstring says (examples drift when nothing runs them: they broke once unnoticed)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# What each test below runs; an example missing here fails test_every_example_is_run.
RUN = {"plain_loop.py", "ddp.py", "fsdp2_lm.py", "hf_trainer.py", "lightning_fmnist.py"}


def _run(script: str, *args: str, launcher: tuple[str, ...] = ()) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, *launcher, str(EXAMPLES / script), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_every_example_is_run_here_and_none_sets_the_rule_by_hand() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == RUN
    for name in RUN:
        tree = ast.parse((EXAMPLES / name).read_text())
        assert "--quick" in ast.get_docstring(tree), f"{name}'s docstring does not show its quick mode"
        # On the defaults: no EgeriaConfig with hand-set fields, no other policy or rule.
        configs = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and getattr(node.func, "attr", getattr(node.func, "id", None)) == "EgeriaConfig"]
        assert all(not c.args and not c.keywords for c in configs), f"{name} sets EgeriaConfig fields"
        text = (EXAMPLES / name).read_text()
        assert not re.search(r"\b(policy|rule|eval_interval|window)\s*=", text), f"{name} sets a rule by hand"


@pytest.mark.slow
def test_the_plain_loop_example_trains_on_the_defaults() -> None:
    out = _run("plain_loop.py", "--quick")
    assert "one-cycle schedule" in out and "epoch 3: test accuracy" in out
    assert re.search(r"Egeria counted (\d+) optimizer steps of \1;", out), out[-1000:]


@pytest.mark.slow
def test_the_ddp_example_trains_on_two_ranks_with_identical_replicas() -> None:
    out = _run("ddp.py", "--quick", launcher=("-m", "torch.distributed.run", "--nproc_per_node", "2"))
    assert "2 ranks" in out and "warm-up then cosine" in out
    assert re.search(r"Egeria counted (\d+) optimizer steps of \1;", out), out[-1000:]
    assert "weights identical on 2 of 2 ranks" in out


@pytest.mark.slow
def test_the_hf_trainer_example_trains_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    out = _run("hf_trainer.py", "--quick", "--out", str(tmp_path))
    # Whether and when the front freezes rests on float readings, which differ between CPUs.
    assert "Egeria counted 160 optimizer steps; the Trainer 160" in out
    assert "resumed run ended at step 160" in out


@pytest.mark.slow
def test_the_lightning_example_trains_and_resumes(tmp_path):
    pytest.importorskip("lightning")
    out = _run("lightning_fmnist.py", "--quick", "--resume", "--out", str(tmp_path))
    assert "16 optimizer steps, Egeria counted 16" in out


@pytest.mark.slow
def test_the_fsdp2_example_trains_saves_through_dcp_and_resumes(tmp_path):
    out = _run("fsdp2_lm.py", "--quick", "--out", str(tmp_path))
    saved = re.search(r"resumed at step 30 with (\[.*\]) frozen \(saved: (\[.*\])\)", out)
    assert saved and saved[1] == saved[2], out[-1000:]
    assert "ended at step 40" in out
