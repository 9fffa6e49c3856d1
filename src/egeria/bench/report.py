"""Benchmark report: tables, seed-noise statements and plots from the runner's run files.

:func:`load_runs` (:mod:`egeria.bench.runfiles`) reads the run files, formats 1 and 2,
each with its layout (``"cpu"`` or ``"accel"``, :mod:`egeria.bench.layouts`).
:func:`build_report` groups them by task and layout and writes, per task, its layouts side
by side, with what the paper's section 6 shows:

- a time-to-accuracy table per layout (Table 1). The target is the *worst* final metric
  among the plain runs (``policy == "none"``) of that task and layout: the lowest accuracy,
  the highest perplexity, so that every plain seed reaches it (issue 10; until then the
  target was the final metric of the lowest plain seed, which the other plain seeds might
  not reach). A run's TTA is the ``wall_time_s`` of its first record (or its final
  evaluation) whose metric reaches the target (``>=``, or ``<=`` where lower is better);
  nothing is interpolated: a run that never reaches it is "not reached". The plain TTA is
  the mean over the plain seeds. Beside it stands the TTA to the *MLPerf-style target*
  (issue 28), the same measurement against a target that does not sit on the flat end of
  the curve, where a few test images decide whether a run ever gets there (the rule below).
  Beside the measured TTA speedup (plain TTA / the run's)
  stand the FLOP-ideal speedup (plain total FLOPs, mean over seeds / the run's total FLOPs,
  what the saved computation alone would give), the efficiency (measured / ideal) and the
  run's backward FLOPs against those of the plain runs that recorded them (format-2 runs);
- whether each policy's final metric differs from the plain seeds' mean by less than the
  seed-to-seed spread (max - min) of the plain runs (unknown with a single plain seed);
- one side-by-side table of the layouts' final metrics, TTAs, speedups and efficiencies;
- figures (:mod:`egeria.bench.plots`): metric against wall time, trainable parameter
  share and backward FLOPs share over steps, one panel per layout; plasticity per module;
  memory by part over steps, one panel per run whose file has ``memory`` rows
  (:mod:`egeria.memory`: parameters, gradients, optimizer state held and released, saved
  activations, the cache's store).

The MLPerf-style target, fixed from the plain seeds of the task and layout alone (no other
run moves it), by one rule for every task (:func:`egeria.bench.targets.mlperf_target`):

1. each plain seed's *best-so-far* curve over its evaluation records (the running maximum
   of accuracy, the running minimum of perplexity);
2. the *worst-case plain curve*: at every record step all plain seeds evaluated, the worst
   of their best-so-far values; it moves only towards better, from its first value F (the
   first record) to its last E (the worst plain seed's best);
3. the target is ``E - 0.01 * (E - F)``: the quality at which the worst-case curve has made
   99% of its gain over the run (``GAIN_LEFT`` = 1% of it still ahead). Every plain seed
   reaches it (each one's best is at least E). Where the curve turns flat (a knee), this
   lies just past the knee, as the flat end begins, 1% of the run's gain below it; where
   the curve still improves at its end (an LM under a decaying schedule) it lies where the
   last 1% of the gain remains. (MLPerf's ResNet-50 target, 75.9% top-1 against about 76.4%
   reached, is the same idea: a fraction of a percent of the gain below what the reference
   reaches.) The report shows the target, the step at which the worst-case curve reaches
   it, and each run's TTA and speedup against it, computed as for the strict target.

A run file may carry ``timing_unreliable``: why its times do not measure the code (other work
took the machine's cores during it; the field is added by hand, with the reason, and the
measured values are left as they are). Such a run's metric still counts, for the targets
and the seed spread; its times are left out of the plain TTA a speedup divides, and its
own speedups are not stated.

Output: ``report.md``, ``report.json`` and ``<task>-*.png`` in the output directory.
"""

from __future__ import annotations

import json
import logging
import math
from os import PathLike
from pathlib import Path
from typing import Any

from ..policies import POLICIES
from .layouts import LAYOUTS
from .plots import plot_task
from .runfiles import RUN_FORMAT, check_run, layout_name, load_runs, policy_label
from .targets import mlperf_target

__all__ = ["RUN_FORMAT", "REPORT_FORMAT", "NOT_REACHED", "load_runs", "build_report"]

logger = logging.getLogger(__name__)

REPORT_FORMAT = 2
"""The format of ``report.json`` (key ``report_format``; run files use ``format``). 2: each
task's numbers are per layout, under ``layouts``."""

NOT_REACHED = "not reached"
UNTIMED = "reached (time unreliable)"

