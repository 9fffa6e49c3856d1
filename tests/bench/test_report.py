"""The benchmark report: TTA against the plain runs' worst final metric, speedups, seed noise,
layouts side by side, old-format runs, files written, and clear errors on bad input. All
runs are synthetic, built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from egeria.bench.report import NOT_REACHED, UNTIMED, build_report, load_runs
from egeria.config import EgeriaConfig

MACHINE = {"platform": "Linux-x86_64", "cpu": "test cpu", "cores": 2, "torch": "2.13.0+cpu"}
OTHER_MACHINE = {**MACHINE, "cpu": "another cpu"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(
    task: str,
    policy: str,
    seed: int,
    walls: list[float],
    metrics: list[float | None],
    total_flops: float,
    *,
    final_metric: float | None = None,
    higher_is_better: bool = True,
    shares: list[float] | None = None,
    plasticity: list[dict] | None = None,
    machine: dict = MACHINE,
    layout: str | None = None,
    backward_shares: list[float] | None = None,
) -> dict:
    """A run file with one record per (wall, metric), 10 steps apart: format 1 (no layout,
    no backward FLOPs) unless ``layout`` is given, then format 2 with ``backward_shares``
    (default all 1) of a 100-FLOP backward."""
    shares = shares or [1.0] * len(walls)
    backward_shares = backward_shares or [1.0] * len(walls)
    records = [
        {
            "step": 10 * (i + 1),
            "epoch": float(i + 1),
            "wall_time_s": w,
            "metric": m,
            "loss": 1.0,
            "frozen": [],
            "trainable_share": s,
            "flops_per_step": 1.0,
        }
        for i, (w, m, s) in enumerate(zip(walls, metrics, shares))
    ]
    final = metrics[-1] if final_metric is None else final_metric
    run = {
        "format": 1,
        "task": task,
        "policy": policy,
        "policy_options": {},
        "seed": seed,
        "epochs": len(walls),
        "command": f"egeria bench {task} --policy {policy} --seed {seed}",
        "machine": machine,
        "metric": {"name": "accuracy" if higher_is_better else "perplexity", "higher_is_better": higher_is_better},
        "modules": ["layer1", "layer2", "fc"],
        "module_params": [10, 20, 70],
        "total_params": 100,
        "steps_per_epoch": 10,
        "total_steps": 10 * len(walls),
        "records": records,
        "events": [],
        "plasticity": plasticity or [],
        "final": {"metric": final, "wall_time_s": walls[-1], "total_flops": total_flops},
    }
    if layout is None:
        return run
    for rec, b in zip(records, backward_shares):
        rec["backward_flops_per_step"], rec["backward_share"] = 100.0 * b, b
    run["final"]["total_backward_flops"] = 10 * 100.0 * sum(backward_shares)
    controller = [1] if layout == "accel" else None
    threads = 1 if layout == "accel" else 2
    cpus = [0] if layout == "accel" else [0, 1]
    run["layout"] = {"name": layout, "train_cpus": cpus, "torch_threads": threads, "controller_cpus": controller}
    return {**run, "format": 2}


#: Memory rows of a run (egeria.memory): before and after its front froze at step 20.
MEMORY = [
    {"step": s, "frozen": f, "parameters": 400, "gradients": g, "optimizer_state": o, "optimizer_state_released": r,
     "activations": a, "activation_cache": 0, "activation_cache_disk": 0}
    for s, f, g, o, r, a in [(1, 0, 400, 800, 0, 1000), (20, 0, 400, 800, 0, 1000), (21, 1, 300, 600, 200, None)]
]


def _suite() -> list[dict]:
    acc = "resnet-fmnist"
    ppl = "transformer-ptb"
    plasticity = [
        {"step": s, "module": m, "plasticity": v, "smoothed": v, "slope": None, "tolerance": None, "stale": 0}
        for s, m, v in [(10, "layer1", 0.5), (20, "layer1", 0.05), (30, "layer1", 0.0),
                        (10, "layer2", 0.8), (20, "layer2", 0.4), (30, "layer2", 0.2)]
    ]  # fmt: skip
    return [
        # Plain, seed 0: the reference; converged (final) accuracy 0.90, first reached at 40 s.
        _run(acc, "none", 0, [10, 20, 30, 40], [0.5, 0.7, 0.85, 0.90], 1000.0),
        # Plain, seed 1: final 0.88, so the seed-to-seed spread is 0.02.
        _run(acc, "none", 1, [11, 22, 33, 44], [0.5, 0.7, 0.84, 0.88], 1000.0),
        # Egeria reaches 0.90 first at 24 s (0.91), then ends at 0.905: within seed noise.
        {**_run(acc, "egeria", 0, [8, 16, 24, 32], [0.5, 0.72, 0.91, 0.905], 800.0,
                shares=[1.0, 0.9, 0.7, 0.3], plasticity=plasticity), "memory": MEMORY},  # fmt: skip
        # FreezeOut never reaches 0.90 (0.85 final): not reached, and outside seed noise.
        _run(acc, "freezeout", 0, [6, 12, 18, 24], [0.5, None, 0.8, 0.85], 500.0, shares=[1.0, 0.8, 0.5, 0.2]),
        # Perplexity (lower is better): plain converges to 120 at 20 s; one seed only.
        _run(ppl, "none", 0, [5, 10, 15, 20], [300.0, 200.0, 150.0, 120.0], 2000.0, higher_is_better=False),
        # Egeria first gets <= 120 at 12 s (119). On another machine.
        _run(ppl, "egeria", 0, [4, 8, 12, 16], [280.0, 160.0, 119.0, 118.0], 1600.0,
             higher_is_better=False, machine=OTHER_MACHINE),  # fmt: skip
    ]


def _write(runs: list[dict], root: Path) -> Path:
    for r in runs:
        path = root / r["task"] / f"{r['policy']}-seed{r['seed']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    return root


def _row(report: dict, task: str, policy: str, seed: int, layout: str = "accel") -> dict:
    rows = [r for r in report["tasks"][task]["layouts"][layout]["rows"] if r["policy"] == policy and r["seed"] == seed]
    assert len(rows) == 1, rows
    return rows[0]


@pytest.fixture
def report(tmp_path: Path) -> tuple[dict, Path]:
    runs = load_runs([_write(_suite(), tmp_path / "runs")])
    out = tmp_path / "report"
    return build_report(runs, out), out


def test_load_runs_reads_directories_recursively(tmp_path: Path) -> None:
    root = _write(_suite(), tmp_path / "runs")
    runs = load_runs([root, root / "resnet-fmnist" / "egeria-seed0.json"])  # the file twice: read once
    assert sorted((r["task"], r["policy"], r["seed"]) for r in runs) == sorted(
        (r["task"], r["policy"], r["seed"]) for r in _suite()
    )
    assert all(Path(r["source"]).is_file() for r in runs)


def test_target_is_the_worst_final_of_the_plain_seeds(report: tuple[dict, Path]) -> None:
    rep, _ = report
    acc = rep["tasks"]["resnet-fmnist"]["layouts"]["accel"]
    assert acc["target"] == 0.88  # seed 1's 0.88, not seed 0's 0.90: every plain seed reaches it
    assert acc["reference"]["target_seed"] == 1 and acc["reference"]["seeds"] == [0, 1]
    assert acc["reference"]["tta_s"] == pytest.approx((40 + 44) / 2)
    assert rep["tasks"]["transformer-ptb"]["layouts"]["accel"]["target"] == 120.0


def test_worst_plain_final_is_the_highest_where_lower_is_better(tmp_path: Path) -> None:
    good = _run("t", "none", 0, [10, 20], [200.0, 120.0], 100.0, higher_is_better=False)
    bad = _run("t", "none", 1, [10, 20], [190.0, 125.0], 100.0, higher_is_better=False)
    data = build_report([good, bad], tmp_path, plots=False)["tasks"]["t"]["layouts"]["accel"]
    assert data["target"] == 125.0 and data["reference"]["target_seed"] == 1
    assert all(row["reached"] for row in data["rows"])


def test_tta_is_first_record_reaching_target(report: tuple[dict, Path]) -> None:
    rep, _ = report
    plain = _row(rep, "resnet-fmnist", "none", 0)
    assert plain["reached"] and plain["tta_s"] == 40 and plain["tta_step"] == 40  # 0.85 < 0.88 <= 0.90
    assert plain["tta_speedup"] == pytest.approx(42 / 40)
    plain1 = _row(rep, "resnet-fmnist", "none", 1)
    assert plain1["tta_s"] == 44  # equal counts as reached
    egeria = _row(rep, "resnet-fmnist", "egeria", 0)
    assert egeria["tta_s"] == 24 and egeria["tta_step"] == 30  # 0.91 at 24 s, not the later 0.905
    assert egeria["tta_speedup"] == pytest.approx(42 / 24)


def test_lower_is_better_metric(report: tuple[dict, Path]) -> None:
    rep, _ = report
    egeria = _row(rep, "transformer-ptb", "egeria", 0)
    assert egeria["tta_s"] == 12  # 119 <= 120; with >= it would be 4 s (280)
    assert egeria["tta_speedup"] == pytest.approx(20 / 12)
    assert egeria["ideal_speedup"] == pytest.approx(2000 / 1600)


def test_not_reached_has_no_invented_numbers(report: tuple[dict, Path]) -> None:
    rep, out = report
    row = _row(rep, "resnet-fmnist", "freezeout", 0)  # 0.85 < 0.88
    assert not row["reached"]
    assert row["tta_s"] is None and row["tta_speedup"] is None and row["efficiency"] is None
    md = (out / "report.md").read_text()
    freezeout_lines = [line for line in md.splitlines() if line.startswith("| freezeout | 0 |")]
    assert len(freezeout_lines) == 2 and all(NOT_REACHED in line for line in freezeout_lines)  # both tables
    egeria_line = next(line for line in md.splitlines() if line.startswith("| egeria | 0 | 0.905 |"))
    assert NOT_REACHED not in egeria_line and "24.0" in egeria_line and "1.75x" in egeria_line


def test_a_run_whose_times_are_unreliable_counts_for_the_target_but_not_for_times(tmp_path: Path) -> None:
    runs = _suite()
    runs[1]["timing_unreliable"] = "other work took the cores during it"  # plain seed 1 (final 0.88, 44 s)
    rep = build_report(load_runs([_write(runs, tmp_path / "runs")]), tmp_path / "report")
    task = rep["tasks"]["resnet-fmnist"]["layouts"]["accel"]
    assert task["target"] == 0.88  # its metric still sets the strict target
    plain1 = _row(rep, "resnet-fmnist", "none", 1)
    assert plain1["reached"] and plain1["tta_s"] is None and plain1["tta_speedup"] is None
    egeria = _row(rep, "resnet-fmnist", "egeria", 0)
    assert egeria["tta_speedup"] == pytest.approx(40 / 24)  # against plain seed 0's time alone, not (40 + 44) / 2
    line = next(row for row in (tmp_path / "report" / "report.md").read_text().splitlines() if row.startswith("| none | 1 |"))
    assert UNTIMED in line
    runs[1]["timing_unreliable"] = ""
    with pytest.raises(ValueError, match="timing_unreliable"):
        load_runs([_write(runs, tmp_path / "bad")])


def test_ideal_speedup_and_efficiency(report: tuple[dict, Path]) -> None:
    rep, _ = report
    egeria = _row(rep, "resnet-fmnist", "egeria", 0)
    assert egeria["ideal_speedup"] == pytest.approx(1000 / 800)
    assert egeria["efficiency"] == pytest.approx((42 / 24) / (1000 / 800))
    freezeout = _row(rep, "resnet-fmnist", "freezeout", 0)
    assert freezeout["ideal_speedup"] == pytest.approx(2.0)  # FLOPs saved even without reaching
    ptb = _row(rep, "transformer-ptb", "egeria", 0)
    assert ptb["efficiency"] == pytest.approx((20 / 12) / (2000 / 1600))


def test_seed_noise_statements(report: tuple[dict, Path]) -> None:
    rep, out = report
    acc = rep["tasks"]["resnet-fmnist"]["layouts"]["accel"]
    assert acc["seed_spread"] == pytest.approx(0.02)
    noise = {(n["policy"], n["seed"]): n for n in acc["seed_noise"]}
    assert set(noise) == {("egeria", 0), ("freezeout", 0)}  # the plain seeds are the yardstick
    # Against the plain seeds' mean final, 0.89.
    assert noise["egeria", 0]["abs_diff"] == pytest.approx(0.015) and noise["egeria", 0]["within_noise"] is True
    assert noise["freezeout", 0]["abs_diff"] == pytest.approx(0.04) and noise["freezeout", 0]["within_noise"] is False
    ptb = rep["tasks"]["transformer-ptb"]["layouts"]["accel"]
    assert ptb["seed_spread"] is None and ptb["seed_noise"][0]["within_noise"] is None

    md = (out / "report.md").read_text()
    acc_md, ptb_md = md.split("## resnet-fmnist")[1].split("## transformer-ptb")
    egeria_line = next(line for line in acc_md.splitlines() if line.startswith("- egeria seed 0"))
    assert "within seed noise" in egeria_line
    freezeout_line = next(line for line in acc_md.splitlines() if line.startswith("- freezeout seed 0"))
    assert "larger than seed noise" in freezeout_line
    assert "spread unknown" in ptb_md and "within seed noise" not in ptb_md


def test_files_written(report: tuple[dict, Path]) -> None:
    rep, out = report
    for name in ["resnet-fmnist-metric-vs-time.png", "resnet-fmnist-trainable-share.png",
                 "resnet-fmnist-plasticity.png", "transformer-ptb-metric-vs-time.png",
                 "transformer-ptb-trainable-share.png"]:  # fmt: skip
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    assert not (out / "transformer-ptb-plasticity.png").exists()  # no plasticity data there
    assert (out / "resnet-fmnist-memory.png").read_bytes()[:8] == PNG_MAGIC  # one run recorded memory
    assert not (out / "transformer-ptb-memory.png").exists()
    assert rep["tasks"]["resnet-fmnist"]["plots"]["memory"] == "resnet-fmnist-memory.png"
    md = (out / "report.md").read_text()
    assert "](resnet-fmnist-plasticity.png)" in md and "](transformer-ptb-metric-vs-time.png)" in md
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(rep))


def test_machines_reported(report: tuple[dict, Path]) -> None:
    rep, out = report
    assert len(rep["machines"]) == 2
    assert rep["tasks"]["resnet-fmnist"]["same_machine"] and not rep["tasks"]["transformer-ptb"]["same_machine"]
    md = (out / "report.md").read_text()
    assert "2 different machines" in md and "another cpu" in md


def test_runs_with_different_heaps_are_flagged(tmp_path: Path) -> None:
    runs = [r for r in _suite() if r["task"] == "resnet-fmnist"]
    rep = build_report(runs, tmp_path / "same", plots=False)
    assert all(d["heaps"] == ["default"] for d in rep["tasks"]["resnet-fmnist"]["layouts"].values())
    assert "heap thresholds" not in (tmp_path / "same" / "report.md").read_text()
    runs[0] = {**runs[0], "heap": "steady"}
    rep = build_report(runs, tmp_path / "mixed", plots=False)
    assert ["default", "steady"] in [d["heaps"] for d in rep["tasks"]["resnet-fmnist"]["layouts"].values()]
    assert "fixed their heap thresholds and some did not" in (tmp_path / "mixed" / "report.md").read_text()


def test_single_machine_line(tmp_path: Path) -> None:
    runs = [r for r in _suite() if r["task"] == "resnet-fmnist"]
    build_report(runs, tmp_path, plots=False)
    md = (tmp_path / "report.md").read_text()
    assert "Machine: platform: Linux-x86_64, cpu: test cpu, cores: 2, torch: 2.13.0+cpu." in md and "different machines" not in md


def test_final_evaluation_counts_when_records_lack_it(tmp_path: Path) -> None:
    plain = _run("t", "none", 0, [10, 20], [0.5, 0.8], 100.0, final_metric=0.9)
    late = _run("t", "egeria", 0, [8, 16], [0.5, 0.8], 80.0, final_metric=0.95)
    rep = build_report([plain, late], tmp_path, plots=False)
    assert _row(rep, "t", "none", 0)["tta_s"] == 20 and _row(rep, "t", "egeria", 0)["tta_s"] == 16


def test_rereading_output_dir_skips_report_json(tmp_path: Path) -> None:
    root = _write(_suite(), tmp_path)
    build_report(load_runs([root]), root / "report", plots=False)
    assert len(load_runs([root])) == len(_suite())


def test_other_format_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**_suite()[0], "format": 3}))
    with pytest.raises(ValueError, match=r"bad\.json.*format"):
        load_runs([bad])
    with pytest.raises(ValueError, match=r"bad\.json.*format"):  # also when found in a directory
        load_runs([tmp_path])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match=r"other\.json.*format"):  # a named file must be a run
        load_runs([other])


def test_empty_directory_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no run files"):
        load_runs([tmp_path / "empty"])
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        load_runs([tmp_path / "missing"])
    with pytest.raises(ValueError, match="no runs"):
        build_report([], tmp_path / "out")


def test_broken_and_incomplete_files_are_rejected(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": 1, ')
    with pytest.raises(ValueError, match=r"broken\.json.*not valid JSON"):
        load_runs([broken])
    partial = tmp_path / "partial.json"
    run = _suite()[0]
    del run["final"]
    partial.write_text(json.dumps(run))
    with pytest.raises(ValueError, match=r"partial\.json.*final"):
        load_runs([partial])
    no_final_metric = tmp_path / "no_final_metric.json"
    run = _suite()[0]
    run["final"]["metric"] = None
    no_final_metric.write_text(json.dumps(run))
    with pytest.raises(ValueError, match=r"no_final_metric\.json.*final\.metric must be a number"):
        load_runs([no_final_metric])


def test_duplicate_runs_are_rejected(tmp_path: Path) -> None:
    a = _write(_suite()[:1], tmp_path / "a")
    b = _write(_suite()[:1], tmp_path / "b")
    with pytest.raises(ValueError, match="two runs of policy 'none' seed 0"):
        build_report(load_runs([a, b]), tmp_path / "out", plots=False)


def test_config_changed_from_the_defaults_shows_in_the_label(tmp_path: Path) -> None:
    acc = "resnet-fmnist"
    plain = _run(acc, "none", 0, [10, 20], [0.5, 0.9], 1000.0)
    plain["config"] = {"eval_interval": 10, "policy": "none"}  # Egeria's fields do not concern a baseline
    default = _run(acc, "egeria", 0, [10, 20], [0.5, 0.9], 900.0)
    default["config"] = {"eval_interval": None, "window": 3, "rule": "egeria", "policy": "egeria"}
    tuned = _run(acc, "egeria", 0, [10, 20], [0.5, 0.88], 800.0)
    tuned["config"] = {"eval_interval": 10, "window": 3, "rule": "egeria", "policy": "egeria", "not_a_field_any_more": 1}
    cached = json.loads(json.dumps(tuned))
    cached["cache"] = True
    # The paper's rule with its own defaults (W = 10), and a run from before rules existed.
    paper = _run(acc, "egeria", 1, [10, 20], [0.5, 0.9], 900.0)
    paper["config"] = {"eval_interval": None, "window": 10, "rule": "paper", "policy": "egeria"}
    older = _run(acc, "egeria", 2, [10, 20], [0.5, 0.9], 900.0)
    older["config"] = {"eval_interval": None, "window": 10, "policy": "egeria"}
    # A speed point: the horizon it resolved to follows the speed and is not shown on its own.
    fast = _run(acc, "egeria", 3, [10, 20], [0.5, 0.9], 900.0)
    fast["config"] = {"eval_interval": None, "window": 3, "rule": "egeria", "policy": "egeria", "speed": "fast",
                      "horizon": EgeriaConfig(speed="fast").horizon}
    # The same speed with a horizon of the user's: both shown.
    fast_own = json.loads(json.dumps(fast))
    fast_own["seed"], fast_own["config"]["horizon"] = 4, 0.001
    runs = (("plain", plain), ("default", default), ("tuned", tuned), ("cached", cached), ("paper", paper), ("older", older),
            ("fast", fast), ("fast_own", fast_own))
    for name, run in runs:
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    report = build_report(load_runs([tmp_path]), tmp_path / "report")
    labels = sorted(r["policy"] for r in report["tasks"][acc]["layouts"]["accel"]["rows"])
    assert labels == [
        "egeria", "egeria[eval_interval=10]", "egeria[eval_interval=10]+cache", "egeria[horizon=0.001, speed=fast]",
        "egeria[rule=paper]", "egeria[rule=paper]", "egeria[speed=fast]", "none",
    ]


# ------------------------------------------------------------------------------ layouts


def _two_layouts() -> list[dict]:
    """resnet-fmnist in both layouts (format 2): the cpu layout's plain seeds end lower."""
    acc = "resnet-fmnist"
    return [
        _run(acc, "none", 0, [10, 20, 30], [0.5, 0.8, 0.90], 1000.0, layout="accel"),
        _run(acc, "none", 1, [10, 20, 30], [0.5, 0.8, 0.89], 1000.0, layout="accel"),
        _run(acc, "egeria", 0, [8, 16, 24], [0.5, 0.89, 0.90], 700.0, layout="accel",
             backward_shares=[1.0, 0.5, 0.2]),  # fmt: skip
        _run(acc, "none", 0, [5, 10, 15], [0.5, 0.8, 0.87], 1000.0, layout="cpu"),
        _run(acc, "none", 1, [5, 10, 15], [0.5, 0.875, 0.88], 1000.0, layout="cpu"),
        _run(acc, "egeria", 0, [6, 12, 18], [0.5, 0.8, 0.87], 900.0, layout="cpu", backward_shares=[1.0, 1.0, 0.7]),
    ]


