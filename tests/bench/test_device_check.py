"""benchmarks/device_check.py on the CPU, as a smoke test of the script a GPU machine runs
(its figures are only taken on an accelerator)."""

from __future__ import annotations

import json

import pytest

from scripts import load_script


def _module():
    return load_script("benchmarks/device_check.py")


@pytest.mark.slow
def test_every_arm_trains_the_same_model_on_the_same_batches_and_the_report_holds_the_table(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert _module().main(["--device", "cpu", "--steps", "6", "--quick", "--no-amp", "--fsdp-steps", "3",
                           "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["amp"] == "fp32" and report["steps"] == 6 and report["machine"]["device"] == "cpu"
    assert set(report["tasks"]) == {"resnet-20", "transformer-6"}
    for name, task in report["tasks"].items():
        arms = task["arms"]
        assert [a["arm"] for a in arms] == ["plain", "egeria", "egeria-cache"], name
        # the same seed and batches: the first step's loss is the same in every arm
        assert len({a["first_loss"] for a in arms}) == 1, name
        assert arms[0]["speedup"] == 1.0
        assert all(a["metric"] is not None and a["train_s"] > 0 for a in arms)
        assert arms[1]["controller"]["modules"], name  # Egeria split the model
        assert all(a["error"] is None and a["max_loss_gap_before_first_freeze"] == 0.0 for a in arms), name
    fsdp2 = report["fsdp2"]
    assert fsdp2["steps"] == 3 and fsdp2["world_size"] == 1
    assert [a["arm"] for a in fsdp2["arms"]] == ["plain", "egeria"]
    assert all(a["error"] is None and a["median_step_s"] > 0 for a in fsdp2["arms"])
    assert fsdp2["arms"][1]["controller"]["modules"]  # Egeria's rule runs on the sharded model
    assert fsdp2["arms"][1]["max_loss_gap_before_first_freeze"] == 0.0
    printed = capsys.readouterr().out
    assert printed.startswith("PYTHONPATH=src python3 benchmarks/device_check.py --device cpu")
    assert "resnet-20" in printed and "FSDP2 (transformer-6, 3 steps)" in printed


@pytest.mark.slow
def test_an_arm_that_fails_is_reported_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    module = _module()

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(module.egeria, "Egeria", broken)
    out = tmp_path / "check.json"
    assert module.main(["--device", "cpu", "--steps", "4", "--quick", "--no-amp", "--arms", "plain,egeria",
                        "--fsdp-steps", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for arms in [task["arms"] for task in report["tasks"].values()] + [report["fsdp2"]["arms"]]:
        plain, failed = arms
        assert plain["error"] is None and plain["speedup"] == 1.0 and plain["metric"] is not None
        assert failed["error"] == "RuntimeError: no such kernel" and failed["speedup"] is None
    assert "FAILED: RuntimeError: no such kernel" in capsys.readouterr().out


def test_arms_must_start_with_plain(tmp_path):
    with pytest.raises(SystemExit):
        _module().main(["--arms", "egeria", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow
def test_the_smartfrz_arm_trains_its_policy_beside_plain(tmp_path):
    out = tmp_path / "check.json"
    assert _module().main(["--device", "cpu", "--steps", "6", "--quick", "--no-amp", "--arms", "plain,smartfrz",
                           "--fsdp-steps", "2", "--out", str(out)]) == 0
    for name, task in json.loads(out.read_text())["tasks"].items():
        plain, smartfrz = task["arms"]
        assert smartfrz["arm"] == "smartfrz" and smartfrz["error"] is None, name
        assert smartfrz["first_loss"] == plain["first_loss"] and smartfrz["metric"] is not None, name
        assert smartfrz["controller"]["modules"], name  # the policy split the model