# Fields of a run's ``machine`` that describe the process (its pinning), not the machine:
# the layout records them, so runs of two layouts on one machine count as one machine.
_PROCESS_FIELDS = ("usable_cores", "torch_threads")


# ------------------------------------------------------------------------------- the numbers


def _reaches(value: float | None, target: float, higher_is_better: bool) -> bool:
    if value is None or not math.isfinite(value) or not math.isfinite(target):
        return False
    return value >= target if higher_is_better else value <= target


def _time_to_target(run: dict, target: float, higher_is_better: bool) -> tuple[float, int | None] | None:
    """(wall time, step) of the first evaluation reaching ``target``; None if none does.

    The records are scanned in order; the final evaluation counts as one more point after
    them (at ``final.wall_time_s``), so a run whose final metric reaches the target has a TTA
    even when the runner evaluates the last time only for ``final``.
    """
    for rec in run["records"]:
        if _reaches(rec.get("metric"), target, higher_is_better):
            return float(rec["wall_time_s"]), rec.get("step")
    final = run["final"]
    if _reaches(final["metric"], target, higher_is_better):
        return float(final["wall_time_s"]), run.get("total_steps")
    return None


def _last_unfrozen_record(run: dict) -> dict | None:
    """The last record up to the run's first freeze (a plain run: its last record)."""
    freezes = [e["step"] for e in run.get("events", []) if e.get("action") == "freeze"]
    until = min(freezes) if freezes else math.inf
    before = [rec for rec in run["records"] if rec.get("step") and rec["step"] <= until]
    return before[-1] if before else None


def _unfrozen_pace(run: dict) -> float | None:
    """Training seconds per step while nothing was frozen. It shows whether runs compared
    with each other ran at the same pace before freezing could make any difference (runs
    made in different sessions of one machine can differ by 20%)."""
    rec = _last_unfrozen_record(run)
    return float(rec["wall_time_s"]) / rec["step"] if rec else None


def pace_matched_speedup(run: dict, plain: list[dict]) -> float | None:
    """The whole-run speedup over the plain seeds' mean wall time, the run's time scaled by
    how much faster or slower the machine ran its unfrozen prefix than it ran the same steps
    of the plain seeds (training that is identical up to the first freeze). A run that froze
    nothing by its last record trained as plain throughout: its prefix is the whole run and
    it reads 1.00x, not its session's pace. ``None`` for a plain run, a run that froze before
    its first record, or plain seeds without a record at that step."""
    rec = _last_unfrozen_record(run)
    if run["policy"] == "none" or not plain or rec is None:
        return None
    at_step = [next((p["wall_time_s"] for p in r["records"] if p.get("step") == rec["step"]), None) for r in plain]
    if None in at_step:
        return None
    pace = _ratio(float(rec["wall_time_s"]), _mean([float(t) for t in at_step]))  # the run's time / plain's
    whole = _ratio(_mean([float(r["final"]["wall_time_s"]) for r in plain]), float(run["final"]["wall_time_s"]))
    return whole * pace if (whole is not None and pace is not None) else None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den or not math.isfinite(num) or not math.isfinite(den):
        return None
    return num / den


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _machine(run: dict) -> Any:
    machine = run["machine"]
    if isinstance(machine, dict):
        return {k: v for k, v in machine.items() if k not in _PROCESS_FIELDS}
    return machine


def _machine_key(run: dict) -> str:
    return json.dumps(_machine(run), sort_keys=True)


def _machine_line(machine: Any) -> str:
    """All the machine's fields, platform, cpu, cores and torch first."""
    if not isinstance(machine, dict) or not machine:
        return str(machine)
    first = [k for k in ("platform", "cpu", "cores", "torch") if k in machine]
    keys = first + sorted(k for k in machine if k not in first)
    return ", ".join(f"{k}: {machine[k]}" for k in keys)


def _placement(run: dict) -> str:
    """How the run was placed on the machine, in words."""
    layout = run.get("layout") or {}
    if "train_cpus" in layout:
        controller = layout.get("controller_cpus")
        where = f"controller process on cores {controller}" if controller else "controller where the config put it"
        return (
            f"trained on cores {layout['train_cpus']} with {layout['torch_threads']} torch thread(s); "
            f"Egeria's {where}"
        )
    machine = run["machine"] if isinstance(run["machine"], dict) else {}
    inferred = layout.get("inferred_from", "default")
    return (
        f"not recorded (layout from the {inferred}); the process could use {machine.get('usable_cores', '?')} "
        f"core(s) with {machine.get('torch_threads', '?')} torch thread(s)"
    )


