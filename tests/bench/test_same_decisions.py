"""benchmarks/same_decisions.py: each run of its matrix trains the layout it names."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import egeria.bench.demo as demo

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("same_decisions", ROOT / "benchmarks" / "same_decisions.py")
same_decisions = importlib.util.module_from_spec(spec)
spec.loader.exec_module(same_decisions)


def _fake_demo(monkeypatch, layouts: list, fail: bool = False) -> None:
    """The demo's preparation and training replaced by stubs that record the layout of the
    model ``_setup`` gives (no data, no training)."""
    monkeypatch.setattr(demo, "_setup", lambda *args: (torch.nn.Conv2d(3, 4, 3), None, None))
    monkeypatch.setattr(demo, "prepare", lambda s, seed: SimpleNamespace(initial=None, train=None, test=None,
                                                                         milestones=(), total_steps=1))

    def train(*args):
        model, _, _ = demo._setup()
        layouts.append(model.weight.is_contiguous(memory_format=torch.channels_last)
                       and not model.weight.is_contiguous())
        if fail:
            raise RuntimeError("a run that fails")
        return {"losses": [], "epochs": []}, {"events": [], "history": []}

    monkeypatch.setattr(demo, "_train", train)


def test_a_run_after_a_channels_last_one_trains_in_the_default_layout(monkeypatch):
    layouts: list[bool] = []
    _fake_demo(monkeypatch, layouts)
    for channels_last in (False, True, False, True, False):
        same_decisions.run_arm(0, {}, channels_last)
    assert layouts == [False, True, False, True, False]


def test_a_channels_last_run_that_fails_leaves_the_demo_as_it_was(monkeypatch):
    layouts: list[bool] = []
    _fake_demo(monkeypatch, layouts, fail=True)
    with pytest.raises(RuntimeError, match="a run that fails"):
        same_decisions.run_arm(0, {}, True)
    _fake_demo(monkeypatch, layouts)
    same_decisions.run_arm(0, {}, False)
    assert layouts == [True, False]
