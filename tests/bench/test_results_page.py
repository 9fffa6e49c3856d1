"""The results page: ``summary_tables`` gives each run's speedups against its plain twin and
the plain seeds' mean, and ``benchmarks/RESULTS.md`` holds exactly the tables its committed run
files give (a figure typed by hand, or a run file changed under it, fails here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripts import load_script
from test_report import _run

from egeria.bench.report import summary_tables

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_is_set_against_its_twin_and_the_plain_mean() -> None:
    runs = [
        _run("t", "none", 0, [50.0, 100.0], [0.5, 0.90], 100.0, layout="cpu"),
        _run("t", "none", 1, [60.0, 120.0], [0.5, 0.92], 100.0, layout="cpu"),
        _run("t", "static", 0, [40.0, 80.0], [0.5, 0.91], 50.0, layout="cpu"),
    ]
    lines = summary_tables(runs)
    row = next(line for line in lines if line.startswith("| static | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # final, wall, vs twin (100 / 80), vs the plain mean (110 / 80), FLOP-ideal (100 / 50)
    assert cells[2:6] == ["0.91", "80.0", "1.25x", "1.38x"]
    assert cells[9] == "2.00x"
    assert lines[0].startswith("`t`, cpu layout: accuracy; target 0.9,")
    assert any(line.startswith("Machine: test cpu, 2 cores") for line in lines)


def test_no_runs_is_an_error() -> None:
    with pytest.raises(ValueError, match="no runs"):
        summary_tables([])


def test_the_results_page_holds_the_tables_its_run_files_give() -> None:
    page = load_script("benchmarks/results_page.py")
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    assert len(page.BLOCK.findall(text)) >= 10  # the page's tables are generated; none would prove nothing
    assert page.refresh(text) == text, "benchmarks/RESULTS.md is out of date: run benchmarks/results_page.py"


def test_the_frontier_tables_come_from_the_session_files_behind_them() -> None:
    import json

    page = load_script("benchmarks/results_page.py")
    frontier = load_script("benchmarks/frontier.py")
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    folders = [m["folder"] for m in page.FRONTIER.finditer(text)]
    assert len(folders) >= 2
    for folder in folders:
        committed = json.loads((ROOT / folder / "frontier.json").read_text())
        made = json.loads(json.dumps(frontier.summarise(frontier.points(ROOT / folder))))
        assert committed["summary"] == made, f"{folder}/frontier.json is stale: run benchmarks/frontier.py report"


def test_a_frontier_table_has_a_row_per_length_and_arm_plain_first() -> None:
    page = load_script("benchmarks/results_page.py")
    study = {"summary": [
        {"scale": 1, "arm": "egeria:safe", "seeds": [0, 1], "speedup": 1.1, "vs_own_plain": -0.05, "vs_worst_plain": 0.1},
        {"scale": 1, "arm": "plain", "seeds": [0, 1], "speedup": 1.0, "vs_own_plain": 0.0, "vs_worst_plain": 0.2},
    ]}
    lines = page.frontier_table(study).splitlines()
    assert lines[2] == "| 1x | plain | 0, 1 | 1.00x | +0.00 | +0.20 |"
    assert lines[3] == "| 1x | egeria:safe | 0, 1 | 1.10x | -0.05 | +0.10 |"