def test_runs_are_grouped_by_task_and_layout_side_by_side(tmp_path: Path) -> None:
    rep = build_report(_two_layouts(), tmp_path)
    layouts = rep["tasks"]["resnet-fmnist"]["layouts"]
    assert list(layouts) == ["cpu", "accel"]
    assert layouts["accel"]["target"] == 0.89 and layouts["cpu"]["target"] == 0.87  # each layout's own plain seeds
    assert layouts["cpu"]["reference"]["tta_s"] == pytest.approx((15 + 10) / 2)
    assert _row(rep, "resnet-fmnist", "egeria", 0, "accel")["tta_speedup"] == pytest.approx(30 / 16)
    assert _row(rep, "resnet-fmnist", "egeria", 0, "cpu")["tta_speedup"] == pytest.approx(12.5 / 18)
    assert rep["tasks"]["resnet-fmnist"]["same_machine"]  # torch threads and usable cores are the layout's
    assert len(rep["machines"]) == 1

    md = (tmp_path / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| policy | seed | cpu: final"))
    assert header.index("cpu: TTA (s)") < header.index("accel: TTA (s)")
    egeria = next(line for line in md.splitlines() if line.startswith("| egeria | 0 | 0.87 |"))
    assert egeria.split("|")[3:13] == [" 0.87 ", " 18.0 ", " 0.69x ", " 1.11x ", " 0.62 ",
                                       " 0.9 ", " 16.0 ", " 1.88x ", " 1.43x ", " 1.31 "]  # fmt: skip
    assert "### Layout cpu" in md and "### Layout accel" in md
    assert "trained on cores [0] with 1 torch thread(s); Egeria's controller process on cores [1]" in md


def test_backward_flops_share_is_reported_and_plotted(tmp_path: Path) -> None:
    rep = build_report(_two_layouts(), tmp_path)
    egeria = _row(rep, "resnet-fmnist", "egeria", 0, "accel")
    assert egeria["backward_flops_vs_plain"] == pytest.approx((1.0 + 0.5 + 0.2) / 3)
    assert rep["tasks"]["resnet-fmnist"]["plots"]["backward_flops_share"] == "resnet-fmnist-backward-flops-share.png"
    assert (tmp_path / "resnet-fmnist-backward-flops-share.png").read_bytes()[:8] == PNG_MAGIC


def test_format_1_runs_have_no_backward_flops_plot(report: tuple[dict, Path]) -> None:
    rep, out = report
    assert "backward_flops_share" not in rep["tasks"]["resnet-fmnist"]["plots"]
    assert not (out / "resnet-fmnist-backward-flops-share.png").exists()
    assert _row(rep, "resnet-fmnist", "egeria", 0)["backward_flops_vs_plain"] is None


def test_old_runs_load_as_accel_unless_an_argument_or_a_folder_says_otherwise(tmp_path: Path) -> None:
    old = _run("resnet-fmnist", "none", 0, [10, 20], [0.5, 0.9], 100.0)  # format 1: no layout
    assert old["format"] == 1 and "layout" not in old
    for folder in ["runs", "tta/runs-accel", "tta/runs-cpu", "new/cpu", "given"]:
        path = tmp_path / folder / "resnet-fmnist" / "none-seed0.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(old))
    runs = load_runs([tmp_path / "runs", tmp_path / "tta", tmp_path / "new", f"cpu={tmp_path / 'given'}"])
    found = {Path(r["source"]).parent.parent.name: r["layout"] for r in runs}
    assert found == {
        "runs": {"name": "accel", "inferred_from": "default"},
        "runs-accel": {"name": "accel", "inferred_from": "folder"},
        "runs-cpu": {"name": "cpu", "inferred_from": "folder"},
        "cpu": {"name": "cpu", "inferred_from": "folder"},
        "given": {"name": "cpu", "inferred_from": "argument"},
    }
    # The named file in a runs-cpu folder, given as accel: the argument wins over the folder.
    named = load_runs([f"accel={tmp_path / 'tta' / 'runs-cpu' / 'resnet-fmnist' / 'none-seed0.json'}"])
    assert named[0]["layout"] == {"name": "accel", "inferred_from": "argument"}


def test_a_recorded_layout_wins_over_folders_and_cannot_be_contradicted(tmp_path: Path) -> None:
    run = _run("resnet-fmnist", "none", 0, [10, 20], [0.5, 0.9], 100.0, layout="cpu")
    path = tmp_path / "accel" / "resnet-fmnist" / "none-seed0.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))
    assert load_runs([tmp_path])[0]["layout"]["name"] == "cpu"
    with pytest.raises(ValueError, match=r"none-seed0\.json: recorded layout 'cpu' but the argument says accel="):
        load_runs([f"accel={tmp_path}"])


def test_format_2_runs_must_record_a_known_layout(tmp_path: Path) -> None:
    run = _run("resnet-fmnist", "none", 0, [10, 20], [0.5, 0.9], 100.0, layout="cpu")
    (tmp_path / "no_layout.json").write_text(json.dumps({k: v for k, v in run.items() if k != "layout"}))
    with pytest.raises(ValueError, match=r"no_layout\.json: a format-2 run must record its layout"):
        load_runs([tmp_path / "no_layout.json"])
    (tmp_path / "gpu.json").write_text(json.dumps({**run, "layout": {"name": "gpu"}}))
    with pytest.raises(ValueError, match=r"gpu\.json: 'layout' must be a dict whose name is one of"):
        load_runs([tmp_path / "gpu.json"])


def test_a_recorded_heap_must_be_known(tmp_path: Path) -> None:
    run = _run("resnet-fmnist", "none", 0, [10, 20], [0.5, 0.9], 100.0, layout="cpu")
    (tmp_path / "heap.json").write_text(json.dumps({**run, "heap": None}))
    with pytest.raises(ValueError, match=r"heap\.json: 'heap' must be 'steady' or 'default', got None"):
        load_runs([tmp_path / "heap.json"])


def test_duplicates_are_per_layout(tmp_path: Path) -> None:
    runs = _two_layouts()
    assert len(build_report(runs, tmp_path, plots=False)["tasks"]["resnet-fmnist"]["layouts"]) == 2
    with pytest.raises(ValueError, match="layout 'cpu': two runs of policy 'none' seed 0"):
        build_report(runs + [runs[3]], tmp_path, plots=False)


def test_where_accel_runs_the_controller_is_the_layouts_not_the_label(tmp_path: Path) -> None:
    acc = "resnet-fmnist"
    old_plain = _run(acc, "none", 0, [10, 20], [0.5, 0.9], 1000.0)  # format 1: accel by default
    old_plain["config"] = {"executor": "auto", "policy": "none"}
    old_egeria = _run(acc, "egeria", 0, [10, 20], [0.5, 0.9], 900.0)
    old_egeria["config"] = {"executor": "process", "policy": "egeria", "rule": "egeria"}
    new_egeria = _run(acc, "egeria", 1, [10, 20], [0.5, 0.9], 900.0, layout="accel")
    new_egeria["config"] = {"executor": "process", "controller_cpus": [1], "policy": "egeria", "rule": "egeria"}
    cpu_process = _run(acc, "egeria", 0, [10, 20], [0.5, 0.9], 900.0, layout="cpu")
    cpu_process["config"] = {"executor": "process", "policy": "egeria", "rule": "egeria"}  # --set executor=process
    rep = build_report([old_plain, old_egeria, new_egeria, cpu_process], tmp_path, plots=False)
    labels = {lay: sorted((r["policy"], r["seed"]) for r in data["rows"])
              for lay, data in rep["tasks"][acc]["layouts"].items()}  # fmt: skip
    assert labels == {
        "cpu": [("egeria[executor=process]", 0)],
        "accel": [("egeria", 0), ("egeria", 1), ("none", 0)],
    }


def test_backward_flops_vs_plain_uses_the_plain_seeds_that_recorded_them(tmp_path: Path) -> None:
    old_plain = _run("t", "none", 0, [10, 20], [0.5, 0.9], 1000.0)  # format 1: no backward FLOPs
    new_plain = _run("t", "none", 1, [10, 20], [0.5, 0.9], 1000.0, layout="accel")  # 2000 backward FLOPs
    egeria = _run("t", "egeria", 0, [10, 20], [0.5, 0.9], 900.0, layout="accel", backward_shares=[1.0, 0.5])
    rep = build_report([old_plain, new_plain, egeria], tmp_path, plots=False)
    assert _row(rep, "t", "egeria", 0)["backward_flops_vs_plain"] == pytest.approx(1500 / 2000)
    assert _row(rep, "t", "none", 0)["backward_flops_vs_plain"] is None


def test_the_pace_before_any_freeze_shows_whether_compared_runs_ran_alike(tmp_path: Path) -> None:
    plain = _run("resnet-fmnist", "none", 0, [10, 20, 30, 40], [0.5, 0.7, 0.85, 0.90], 1000.0, layout="accel")
    # Egeria: 1.2 s per step over its first 20 steps, then a freeze at step 25 (faster after it).
    egeria = _run("resnet-fmnist", "egeria", 0, [12, 24, 30, 36], [0.5, 0.7, 0.85, 0.90], 800.0, layout="accel")
    egeria["events"] = [{"step": 25, "action": "freeze", "modules": ["layer1"]}]
    rep = build_report(load_runs([_write([plain, egeria], tmp_path / "runs")]), tmp_path / "report", plots=False)
    assert _row(rep, "resnet-fmnist", "none", 0)["unfrozen_s_per_step"] == pytest.approx(1.0)  # its last record
    assert _row(rep, "resnet-fmnist", "egeria", 0)["unfrozen_s_per_step"] == pytest.approx(1.2)  # up to step 20
    md = (tmp_path / "report" / "report.md").read_text()
    assert "ms/step before any freeze" in md
    assert any(line.startswith("| egeria | 0 |") and line.endswith("| 1200 | 1.33x |") for line in md.splitlines())


def test_the_whole_run_at_plains_pace_scales_by_the_steps_that_train_alike(tmp_path: Path) -> None:
    # Two plain seeds: 20 and 22 s at step 20 (mean 21), 40 and 44 s in all (mean 42).
    plains = [
        _run("t", "none", seed, [w, 2 * w, 3 * w, 4 * w], [0.5, 0.7, 0.85, 0.90], 1000.0, layout="cpu")
        for seed, w in ((0, 10.0), (1, 11.0))
    ]
    # The machine ran this run's unfrozen first 20 steps faster (16.8 s against 21 s: a pace of
    # 0.8); its freeze at step 25 then saved time: 30 s in all, 1.4x against plain's 42 s,
    # 1.4 x 0.8 = 1.12x at plain's pace.
    linear = _run("t", "linear", 0, [8.4, 16.8, 23.4, 30.0], [0.5, 0.7, 0.85, 0.90], 800.0, layout="cpu")
    linear["events"] = [{"step": 25, "action": "freeze", "modules": ["a"]}]
    never = _run("t", "static", 0, [10.0, 20.0, 30.0, 40.0], [0.5, 0.7, 0.85, 0.90], 1000.0, layout="cpu")
    rep = build_report(plains + [linear, never], tmp_path, plots=False)
    assert _row(rep, "t", "linear", 0, "cpu")["pace_matched_speedup"] == pytest.approx(1.12)
    # nothing froze: it trained as plain throughout, so at plain's pace it is plain (its whole
    # run 1.05x is the machine's pace that session, not a speedup)
    assert _row(rep, "t", "static", 0, "cpu")["pace_matched_speedup"] == pytest.approx(1.0)
    assert _row(rep, "t", "none", 0, "cpu")["pace_matched_speedup"] is None
    # the frontier plot places a run at plain's pace where it has one, else at its whole run
    assert _row(rep, "t", "linear", 0, "cpu")["frontier_speedup"] == pytest.approx(1.12)
    assert _row(rep, "t", "linear", 0, "cpu")["frontier_at_plains_pace"] is True
    assert _row(rep, "t", "static", 0, "cpu")["frontier_speedup"] == pytest.approx(1.0)
    assert _row(rep, "t", "static", 0, "cpu")["frontier_at_plains_pace"] is True
    # a run that froze before its first record has no unfrozen prefix to scale by
    early = _run("t", "static", 1, [8.0, 16.0, 24.0, 32.0], [0.5, 0.7, 0.85, 0.90], 800.0, layout="cpu")
    early["events"] = [{"step": 5, "action": "freeze", "modules": ["a"]}]
    rep = build_report(plains + [early], tmp_path / "early", plots=False)
    assert _row(rep, "t", "static", 1, "cpu")["pace_matched_speedup"] is None
    assert _row(rep, "t", "static", 1, "cpu")["frontier_speedup"] == pytest.approx(42.0 / 32.0)
    md = (tmp_path / "report.md").read_text()
    assert any(line.startswith("| linear | 0 |") and line.endswith("| 1.12x |") for line in md.splitlines())


def test_every_run_is_a_point_of_the_frontier_whole_run_speedup_against_the_worst_plain_seed(
    report: tuple[dict, Path]
) -> None:
    rep, out = report
    egeria = _row(rep, "resnet-fmnist", "egeria", 0)
    assert egeria["whole_run_speedup"] == pytest.approx(((40 + 44) / 2) / 32)  # the plain seeds' mean time
    assert egeria["vs_worst_plain"] == pytest.approx(0.905 - 0.88)
    assert _row(rep, "resnet-fmnist", "freezeout", 0)["vs_worst_plain"] == pytest.approx(0.85 - 0.88)
    ptb = _row(rep, "transformer-ptb", "egeria", 0)
    assert ptb["vs_worst_plain"] == pytest.approx(120.0 - 118.0)  # perplexity: lower is better, the sign turned
    assert rep["tasks"]["resnet-fmnist"]["plots"]["frontier"] == "resnet-fmnist-frontier.png"
    assert (out / "resnet-fmnist-frontier.png").read_bytes()[:8] == PNG_MAGIC


def test_the_frontiers_accuracy_axis_turns_logarithmic_only_past_twenty_plain_spreads() -> None:
    from egeria.bench.plots import frontier_linear_range

    def rows(*points: tuple[bool, float]) -> list[dict]:
        return [{"plain": plain, "vs_worst_plain": y} for plain, y in points]

    plains = [(True, 0.0), (True, 0.5), (True, 0.85)]
    assert frontier_linear_range(rows(*plains, (False, -0.7), (False, 0.3))) is None
    assert frontier_linear_range(rows(*plains, (False, -16.9))) is None  # 19.9 spreads: still linear
    assert frontier_linear_range(rows(*plains, (False, -208.9))) == pytest.approx(0.85)  # SmartFRZ on (c)
    # one plain seed (no spread): the nearest point past it sets the scale
    assert frontier_linear_range(rows((True, 0.0), (False, 0.1), (False, -3.0))) == pytest.approx(0.1)
    assert frontier_linear_range(rows((True, 0.0))) is None


def test_each_baseline_setting_is_set_against_the_egeria_settings_that_dominate_it(tmp_path: Path) -> None:
    # plain seeds end at 0.90 and 0.88 in 40 s: the worst plain seed is 0.88
    runs = [_run("t", "none", 0, [10, 20, 30, 40], [0.5, 0.7, 0.85, 0.90], 1000.0),
            _run("t", "none", 1, [10, 20, 30, 40], [0.5, 0.7, 0.84, 0.88], 1000.0),
            # Egeria, two seeds: 1.25x and 1.0x (mean 1.125x), +0.01 and +0.00 (mean +0.005)
            _run("t", "egeria", 0, [8, 16, 24, 32], [0.5, 0.7, 0.85, 0.89], 800.0),
            _run("t", "egeria", 1, [10, 20, 30, 40], [0.5, 0.7, 0.85, 0.88], 800.0),
            # slower and less accurate than Egeria's mean: dominated
            _run("t", "linear", 0, [10, 20, 30, 36], [0.5, 0.7, 0.85, 0.87], 900.0),
            # faster than Egeria (2x), though less accurate: not dominated
            _run("t", "freezeout", 0, [5, 10, 15, 20], [0.5, 0.7, 0.85, 0.86], 500.0),
            # slower than Egeria's mean but more accurate (+0.01): not dominated, though one Egeria
            # seed is faster and as accurate: the means decide
            _run("t", "static", 0, [9, 18, 27, 36], [0.5, 0.7, 0.85, 0.89], 900.0)]
    static_t0 = {**runs[-1], "policy_options": {"count": 2, "at_step": 30}}
    for r in runs[2:-1] + [static_t0]:  # each froze before its first record: read at its whole run
        r["events"] = [{"step": 5, "action": "freeze", "modules": ["layer1"]}]
    root = tmp_path / "runs"
    for r in runs[:-1] + [static_t0]:
        path = root / r["task"] / f"{r['policy']}-seed{r['seed']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    rep = build_report(load_runs([root]), tmp_path / "out", plots=False)
    dominance = {d["baseline"]: d for d in rep["tasks"]["t"]["layouts"]["accel"]["dominance"]}
    assert set(dominance) == {"linear", "freezeout", "static(at_step=30, count=2)"}  # neither plain nor Egeria
    assert dominance["linear"]["dominated_by"] == ["egeria"]
    assert dominance["linear"]["speedup"] == pytest.approx(40 / 36)
    assert dominance["freezeout"]["dominated_by"] == []
    assert dominance["static(at_step=30, count=2)"]["vs_worst_plain"] == pytest.approx(0.01)
    assert dominance["static(at_step=30, count=2)"]["dominated_by"] == []
    md = (tmp_path / "out" / "report.md").read_text()
    assert "- `linear` (seeds 0: 1.11x, -0.01): dominated by `egeria`" in md
    assert "- `freezeout` (seeds 0: 2.00x, -0.02): dominated by no Egeria setting here" in md


def test_every_policy_has_its_own_colour_in_the_speed_plots() -> None:
    from egeria.bench.plots import policy_colour
    from egeria.policies import POLICIES

    colours = [policy_colour(name) for name in [*POLICIES, "egeria"]]
    assert len(set(colours)) == len(colours) and "tab:gray" not in colours
    assert policy_colour("plain") == policy_colour("none")
    assert policy_colour("a-policy-not-listed") == "tab:gray"


def test_the_frontier_plot_numbers_its_points_and_names_each_in_a_list_under_the_panel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from egeria.bench import plots

    texts: dict[str, list[str]] = {}

    def keep_texts(fig: object, out: Path, name: str) -> str:  # stands in for plots._save
        texts[name] = [t.get_text() for ax in fig.axes for t in ax.texts]
        return name

    monkeypatch.setattr(plots, "_save", keep_texts)
    plains = [_run("t", "none", seed, [10.0, 20.0, 30.0, 40.0 + seed], [0.5, 0.7, 0.85, 0.90 - seed / 100], 1000.0,
                   layout="cpu") for seed in (0, 1)]
    linear = _run("t", "linear", 0, [8.4, 16.8, 23.4, 30.0], [0.5, 0.7, 0.85, 0.88], 800.0, layout="cpu")
    linear["events"] = [{"step": 25, "action": "freeze", "modules": ["a"]}]
    rep = build_report(plains + [linear], tmp_path, plots=True)
    drawn = texts["t-frontier.png"]
    listing = next(t for t in drawn if "\n" in t).splitlines()
    # three points, numbered from the slowest; each number drawn at its point and named once in the list
    assert [line.split()[0] for line in listing] == ["1", "2", "3"]
    assert {"1", "2", "3"} <= set(drawn)
    point = _row(rep, "t", "linear", 0, "cpu")
    assert listing[-1].split()[1:3] == ["linear", "s0"]
    assert listing[-1].endswith(f"({point['frontier_speedup']:.2f}x, {point['vs_worst_plain']:+.3g})")
    assert point["vs_worst_plain"] == pytest.approx(0.88 - 0.89)
