"""Benchmark report: tables, seed-noise statements and plots from the runner's run files.

The runner writes one JSON file per training run (``<out>/<task>/<policy>-seed<S>.json``,
``"format": 1``). :func:`load_runs` reads them; :func:`build_report` writes, per task, what
the paper's section 6 shows:

- a time-to-accuracy table (Table 1): the target is the *final* metric of the plain run
  (``policy == "none"``, lowest seed); a run's TTA is the ``wall_time_s`` of its first record
  (or its final evaluation) whose metric reaches the target (``>=``, or ``<=`` where lower is
  better, e.g. perplexity). Nothing is interpolated: a run that never reaches the target is
  "not reached". Beside the measured TTA speedup stand the *ideal* speedup (plain total FLOPs /
  the run's total FLOPs, what the saved computation alone would give) and the efficiency
  (measured / ideal);
- whether each policy's final metric differs from the plain run's by less than the
  seed-to-seed spread of the plain runs (unknown with a single plain seed);
- metric against wall time (Figure 8), trainable parameter share over steps (Figure 11) and
  plasticity per module over steps for Egeria runs (Figure 4).

Output: ``report.md``, ``report.json`` and ``<task>-*.png`` in the output directory.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from os import PathLike
from pathlib import Path
from typing import Any, Callable

from ..config import EgeriaConfig

__all__ = ["RUN_FORMAT", "REPORT_FORMAT", "load_runs", "build_report"]

logger = logging.getLogger(__name__)

RUN_FORMAT = 1
"""The run-file format this module reads."""

REPORT_FORMAT = 1
"""The format of ``report.json`` (key ``report_format``; run files use ``format``)."""

NOT_REACHED = "not reached"

_REQUIRED = (
    "task", "policy", "seed", "metric", "records", "final", "machine",
)  # fmt: skip
_REQUIRED_FINAL = ("metric", "wall_time_s", "total_flops")


# ---------------------------------------------------------------------------------- loading


def load_runs(paths: Iterable[str | PathLike[str]] | str | PathLike[str]) -> list[dict]:
    """Read run files (format 1) from files and directories.

    A named file must be a format-1 run file. Directories are searched recursively for
    ``*.json``; JSON files there without a ``format`` key (e.g. an earlier ``report.json``)
    are skipped, while one with a ``format`` other than 1 is an error (a run this module
    cannot read). The same file reached twice is read once.

    Args:
        paths: files and/or directories (a single path is accepted too).

    Returns:
        The run dicts as stored, each with ``"source"`` (its path) added, ordered by task,
        policy and seed.

    Raises:
        ValueError: a path does not exist, a file is not valid JSON or not a format-1 run
            (naming the file and what is wrong), or no run file was found at all.
    """
    if isinstance(paths, (str, PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError("load_runs: no paths given")
    runs: list[dict] = []
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for file in sorted(path.rglob("*.json")):
                run = _read_json(file)
                if not isinstance(run, dict) or "format" not in run:
                    logger.debug("skipping %s: not a run file (no 'format' key)", file)
                    continue
                _add_run(runs, seen, file, run)
        elif path.is_file():
            _add_run(runs, seen, path, _read_json(path))
        else:
            raise ValueError(f"load_runs: {str(path)!r} is neither a file nor a directory")
    if not runs:
        raise ValueError(
            f"load_runs: no run files (JSON with \"format\": {RUN_FORMAT}) found in "
            + ", ".join(repr(str(p)) for p in paths)
        )
    runs.sort(key=lambda r: (str(r["task"]), str(r["policy"]), r["seed"]))
    return runs


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _add_run(runs: list[dict], seen: set[Path], path: Path, run: Any) -> None:
    key = path.resolve()
    if key in seen:
        return
    seen.add(key)
    _check_run(run, str(path))
    runs.append({**run, "source": str(path)})


def _check_run(run: Any, where: str) -> None:
    """Raise ValueError unless ``run`` has the format-1 fields this module reads."""
    if not isinstance(run, dict):
        raise ValueError(f"{where}: a run must be a JSON object, got {type(run).__name__}")
    if run.get("format") != RUN_FORMAT:
        raise ValueError(
            f"{where}: not an egeria run file of format {RUN_FORMAT} (format={run.get('format')!r})"
        )
    missing = [k for k in _REQUIRED if k not in run]
    if missing:
        raise ValueError(f"{where}: run file lacks {', '.join(missing)}")
    if not isinstance(run["final"], dict) or any(k not in run["final"] for k in _REQUIRED_FINAL):
        raise ValueError(f"{where}: 'final' must hold {', '.join(_REQUIRED_FINAL)}")
    for key in _REQUIRED_FINAL:
        value = run["final"][key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: final.{key} must be a number, got {value!r}")
    metric = run["metric"]
    if not isinstance(metric, dict) or "name" not in metric or "higher_is_better" not in metric:
        raise ValueError(f"{where}: 'metric' must hold name and higher_is_better, got {metric!r}")
    if not isinstance(run["records"], list):
        raise ValueError(f"{where}: 'records' must be a list")


# ------------------------------------------------------------------------------- the numbers


def _label(run: dict) -> str:
    """The policy as shown: its name, with its options where it has any, and the config
    fields the run changed from the defaults (``egeria bench --set``) in brackets."""
    label = str(run["policy"])
    options = run.get("policy_options") or {}
    if options:
        label += "(" + ", ".join(f"{k}={v}" for k, v in sorted(options.items())) + ")"
    changed = _changed_fields(run.get("config") or {})
    if changed:
        label += "[" + ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) + "]"
    return label


def _changed_fields(config: dict) -> dict:
    """Fields of a recorded config that differ from today's defaults (the policy aside);
    fields it does not record are left out."""
    defaults = EgeriaConfig().to_dict()
    return {
        k: v for k, v in config.items()
        if k in defaults and k not in ("policy", "policy_options") and v != defaults[k]
    }


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


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den or not math.isfinite(num) or not math.isfinite(den):
        return None
    return num / den


def _machine_key(machine: Any) -> str:
    return json.dumps(machine, sort_keys=True)


def _machine_line(machine: Any) -> str:
    """All the machine's fields, platform, cpu, cores and torch first."""
    if not isinstance(machine, dict) or not machine:
        return str(machine)
    first = [k for k in ("platform", "cpu", "cores", "torch") if k in machine]
    keys = first + sorted(k for k in machine if k not in first)
    return ", ".join(f"{k}: {machine[k]}" for k in keys)


