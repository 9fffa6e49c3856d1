"""The example scripts run end to end as their docstrings say (they broke once unnoticed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow
def test_the_hf_trainer_example_trains_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    out = _run("hf_trainer.py", "--out", str(tmp_path))
    # Whether and when the front freezes rests on float readings, which differ between CPUs.
    assert "Egeria counted 160 optimizer steps; the Trainer 160" in out
    assert "resumed run ended at step 160" in out


@pytest.mark.slow
def test_the_lightning_example_trains_and_resumes(tmp_path):
    pytest.importorskip("lightning")
    out = _run("lightning_fmnist.py", "--train", "512", "--epochs", "2", "--resume", "--out", str(tmp_path))
    assert "16 optimizer steps, Egeria counted 16" in out


@pytest.mark.slow
def test_the_fsdp2_example_trains_saves_through_dcp_and_resumes(tmp_path):
    out = _run("fsdp2_lm.py", "--steps", "8", "--out", str(tmp_path))
    assert "resumed at step 6 with ['embed..layers.0', 'layers.1'] frozen (saved: ['embed..layers.0', 'layers.1'])" in out
    assert "ended at step 8" in out
