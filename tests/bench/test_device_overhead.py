"""benchmarks/device_overhead.py on the CPU, as a smoke test of the script a GPU machine
runs (its figures are only taken on an accelerator)."""

from __future__ import annotations

import json

import pytest

from scripts import load_script


def _module():
    return load_script("benchmarks/device_overhead.py")


@pytest.mark.slow
def test_arms_in_rounds_train_the_same_batches_and_each_is_set_against_its_rounds_plain(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    arms = "plain,none,inline,on-device"  # the process arms start a controller process: not in a unit test
    assert _module().main(["--device", "cpu", "--quick", "--no-amp", "--steps", "5", "--rounds", "2",
                           "--arms", arms, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["arm"], r["round"]) for r in report["runs"]] == [(a, k) for k in (0, 1) for a in arms.split(",")]
    assert all(len(r["step_s"]) == 5 for r in report["runs"])
    # the learning rate stays at its peak and nothing freezes: every arm trains as plain does
    assert len({r["final_loss"] for r in report["runs"]}) == 1
    for row in report["rows"]:
        plain = next(r for r in report["rows"] if r["arm"] == "plain" and r["round"] == row["round"])
        assert row["speedup"] == pytest.approx(plain["train_s"] / row["train_s"])
    assert out.with_suffix(".png").is_file()
    assert "nothing frozen" in capsys.readouterr().out


def test_arms_must_start_with_plain_and_be_known(tmp_path):
    for arms in ("none,plain", "plain,fast"):
        with pytest.raises(SystemExit):
            _module().main(["--arms", arms, "--out", str(tmp_path / "x.json")])