def _ordered(runs: list[dict]) -> list[dict]:
    return sorted(runs, key=lambda r: (r["policy"] != "none", policy_label(r), r["seed"]))


def _layout_report(task: str, layout: str, runs: list[dict], higher: bool) -> dict:
    """The numbers of one task in one layout (no files written)."""
    seen: dict[tuple[str, Any], str] = {}
    for r in runs:
        key = (policy_label(r), r["seed"])
        if key in seen:
            raise ValueError(
                f"task {task!r}, layout {layout!r}: two runs of policy {key[0]!r} seed {key[1]!r}: "
                f"{seen[key]} and {r.get('source', '?')}"
            )
        seen[key] = r.get("source", "?")

    plain = sorted((r for r in runs if r["policy"] == "none"), key=lambda r: r["seed"])
    finals = [float(r["final"]["metric"]) for r in plain]
    target = (min(finals) if higher else max(finals)) if plain else None
    target_seed = plain[finals.index(target)]["seed"] if plain else None
    timed = [r for r in plain if not r.get("timing_unreliable")]  # whose times measure the code
    plain_ttas = [t[0] for t in (_time_to_target(r, target, higher) for r in timed) if t is not None]
    ref_tta = _mean(plain_ttas) if plain_ttas and len(plain_ttas) == len(timed) else None
    ref_flops = _mean([float(r["final"]["total_flops"]) for r in plain])
    ref_backward = _mean([float(b) for r in plain if (b := r["final"].get("total_backward_flops")) is not None])
    plain_mean = _mean(finals)
    mlperf = mlperf_target(plain, higher)
    mlperf_value = mlperf["target"] if mlperf else None
    mlperf_ttas = [t[0] for t in (_time_to_target(r, mlperf_value, higher) for r in timed) if t is not None] if mlperf else []
    mlperf_ref = _mean(mlperf_ttas) if mlperf and mlperf_ttas and len(mlperf_ttas) == len(timed) else None

    plain_wall = _mean([float(r["final"]["wall_time_s"]) for r in timed])
    rows = []
    for r in _ordered(runs):
        tta = _time_to_target(r, target, higher) if target is not None else None
        fair = _time_to_target(r, mlperf_value, higher) if mlperf else None
        untimed = bool(r.get("timing_unreliable"))  # its times measure the machine, not the code
        speedup = _ratio(ref_tta, tta[0]) if (ref_tta is not None and tta and not untimed) else None
        ideal = _ratio(ref_flops, float(r["final"]["total_flops"]))
        whole = None if untimed else _ratio(plain_wall, float(r["final"]["wall_time_s"]))
        paced = None if untimed else pace_matched_speedup(r, timed)
        rows.append({
            "policy": policy_label(r),
            "policy_name": str(r["policy"]),
            "plain": r["policy"] == "none",
            "seed": r["seed"],
            "final_metric": r["final"]["metric"],
            "wall_time_s": r["final"]["wall_time_s"],
            "total_flops": r["final"]["total_flops"],
            "reached": tta is not None,
            "timing_unreliable": r.get("timing_unreliable"),
            "tta_s": tta[0] if tta and not untimed else None,
            "tta_step": tta[1] if tta else None,
            "tta_speedup": speedup,
            "mlperf_reached": fair is not None,
            "mlperf_tta_s": fair[0] if fair and not untimed else None,
            "mlperf_tta_step": fair[1] if fair else None,
            "mlperf_tta_speedup": _ratio(mlperf_ref, fair[0]) if (mlperf_ref is not None and fair and not untimed) else None,
            "ideal_speedup": ideal,
            "whole_run_speedup": whole,
            # the frontier's two axes: the whole run against the plain seeds' mean time, at
            # plain's pace where the run has steps that train as plain's did (runs from sessions
            # that ran at different paces then compare), and the final metric past the worst
            # plain seed's (> 0: better; in the metric's units)
            "frontier_speedup": whole if paced is None else paced,
            "frontier_at_plains_pace": paced is not None,
            "vs_worst_plain": None if target is None else (
                (float(r["final"]["metric"]) - target) * (1 if higher else -1)),
            "efficiency": _ratio(speedup, ideal),
            "backward_flops_vs_plain": _ratio(r["final"].get("total_backward_flops"), ref_backward),
            "unfrozen_s_per_step": _unfrozen_pace(r),
            "pace_matched_speedup": paced,
            "source": r.get("source"),
        })

    # Seed noise: the spread of the plain runs' final metrics (max - min), against each
    # other run's distance from the plain runs' mean final.
    spread = (max(finals) - min(finals)) if len(finals) >= 2 else None
    noise = []
    for row in rows:
        if row["plain"]:
            continue
        diff = abs(float(row["final_metric"]) - plain_mean) if plain_mean is not None else None
        within = (diff < spread) if (diff is not None and spread is not None) else None
        noise.append({"policy": row["policy"], "seed": row["seed"], "abs_diff": diff, "within_noise": within})

    return {
        "layout": layout,
        "placements": sorted({_placement(r) for r in runs}),
        "target": target,
        "mlperf_target": mlperf,
        "reference": {
            "policy": "none",
            "target_seed": target_seed,
            "seeds": [r["seed"] for r in plain],
            "mean_final": plain_mean,
            "tta_s": ref_tta,
            "mlperf_tta_s": mlperf_ref,
            "total_flops": ref_flops,
            "total_backward_flops": ref_backward,
        } if plain else None,
        "rows": rows,
        "seed_spread": spread,
        "plain_seeds": [r["seed"] for r in plain],
        "seed_noise": noise,
        "dominance": dominance(rows),
        "same_machine": len({_machine_key(r) for r in runs}) == 1,
        "heaps": sorted({r.get("heap", "default") for r in runs}),
        "commands": [r["command"] for r in _ordered(runs) if r.get("command")],
    }