def _task_report(task: str, runs: list[dict]) -> dict:
    """The numbers of one task (no files written)."""
    metrics = {(r["metric"]["name"], bool(r["metric"]["higher_is_better"])) for r in runs}
    if len(metrics) != 1:
        raise ValueError(f"task {task!r}: runs disagree on the metric: {sorted(metrics)}")
    (metric_name, higher), = metrics
    seen: dict[tuple[str, Any], str] = {}
    for r in runs:
        key = (_label(r), r["seed"])
        if key in seen:
            raise ValueError(
                f"task {task!r}: two runs of policy {key[0]!r} seed {key[1]!r}: "
                f"{seen[key]} and {r.get('source', '?')}"
            )
        seen[key] = r.get("source", "?")

    plain = sorted((r for r in runs if r["policy"] == "none"), key=lambda r: r["seed"])
    ref = plain[0] if plain else None
    target = float(ref["final"]["metric"]) if ref else None
    ref_tta = _time_to_target(ref, target, higher) if ref else None
    ref_flops = float(ref["final"]["total_flops"]) if ref else None

    ordered = sorted(runs, key=lambda r: (r["policy"] != "none", _label(r), r["seed"]))
    rows = []
    for r in ordered:
        tta = _time_to_target(r, target, higher) if ref else None
        speedup = _ratio(ref_tta[0], tta[0]) if (ref_tta and tta) else None
        ideal = _ratio(ref_flops, float(r["final"]["total_flops"])) if ref else None
        rows.append({
            "policy": _label(r),
            "seed": r["seed"],
            "final_metric": r["final"]["metric"],
            "wall_time_s": r["final"]["wall_time_s"],
            "total_flops": r["final"]["total_flops"],
            "reached": tta is not None,
            "tta_s": tta[0] if tta else None,
            "tta_step": tta[1] if tta else None,
            "tta_speedup": speedup,
            "ideal_speedup": ideal,
            "efficiency": _ratio(speedup, ideal),
            "source": r.get("source"),
        })

    # Seed noise: the spread of the plain runs' final metrics (max - min; with two seeds,
    # the difference of the two).
    finals = [float(r["final"]["metric"]) for r in plain]
    spread = (max(finals) - min(finals)) if len(finals) >= 2 else None
    noise = []
    for row in rows:
        if row["policy"] == "none":
            continue
        diff = abs(float(row["final_metric"]) - target) if target is not None else None
        within = (diff < spread) if (diff is not None and spread is not None) else None
        noise.append({"policy": row["policy"], "seed": row["seed"], "abs_diff": diff, "within_noise": within})

    machines = {_machine_key(r["machine"]) for r in runs}
    return {
        "task": task,
        "metric": {"name": metric_name, "higher_is_better": higher},
        "target": target,
        "reference": {"policy": "none", "seed": ref["seed"], "source": ref.get("source")} if ref else None,
        "rows": rows,
        "seed_spread": spread,
        "plain_seeds": [r["seed"] for r in plain],
        "seed_noise": noise,
        "same_machine": len(machines) == 1,
        "commands": [r["command"] for r in ordered if r.get("command")],
        "plots": {},
    }


