"""The two TTA targets (egeria.bench.targets) on synthetic curves, and the report computing
time-to-target for both."""

from __future__ import annotations

import math

import pytest

from egeria.bench.report import NOT_REACHED, build_report
from egeria.bench.targets import GAIN_LEFT, mlperf_target, strict_target, worst_curve

MACHINE = {"platform": "Linux-x86_64", "cpu": "test cpu", "cores": 2, "torch": "2.13.0+cpu"}


def _run(policy: str, seed: int, metrics: list[float | None], *, higher: bool = True, step: int = 10,
         wall: float = 1.0, final: float | None = None) -> dict:
    """A format-2 run with one record every ``step`` steps, ``wall`` seconds per record."""
    records = [
        {"step": step * (i + 1), "epoch": i + 1, "wall_time_s": wall * (i + 1), "metric": m, "loss": None,
         "frozen": [], "trainable_share": 1.0, "flops_per_step": 1.0}
        for i, m in enumerate(metrics)
    ]
    last = final if final is not None else next(m for m in reversed(metrics) if m is not None)
    return {
        "format": 2, "task": "toy", "policy": policy, "seed": seed, "machine": MACHINE,
        "metric": {"name": "accuracy" if higher else "perplexity", "higher_is_better": higher},
        "layout": {"name": "cpu", "train_cpus": [0, 1], "torch_threads": 2, "controller_cpus": None},
        "records": records, "total_steps": step * len(metrics),
        "final": {"metric": last, "wall_time_s": wall * len(metrics), "total_flops": 100.0},
    }


def _saturating(top: float, rate: float, n: int = 40) -> list[float]:
    """An accuracy curve from 0.1 rising to ``top`` with a knee (exponential approach)."""
    return [top - (top - 0.1) * math.exp(-rate * (i + 1)) for i in range(n)]


def test_the_rule_on_saturating_curves():
    plain = [_run("none", s, _saturating(top, rate)) for s, (top, rate) in enumerate([(0.93, 0.3), (0.94, 0.25), (0.935, 0.2)])]
    curve = worst_curve(plain, True)
    assert len(curve) == 40 and all(a[1] <= b[1] for a, b in zip(curve, curve[1:]))
    first, end = curve[0][1], curve[-1][1]
    got = mlperf_target(plain, True)
    assert got["target"] == pytest.approx(end - GAIN_LEFT * (end - first))
    assert got["curve_first"] == first and got["curve_end"] == end and got["plain_seeds"] == [0, 1, 2]
    # Every plain seed reaches it, and the worst-case curve first does so at the step reported.
    assert all(max(rec["metric"] for rec in r["records"]) >= got["target"] for r in plain)
    step = got["step"]
    assert dict(curve)[step] >= got["target"] and all(v < got["target"] for s, v in curve if s < step)
    # Just past the knee: well into the flat end, yet before the run's end and below the strict target.
    assert 100 < step < 400
    assert got["target"] < strict_target(plain, True)


def test_the_worst_case_curve_takes_each_seeds_best_so_far():
    a = _run("none", 0, [0.5, 0.8, 0.7, 0.9])  # dips at the third record
    b = _run("none", 1, [0.6, 0.7, 0.85, 0.88])
    assert worst_curve([a, b], True) == [(10, 0.5), (20, 0.7), (30, 0.8), (40, 0.88)]
    got = mlperf_target([a, b], True, gain_left=0.25)
    assert got["target"] == pytest.approx(0.88 - 0.25 * 0.38) and got["step"] == 30  # 0.785


def test_lower_is_better_runs_the_other_way():
    a = _run("none", 0, [500.0, 200.0, 150.0, 140.0, 135.0], higher=False)
    b = _run("none", 1, [520.0, 210.0, 160.0, 145.0, 138.0], higher=False)
    got = mlperf_target([a, b], False)
    assert got["curve_first"] == 520.0 and got["curve_end"] == 138.0
    assert got["target"] == pytest.approx(138.0 + 0.01 * (520.0 - 138.0))
    assert got["step"] == 50 and strict_target([a, b], False) == 138.0


def test_missing_metrics_and_unshared_steps_are_left_out():
    a = _run("none", 0, [None, 0.5, float("nan"), 0.8, 0.9])
    b = _run("none", 1, [0.4, 0.6, 0.7, 0.75, 0.85], step=20)  # steps 20..100: shares 20 and 40 with a
    assert worst_curve([a, b], True) == [(20, 0.4), (40, 0.6)]
    assert worst_curve([a], True)[:2] == [(20, 0.5), (30, 0.5)]  # the NaN record keeps the best so far
    assert mlperf_target([_run("none", 0, [0.5])], True) is None  # one record: no curve to read
    assert mlperf_target([], True) is None and strict_target([], True) is None


@pytest.mark.parametrize("bad", [1.0, -0.1, "0.01", True])
def test_gain_left_must_be_a_share_below_one(bad):
    with pytest.raises(ValueError, match="gain_left="):
        mlperf_target([_run("none", 0, [0.5, 0.6])], True, gain_left=bad)


def test_the_report_times_both_targets(tmp_path):
    plain = [
        _run("none", 0, [0.5, 0.8, 0.9, 0.91, 0.92], wall=10.0),
        _run("none", 1, [0.5, 0.82, 0.89, 0.905, 0.915], wall=10.0),
    ]
    # Faster per record, reaches 0.9 at its third record, ends under the strict target.
    fast = _run("egeria", 0, [0.5, 0.8, 0.9, 0.905, 0.91], wall=8.0)
    rep = build_report(plain + [fast], tmp_path, plots=False)
    data = rep["tasks"]["toy"]["layouts"]["cpu"]
    fair = data["mlperf_target"]
    assert data["target"] == 0.915
    assert fair["target"] == pytest.approx(0.915 - 0.01 * (0.915 - 0.5))  # 0.91085
    assert fair["step"] == 50
    assert data["reference"]["mlperf_tta_s"] == pytest.approx(50.0)  # both plain seeds at their last record
    rows = {(r["policy"], r["seed"]): r for r in data["rows"]}
    assert not rows["egeria", 0]["reached"] and rows["egeria", 0]["tta_speedup"] is None
    assert not rows["egeria", 0]["mlperf_reached"]  # 0.91 < 0.91085
    md = (tmp_path / "report.md").read_text()
    assert "MLPerf-style target: accuracy >= 0.91085" in md and "it gets there at step 50" in md
    line = next(x for x in md.splitlines() if x.startswith("| egeria | 0 | 0.91 |"))
    assert line.count(NOT_REACHED) == 2


def test_the_report_speedup_against_the_mlperf_style_target(tmp_path):
    plain = [_run("none", s, [0.5, 0.7, 0.85, 0.9, 0.9, 0.9], wall=10.0) for s in (0, 1)]
    fast = _run("egeria", 0, [0.5, 0.7, 0.9, 0.9, 0.9, 0.9], wall=10.0)
    rep = build_report(plain + [fast], tmp_path, plots=False)
    data = rep["tasks"]["toy"]["layouts"]["cpu"]
    assert data["mlperf_target"]["target"] == pytest.approx(0.896)
    row = next(r for r in data["rows"] if r["policy"] == "egeria")
    assert row["mlperf_tta_s"] == 30.0 and row["mlperf_tta_speedup"] == pytest.approx(40.0 / 30.0)
    assert row["mlperf_tta_step"] == 30