def frontier_points(rows: list[dict]) -> list[dict]:
    """Each policy setting's point on the frontier: the means over its seeds of the frontier's
    two axes (``frontier_speedup``, ``vs_worst_plain``); a setting with an untimed seed or no
    plain seeds to set it against has no point."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        if not row["plain"]:
            groups.setdefault(row["policy"], []).append(row)
    points = []
    for label, group in groups.items():
        speeds = [r["frontier_speedup"] for r in group]
        gains = [r["vs_worst_plain"] for r in group]
        if None in speeds or None in gains:
            continue
        points.append({"policy": label, "policy_name": group[0]["policy_name"],
                       "seeds": sorted(r["seed"] for r in group),
                       "speedup": sum(speeds) / len(speeds), "vs_worst_plain": sum(gains) / len(gains)})
    return points


def at_least_as_good(a: dict, b: dict) -> bool:
    """Whether frontier point ``a`` is at least as fast and at least as far over the worst plain
    seed as ``b`` (``speedup``, ``vs_worst_plain``): the one test every dominance here makes."""
    return a["speedup"] >= b["speedup"] and a["vs_worst_plain"] >= b["vs_worst_plain"]


def dominance(rows: list[dict]) -> list[dict]:
    """The frontier goal, one entry per baseline setting: the Egeria settings whose point is at
    least as fast and at least as far over the worst plain seed (means over seeds, as
    :func:`frontier_points` places them)."""
    points = frontier_points(rows)
    egeria = [p for p in points if p["policy_name"] == "egeria"]
    return [{"baseline": b["policy"], "seeds": b["seeds"], "speedup": b["speedup"], "vs_worst_plain": b["vs_worst_plain"],
             "dominated_by": [e["policy"] for e in egeria if at_least_as_good(e, b)]}
            for b in points if b["policy_name"] in POLICIES and b["policy_name"] != "none"]


def _task_report(task: str, groups: dict[str, list[dict]]) -> dict:
    """The numbers of one task, per layout."""
    runs = [r for group in groups.values() for r in group]
    metrics = {(r["metric"]["name"], bool(r["metric"]["higher_is_better"])) for r in runs}
    if len(metrics) != 1:
        raise ValueError(f"task {task!r}: runs disagree on the metric: {sorted(metrics)}")
    (metric_name, higher), = metrics
    return {
        "task": task,
        "metric": {"name": metric_name, "higher_is_better": higher},
        "layouts": {layout: _layout_report(task, layout, group, higher) for layout, group in groups.items()},
        "same_machine": len({_machine_key(r) for r in runs}) == 1,
        "plots": {},
    }


# ---------------------------------------------------------------------------------- writing


def _fmt_metric(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.5g}"


def _fmt_float(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _fmt_tta(data: dict, row: dict | None) -> str:
    if row is None:
        return ""
    if data["target"] is None:
        return "no target"
    if row.get("timing_unreliable"):
        return UNTIMED if row["reached"] else NOT_REACHED
    return f"{row['tta_s']:.1f}" if row["reached"] else NOT_REACHED


def _fmt_mlperf_tta(data: dict, row: dict | None) -> str:
    if row is None:
        return ""
    if data.get("mlperf_target") is None:
        return "no target"
    if row.get("timing_unreliable"):
        return UNTIMED if row["mlperf_reached"] else NOT_REACHED
    return f"{row['mlperf_tta_s']:.1f}" if row["mlperf_reached"] else NOT_REACHED


def _table(data: dict, metric: str) -> list[str]:
    lines = [
        f"| policy | seed | final {metric} | wall time (s) | TTA (s) | TTA speedup | MLPerf-style TTA (s) "
        "| MLPerf-style TTA speedup | FLOP-ideal speedup | efficiency | backward FLOPs vs plain | ms/step before any freeze | whole run at plain's pace |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["rows"]:
        pace = row.get("unfrozen_s_per_step")
        lines.append(
            f"| {row['policy']} | {row['seed']} | {_fmt_metric(row['final_metric'])} | {row['wall_time_s']:.1f} "
            f"| {_fmt_tta(data, row)} | {_fmt_ratio(row['tta_speedup'])} | {_fmt_mlperf_tta(data, row)} "
            f"| {_fmt_ratio(row.get('mlperf_tta_speedup'))} | {_fmt_ratio(row['ideal_speedup'])} "
            f"| {_fmt_float(row['efficiency'])} | {_fmt_float(row['backward_flops_vs_plain'])} "
            f"| {'n/a' if pace is None else f'{1000 * pace:.0f}'} | {_fmt_ratio(row.get('pace_matched_speedup'))} |"
        )
    return lines


def _side_by_side(task_data: dict) -> list[str]:
    """One row per (policy, seed), each layout's final metric, TTA and speedups beside."""
    layouts = list(task_data["layouts"])
    metric = task_data["metric"]["name"]
    head = "| policy | seed |" + "".join(
        f" {lay}: final {metric} | {lay}: TTA (s) | {lay}: TTA speedup | {lay}: FLOP-ideal | {lay}: efficiency |"
        for lay in layouts
    ) + "".join(f" {lay}: MLPerf-style TTA (s) | {lay}: MLPerf-style TTA speedup |" for lay in layouts)
    lines = [head, "|---|---:|" + "---:|" * (7 * len(layouts))]
    keys: dict[tuple[str, Any], bool] = {}
    for lay in layouts:
        for row in task_data["layouts"][lay]["rows"]:
            keys[row["policy"], row["seed"]] = row["plain"]
    for policy, seed in sorted(keys, key=lambda k: (not keys[k], k[0], str(k[1]))):
        line = f"| {policy} | {seed} |"
        fair = ""
        for lay in layouts:
            data = task_data["layouts"][lay]
            row = next((r for r in data["rows"] if (r["policy"], r["seed"]) == (policy, seed)), None)
            if row is None:
                line += " - | - | - | - | - |"
                fair += " - | - |"
                continue
            line += (
                f" {_fmt_metric(row['final_metric'])} | {_fmt_tta(data, row)} | {_fmt_ratio(row['tta_speedup'])} "
                f"| {_fmt_ratio(row['ideal_speedup'])} | {_fmt_float(row['efficiency'])} |"
            )
            fair += f" {_fmt_mlperf_tta(data, row)} | {_fmt_ratio(row.get('mlperf_tta_speedup'))} |"
        lines.append(line + fair)
    return lines