# ------------------------------------------------------------------------------------ plots


def _new_figure(nrows: int = 1, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, height * nrows))
    FigureCanvasAgg(fig)
    return fig


def _plot_records(ax: Any, runs: list[dict], x: str, y: Callable[[dict], float | None], **style: Any) -> None:
    """One line per run through its records' (``rec[x]``, ``y(rec)``) points."""
    for r in runs:
        pts = [(rec[x], y(rec)) for rec in r["records"] if rec.get(x) is not None and y(rec) is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=f"{_label(r)} seed {r['seed']}", **style)


def _trainable_percent(rec: dict) -> float | None:
    share = rec.get("trainable_share")
    return None if share is None else 100.0 * share


def _save(fig: Any, out: Path, name: str) -> str:
    fig.savefig(out / name, dpi=110, bbox_inches="tight")
    return name


def _plot_task(task: str, runs: list[dict], data: dict, out: Path) -> dict[str, str]:
    """Write the task's PNGs (lazy matplotlib, Agg canvas; no pyplot state); return names."""
    files: dict[str, str] = {}
    ordered = sorted(runs, key=lambda r: (r["policy"] != "none", _label(r), r["seed"]))

    # Figure 8: metric against wall time, with the target dotted.
    fig = _new_figure()
    ax = fig.add_subplot(1, 1, 1)
    _plot_records(ax, ordered, "wall_time_s", lambda rec: rec.get("metric"), marker=".")
    if data["target"] is not None:
        ax.axhline(data["target"], linestyle=":", color="black", label="target")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel(data["metric"]["name"])
    ax.set_title(f"{task}: {data['metric']['name']} vs wall time")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    files["metric_vs_time"] = _save(fig, out, f"{task}-metric-vs-time.png")

    # Figure 11: share of parameters trainable over steps.
    fig = _new_figure()
    ax = fig.add_subplot(1, 1, 1)
    _plot_records(ax, ordered, "step", _trainable_percent, drawstyle="steps-post")
    ax.set_xlabel("training step")
    ax.set_ylabel("trainable parameters (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{task}: trainable parameter share")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    files["trainable_share"] = _save(fig, out, f"{task}-trainable-share.png")

    # Figure 4: plasticity per module, log scale, one panel per run that has readings.
    with_plasticity = [r for r in ordered if r.get("plasticity")]
    if with_plasticity:
        fig = _new_figure(len(with_plasticity), height=3.5)
        for i, r in enumerate(with_plasticity):
            ax = fig.add_subplot(len(with_plasticity), 1, i + 1)
            by_module: dict[str, list[tuple[int, float]]] = {}
            for p in r["plasticity"]:
                value = p.get("plasticity")
                if value is not None and value > 0:  # a log axis cannot show 0
                    by_module.setdefault(p["module"], []).append((p["step"], value))
            modules = r.get("modules") or []
            for module in sorted(by_module, key=lambda m: (modules.index(m) if m in modules else len(modules), m)):
                xs, ys = zip(*by_module[module])
                ax.plot(xs, ys, label=module)
            ax.set_yscale("log")
            ax.set_xlabel("training step")
            ax.set_ylabel("plasticity")
            ax.set_title(f"{task}: plasticity, {_label(r)} seed {r['seed']}")
            if by_module:
                ax.legend(fontsize="x-small", ncol=2)
            ax.grid(alpha=0.3, which="both")
        files["plasticity"] = _save(fig, out, f"{task}-plasticity.png")
    return files


# ---------------------------------------------------------------------------------- writing


def _fmt_metric(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.5g}"


