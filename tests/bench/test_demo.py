"""The demo and the ``egeria`` CLI: a quick run writes a plot and a JSON holding both runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import egeria.bench.allocator as allocator
from egeria.cli import build_parser, main
from needs_data import needs_fmnist

pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")


def test_cli_parses_demo_arguments() -> None:
    args = build_parser().parse_args(["demo", "--quick", "--out", "somewhere", "--seed", "3"])
    assert (args.command, args.quick, args.out, args.seed) == ("demo", True, "somewhere", 3)
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_the_demo_device_is_parsed_and_a_bad_or_absent_one_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from egeria.bench import demo

    assert build_parser().parse_args(["demo"]).device == "cpu"
    assert build_parser().parse_args(["demo", "--device", "cuda"]).device == "cuda"
    with pytest.raises(ValueError, match=r"demo device='gpu0': not a torch device"):
        demo.run_demo(tmp_path, settings=demo.DemoSettings(device="gpu0"), stream=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"demo device='cuda': this machine's torch sees no CUDA device"):
        demo.run_demo(tmp_path, settings=demo.DemoSettings(device="cuda"), stream=None)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize("command", [["demo", "--quick"], ["bench", "resnet-fmnist"]])
def test_demo_and_bench_without_the_bench_extra_name_it(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import egeria.bench

    monkeypatch.setattr(egeria.bench, "EXTRA", ("tqdm", "egeria_no_such_module"))
    assert main(command) == 2
    err = capsys.readouterr().err
    assert f"egeria {command[0]} needs egeria_no_such_module (the bench extra)" in err
    assert "pip install -e '.[bench]' in egeria's clone" in err


@pytest.mark.slow
@needs_fmnist
def test_quick_demo_via_cli_writes_png_and_json_with_every_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--quick", "--no-progress", "--out", str(tmp_path)]) == 0

    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "demo.json").read_text())
    assert set(result["runs"]) == {"plain", "egeria", "fast"}
    assert result["egeria_config"]["speed"] == "safe" and result["fast_config"]["speed"] == "fast"
    for name, run in result["runs"].items():
        accuracies = [e["test_accuracy"] for e in run["epochs"]]
        assert len(accuracies) == result["settings"]["epochs"], name
        assert all(math.isfinite(a) and 0.0 <= a <= 1.0 for a in accuracies), (name, accuracies)
        assert math.isfinite(run["final_accuracy"]) and run["train_time_s"] > 0, name
        assert len(run["losses"]) == result["total_steps"], name
        # Each run's process fixed its heap (where the C library is glibc).
        assert run["heap"] == ("steady" if allocator.can_fix_heap() else "default"), name
    # Accuracy between epochs on the first eval_limit test images, the final one on all test_limit.
    assert result["settings"]["eval_limit"] < result["settings"]["test_limit"]
    assert all("full_test_accuracy" not in e for run in result["runs"].values() for e in run["epochs"][:-1])
    assert all(run["epochs"][-1]["full_test_accuracy"] == run["final_accuracy"] for run in result["runs"].values())
    # The target is where plain's curve made 99% of its gain, and plain reaches it.
    plain = [e["test_accuracy"] for e in result["runs"]["plain"]["epochs"]]
    assert result["summary"]["target_accuracy"] == pytest.approx(max(plain) - 0.01 * (max(plain) - plain[0]))
    assert result["summary"]["time_to_target_s"]["plain"] is not None
    # Same initial weights and batch order: identical until each Egeria run's first freeze.
    for summary in (result["summary"], result["summary"]["fast"]):
        first_freeze = summary["first_freeze_step"]
        identical = summary["identical_losses_through_step"]
        assert identical >= first_freeze if first_freeze is not None else identical == result["total_steps"]

    # What training holds beyond the weights at the end: a gradient per parameter still
    # training and the optimizer's state (SGD's momentum); Egeria releases a frozen module's.
    model_bytes = result["runs"]["plain"]["memory"]["gradients"]
    assert result["runs"]["plain"]["memory"]["optimizer_state"] == model_bytes > 0  # one momentum buffer each
    for name in ("egeria", "fast"):
        memory, frozen = result["runs"][name]["memory"], result["runs"][name]["frozen_at_end"]
        assert (memory["gradients"] < model_bytes) == bool(frozen), name
        assert memory["optimizer_state"] == memory["gradients"], name

    out = capsys.readouterr().out
    assert out.startswith("command: egeria demo --quick")
    assert "gradients + optimizer state at the end" in out
    assert "machine: " in out and "final test accuracy" in out
    assert "Egeria (default)" in out and "Egeria speed='fast'" in out and "wall-time speedup" in out
    assert "(99% of plain's gain)" in out and "MLPerf-style target" in out and "final test accuracy (500 images)" in out


def test_the_demo_target_is_where_plain_made_99_percent_of_its_gain() -> None:
    from egeria.bench.demo import demo_target

    epochs = [{"step": 100, "test_accuracy": 0.60}, {"step": 200, "test_accuracy": 0.90},
              {"step": 300, "test_accuracy": 0.88}, {"step": 400, "test_accuracy": 0.70}]
    # best so far 0.60, 0.90, 0.90, 0.90: 99% of the gain of 0.30 is 0.897
    assert demo_target(epochs) == pytest.approx(0.897)


def test_an_evaluation_subset_larger_than_the_test_set_is_refused(tmp_path: Path) -> None:
    from egeria.bench import demo

    with pytest.raises(ValueError, match=r"demo eval_limit=600: at most test_limit=500"):
        demo.run_demo(tmp_path, settings=demo.DemoSettings(test_limit=500, eval_limit=600), stream=None)