def _noise_sentences(data: dict, metric: str) -> list[str]:
    if data["target"] is None:
        return ["No plain run (`none`) in this layout: no target, so neither TTA nor seed noise can be judged."]
    spread = data["seed_spread"]
    if spread is None:
        out = [
            f"Seed-to-seed spread unknown: only one plain (`none`) seed ({data['plain_seeds'][0]}); "
            "run another `none` seed to tell whether these differences are seed noise:"
        ]
        for n in data["seed_noise"]:
            out.append(f"- {n['policy']} seed {n['seed']}: |final - plain final| = {_fmt_metric(n['abs_diff'])}.")
        return out
    seeds = ", ".join(str(s) for s in data["plain_seeds"])
    out = [f"Seed-to-seed spread of the plain runs (seeds {seeds}): {_fmt_metric(spread)} ({metric})."]
    for n in data["seed_noise"]:
        head = f"- {n['policy']} seed {n['seed']}: |final - plain mean final| = {_fmt_metric(n['abs_diff'])}"
        if n["within_noise"]:
            out.append(f"{head} < spread {_fmt_metric(spread)}: the difference is within seed noise.")
        else:
            out.append(f"{head} >= spread {_fmt_metric(spread)}: the difference is larger than seed noise.")
    return out


def _layout_section(task_data: dict, data: dict) -> list[str]:
    metric = task_data["metric"]["name"]
    lines = [f"### Layout {data['layout']}", ""]
    lines += [f"Placement: {p}." for p in data["placements"]] + [""]
    if data["target"] is not None:
        op = ">=" if task_data["metric"]["higher_is_better"] else "<="
        ref = data["reference"]
        lines += [
            f"Target: {metric} {op} {_fmt_metric(data['target'])} (the worst final metric of the plain seeds "
            f"{', '.join(map(str, ref['seeds']))}: seed {ref['target_seed']}'s). Plain TTA, mean over those seeds: "
            f"{_fmt_float(ref['tta_s'])} s.",
            "",
        ]
    fair = data.get("mlperf_target")
    if fair is not None:
        op = ">=" if task_data["metric"]["higher_is_better"] else "<="
        lines += [
            f"MLPerf-style target: {metric} {op} {_fmt_metric(fair['target'])} (the worst-case plain curve, "
            f"{_fmt_metric(fair['curve_first'])} at its first record to {_fmt_metric(fair['curve_end'])} at its last, "
            f"with {100 * fair['gain_left']:g}% of that gain still ahead; it gets there at step {fair['step']}). "
            f"Plain TTA, mean over the plain seeds: {_fmt_float(data['reference']['mlperf_tta_s'])} s.",
            "",
        ]
    if not data["same_machine"]:
        lines += ["**The runs of this layout come from different machines: compare their times with care.**", ""]
    if len(data["heaps"]) > 1:
        lines += [
            "**Some runs of this layout fixed their heap thresholds and some did not (`heap`: steady / default): "
            "a default heap can cost 10% or more of a step in page faults, by chance (`egeria.bench.allocator`); "
            "compare their times with care.**",
            "",
        ]
    lines += _table(data, metric)
    lines += [""] + _noise_sentences(data, metric)
    lines += _dominance_lines(data)
    return lines