def _fmt_float(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _table(data: dict) -> list[str]:
    m = data["metric"]["name"]
    lines = [
        f"| policy | seed | final {m} | wall time (s) | TTA (s) | TTA speedup | ideal speedup | efficiency |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["rows"]:
        if data["target"] is None:
            tta = "no target"
        elif row["reached"]:
            tta = f"{row['tta_s']:.1f}"
        else:
            tta = NOT_REACHED
        lines.append(
            f"| {row['policy']} | {row['seed']} | {_fmt_metric(row['final_metric'])} | {row['wall_time_s']:.1f} "
            f"| {tta} | {_fmt_ratio(row['tta_speedup'])} | {_fmt_ratio(row['ideal_speedup'])} "
            f"| {_fmt_float(row['efficiency'])} |"
        )
    return lines


def _noise_sentences(data: dict) -> list[str]:
    if data["target"] is None:
        return ["No plain run (`none`) for this task: no target, so neither TTA nor seed noise can be judged."]
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
    out = [f"Seed-to-seed spread of the plain runs (seeds {seeds}): {_fmt_metric(spread)} ({data['metric']['name']})."]
    for n in data["seed_noise"]:
        head = f"- {n['policy']} seed {n['seed']}: |final - plain final| = {_fmt_metric(n['abs_diff'])}"
        if n["within_noise"]:
            out.append(f"{head} < spread {_fmt_metric(spread)}: the difference is within seed noise.")
        else:
            out.append(f"{head} >= spread {_fmt_metric(spread)}: the difference is larger than seed noise.")
    return out


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
    lines += [
        "",
        "TTA: training wall time (evaluation excluded) of the first evaluation whose metric reaches the "
        "target, the final metric of the plain run (`none`, lowest seed); nothing is interpolated. "
        "Ideal speedup: plain total FLOPs / the run's total FLOPs. Efficiency: TTA speedup / ideal speedup.",
    ]
    for task, data in tasks.items():
        lines += ["", f"## {task}", ""]
        if data["target"] is not None:
            op = ">=" if data["metric"]["higher_is_better"] else "<="
            lines.append(
                f"Target: {data['metric']['name']} {op} {_fmt_metric(data['target'])} "
                f"(final metric of `none` seed {data['reference']['seed']})."
            )
            lines.append("")
        if not data["same_machine"]:
            lines += ["**The runs of this task come from different machines: compare their times with care.**", ""]
        lines += _table(data)
        lines += [""] + _noise_sentences(data)
        if data["plots"]:
            lines.append("")
            for key, name in data["plots"].items():
                lines.append(f"![{task} {key.replace('_', ' ')}]({name})")
        if data["commands"]:
            lines += ["", "Commands:", "", "```"] + data["commands"] + ["```"]
    return "\n".join(lines) + "\n"


def build_report(runs: list[dict], out_dir: str | PathLike[str], *, plots: bool = True) -> dict:
    """Write ``report.md``, ``report.json`` and per-task PNGs into ``out_dir``.

    Args:
        runs: run dicts of format 1, as :func:`load_runs` returns them.
        out_dir: the output directory (created if missing).
        plots: draw the PNGs (needs matplotlib); without, only the text reports.

    Returns:
        The content of ``report.json``: ``report_format``, ``machines`` (each distinct
        machine and its runs) and ``tasks``, per task: ``metric``, ``target``, ``reference``,
        ``rows`` (policy, seed, final_metric, wall_time_s, total_flops, reached, tta_s,
        tta_step, tta_speedup, ideal_speedup, efficiency, source; None where a number does
        not exist), ``seed_spread``, ``plain_seeds``, ``seed_noise`` (policy, seed, abs_diff,
        within_noise), ``same_machine``, ``commands`` and ``plots`` (PNG file names).

    Raises:
        ValueError: no runs, a run that is not format 1, runs of one task that disagree on
            the metric, or two runs of the same task, policy and seed.
    """
    runs = list(runs)
    if not runs:
        raise ValueError("build_report: no runs")
    for i, r in enumerate(runs):
        _check_run(r, r.get("source", f"run {i}") if isinstance(r, dict) else f"run {i}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    by_task: dict[str, list[dict]] = {}
    for r in runs:
        by_task.setdefault(str(r["task"]), []).append(r)
    tasks = {}
    for task in sorted(by_task):
        data = _task_report(task, by_task[task])
        if plots:
            data["plots"] = _plot_task(task, by_task[task], data, out)
        tasks[task] = data

    machines: dict[str, dict] = {}
    for r in runs:
        entry = machines.setdefault(_machine_key(r["machine"]), {"machine": r["machine"], "runs": []})
        entry["runs"].append(f"{r['task']}/{_label(r)}-seed{r['seed']}")
    report = {"report_format": REPORT_FORMAT, "machines": list(machines.values()), "tasks": tasks}

    (out / "report.md").write_text(_markdown(tasks, report["machines"]), encoding="utf-8")
    with open(out / "report.json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, allow_nan=True)
    logger.info("report written to %s", out)
    return report