def _dominance_lines(data: dict) -> list[str]:
    """Which Egeria setting dominates each baseline setting (the frontier goal)."""
    if not data["dominance"]:
        return []
    lines = ["", "Dominance (each baseline setting against the Egeria settings at least as fast, at plain's pace "
             "where the run has one, and at least as far over the worst plain seed; means over seeds):", ""]
    for d in data["dominance"]:
        seeds = ", ".join(map(str, d["seeds"]))
        who = ", ".join(f"`{e}`" for e in d["dominated_by"]) or "no Egeria setting here"
        lines.append(f"- `{d['baseline']}` (seeds {seeds}: {d['speedup']:.2f}x, {d['vs_worst_plain']:+.4g}): "
                     f"dominated by {who}")
    return lines


_LAYOUT_WORDS = (
    "Layouts: **cpu**, training on every core the process may use with as many torch threads, Egeria's "
    "controller where its config puts it (by default inline, between steps); **accel** (the paper's "
    "setting), training on one core with one torch thread, standing for an accelerator, and Egeria's "
    "controller in its own process on the other cores, standing for the host's idle CPU. Runs that "
    "record no layout (made before layouts, format 1) count as the layout a `LAYOUT=PATH` argument or a "
    "`cpu`/`accel`/`runs-cpu`/`runs-accel` folder on their path names, else as accel: they trained "
    "pinned to one core with one torch thread (`taskset`, `OMP_NUM_THREADS=1`), their controller on "
    "that same core."
)

_TTA_WORDS = (
    "TTA: training wall time (evaluation excluded) of the first evaluation whose metric reaches the "
    "target; nothing is interpolated. Target, per task and layout: the *worst* final metric of the plain "
    "(`none`) seeds (the lowest accuracy, the highest perplexity), which every plain seed reaches; earlier "
    "reports took the final metric of the lowest plain seed. TTA speedup: the plain seeds' mean TTA / the "
    "run's. MLPerf-style TTA and its speedup: the same against the MLPerf-style target, fixed from the plain "
    "seeds alone by one rule for every task: the worst-case plain curve (at each record step, the worst of the "
    "plain seeds' best-so-far metrics) runs from F at its first record to E at its last; the target is "
    "E - 1% of (E - F), the quality once 99% of that gain is made, just past the knee where the curve turns "
    "flat, which every plain seed reaches. FLOP-ideal speedup: the plain seeds' mean total FLOPs / the run's total FLOPs. Efficiency: TTA "
    "speedup / FLOP-ideal speedup. Backward FLOPs vs plain: the run's total backward FLOPs / the mean "
    "of the plain seeds that recorded theirs (format-2 runs only). Seed noise: a run's distance from the "
    "plain seeds' mean final metric against their spread (max - min). Ms/step before any freeze: training "
    "time per step up to the run's first freeze (a plain run: over the whole run); runs compared with "
    "each other should show the same pace there, since nothing differs yet. Whole run at plain's pace: the plain "
    "seeds' mean wall time / the run's, the run's scaled by the plain seeds' time / its own at its last record "
    "before the first freeze (the steps that train alike; a run that froze nothing: its last, so 1.00x), so "
    "that a machine running faster or slower for one run than for another does not read as a speedup. The "
    "frontier plot places each run at its speed at "
    "plain's pace where it has one, else at its whole-run speedup (those runs' labels end in \"raw\")."
)


def _markdown(tasks: dict[str, dict], machines: list[dict]) -> str:
    lines = ["# Egeria benchmark report", ""]
    if len(machines) == 1:
        lines.append(f"Machine: {_machine_line(machines[0]['machine'])}.")
    else:
        lines.append(
            f"The runs come from {len(machines)} different machines; wall times (and TTA speedups) "
            "are comparable only between runs of the same machine:"
        )
        for m in machines:
            lines.append(f"- {_machine_line(m['machine'])} ({len(m['runs'])} runs: {', '.join(m['runs'])})")
    lines += ["", _LAYOUT_WORDS, "", _TTA_WORDS]
    for task, task_data in tasks.items():
        lines += ["", f"## {task}", ""]
        if not task_data["same_machine"]:
            lines += ["**The runs of this task come from different machines: compare their times with care.**", ""]
        lines += ["Layouts side by side:", ""] + _side_by_side(task_data)
        for data in task_data["layouts"].values():
            lines += [""] + _layout_section(task_data, data)
        if task_data["plots"]:
            lines.append("")
            for key, name in task_data["plots"].items():
                lines.append(f"![{task} {key.replace('_', ' ')}]({name})")
        commands = [c for data in task_data["layouts"].values() for c in data["commands"]]
        if commands:
            lines += ["", "Commands:", "", "```"] + commands + ["```"]
    return "\n".join(lines) + "\n"


def build_report(runs: list[dict], out_dir: str | PathLike[str], *, plots: bool = True) -> dict:
    """Write ``report.md``, ``report.json`` and per-task PNGs into ``out_dir``.

    Args:
        runs: run dicts, as :func:`load_runs` returns them (a run without a ``layout``
            counts as ``"accel"``).
        out_dir: the output directory (created if missing).
        plots: draw the PNGs (needs matplotlib); without, only the text reports.

    Returns:
        The content of ``report.json``: ``report_format``, ``machines`` (each distinct
        machine, its process fields aside, and its runs) and ``tasks``, per task:
        ``metric``, ``same_machine``, ``plots`` (PNG file names) and ``layouts``, per layout
        (in the order of :data:`~egeria.bench.layouts.LAYOUTS`): ``layout``,
        ``placements``, ``target``, ``mlperf_target`` (target, gain_left, curve_first,
        curve_end, step, plain_seeds; None without two common plain record steps),
        ``reference`` (target_seed, seeds, mean_final, tta_s, mlperf_tta_s,
        total_flops, total_backward_flops), ``rows`` (policy, plain, seed,
        final_metric, wall_time_s, total_flops, reached, tta_s, tta_step, tta_speedup,
        mlperf_reached, mlperf_tta_s, mlperf_tta_step, mlperf_tta_speedup, ideal_speedup,
        efficiency, backward_flops_vs_plain, source; None where a number does not exist),
        ``seed_spread``, ``plain_seeds``, ``seed_noise`` (policy, seed, abs_diff,
        within_noise), ``same_machine``, ``heaps`` (the runs' heaps, ``"default"`` for
        runs that record none) and ``commands``.

    Raises:
        ValueError: no runs, a run of a format this module does not read, runs of one task
            that disagree on the metric, or two runs of the same task, layout, policy and
            seed.
    """
    runs = list(runs)
    if not runs:
        raise ValueError("build_report: no runs")
    for i, r in enumerate(runs):
        check_run(r, r.get("source", f"run {i}") if isinstance(r, dict) else f"run {i}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    by_task: dict[str, dict[str, list[dict]]] = {}
    for r in sorted(runs, key=lambda r: LAYOUTS.index(layout_name(r))):
        by_task.setdefault(str(r["task"]), {}).setdefault(layout_name(r), []).append(r)
    tasks = {}
    for task in sorted(by_task):
        data = _task_report(task, by_task[task])
        if plots:
            groups = {layout: _ordered(group) for layout, group in by_task[task].items()}
            data["plots"] = plot_task(task, groups, data, out)
        tasks[task] = data

    machines: dict[str, dict] = {}
    for r in runs:
        entry = machines.setdefault(_machine_key(r), {"machine": _machine(r), "runs": []})
        entry["runs"].append(f"{layout_name(r)}/{r['task']}/{policy_label(r)}-seed{r['seed']}")
    report = {"report_format": REPORT_FORMAT, "machines": list(machines.values()), "tasks": tasks}

    (out / "report.md").write_text(_markdown(tasks, report["machines"]), encoding="utf-8")
    with open(out / "report.json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, allow_nan=True)
    logger.info("report written to %s", out)
    return report


# ------------------------------------------------------------------------- the results page


def summary_tables(runs: list[dict]) -> list[str]:
    """Short Markdown tables of ``runs`` for a results page, one per task and layout: per run
    its final metric, the whole-run speedup over its twin (the timed plain run of its seed)
    and over the timed plain seeds' mean wall time, the time-to-target speedups, the FLOP-ideal speedup and the code commit, then the machines.
    The numbers are :func:`build_report`'s; nothing is written to disk.

    Raises:
        ValueError: no runs, or runs :func:`build_report` would refuse.
    """
    runs = list(runs)
    if not runs:
        raise ValueError("summary_tables: no runs")
    for i, r in enumerate(runs):
        check_run(r, r.get("source", f"run {i}"))
    by_task: dict[str, dict[str, list[dict]]] = {}
    for r in sorted(runs, key=lambda r: LAYOUTS.index(layout_name(r))):
        by_task.setdefault(str(r["task"]), {}).setdefault(layout_name(r), []).append(r)
    lines: list[str] = []
    for task in sorted(by_task):
        groups = by_task[task]
        task_data = _task_report(task, groups)
        metric = task_data["metric"]["name"]
        for layout, data in task_data["layouts"].items():
            by_source = {r.get("source"): r for r in groups[layout]}
            timed = [row for row in data["rows"] if row["plain"] and not row.get("timing_unreliable")]
            plain_wall = _mean([float(row["wall_time_s"]) for row in timed])
            twins = {row["seed"]: float(row["wall_time_s"]) for row in timed}
            if lines:
                lines.append("")
            lines += [
                f"`{task}`, {layout} layout: {metric}; target {_fmt_metric(data['target'])}, MLPerf-style target "
                f"{_fmt_metric((data['mlperf_target'] or {}).get('target'))}; speedups against the timed plain "
                "seeds' mean, or the timed plain run of the same seed (its twin).",
                "",
                "| policy | seed | final | wall time (s) | whole run vs twin | vs plain mean | at plain's pace "
                "| to target | to MLPerf-style target | FLOP-ideal | code |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            ]
            for row in data["rows"]:
                untimed = bool(row.get("timing_unreliable"))
                whole = None if (untimed or row["plain"]) else _ratio(plain_wall, float(row["wall_time_s"]))
                twin = None if (untimed or row["plain"]) else _ratio(twins.get(row["seed"]), float(row["wall_time_s"]))
                wall = f"{float(row['wall_time_s']):.1f}" + (" (unreliable)" if untimed else "")
                code = str(by_source.get(row["source"], {}).get("code") or "")[:7] or "not recorded"
                lines.append(
                    f"| {row['policy']} | {row['seed']} | {_fmt_metric(row['final_metric'])} | {wall} "
                    f"| {'' if row['plain'] else _fmt_ratio(twin)} | {'' if row['plain'] else _fmt_ratio(whole)} "
                    f"| {'' if row['plain'] else _fmt_ratio(row.get('pace_matched_speedup'))} "
                    f"| {_short_tta(row['reached'], row['tta_speedup'], untimed)} "
                    f"| {_short_tta(row.get('mlperf_reached'), row.get('mlperf_tta_speedup'), untimed)} "
                    f"| {_fmt_ratio(row['ideal_speedup'])} | {code} |"
                )
            machines = sorted({_short_machine(r) for r in groups[layout]})
            lines += ["", "Machine: " + "; ".join(machines) + "."]
    return lines


def _short_machine(run: dict) -> str:
    """The machine in a few words: its CPU and flags, cores and torch."""
    m = _machine(run)
    if not isinstance(m, dict):
        return str(m)
    flags = f" ({', '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    return f"{m.get('cpu', '?')}{flags}, {m.get('cores', '?')} cores, torch {m.get('torch', '?')}"


def _short_tta(reached: bool | None, speedup: float | None, untimed: bool) -> str:
    if not reached:
        return "not reached"
    return "reached" if (untimed or speedup is None) else _fmt_ratio(speedup)
