"""Reading the runner's run files, of either format, each with its layout.

A run file (``egeria bench``, :func:`egeria.bench.run.run_bench`) is one JSON object:

- ``format``: 2 (1 for runs made before layouts); ``task``, ``policy``,
  ``policy_options``, ``seed``, ``epochs``, ``command``, ``machine``, ``config`` (Egeria's
  config as a dict), ``metric`` (``name``, ``higher_is_better``), ``steps_per_epoch``,
  ``total_steps``, ``limit``, ``eval_limit``;
- ``layout`` (format 2): ``name`` (``"cpu"`` or ``"accel"``), ``train_cpus``,
  ``torch_threads``, ``controller_cpus`` (:class:`egeria.bench.layouts.Layout`);
- ``records``: per evaluation ``step``, ``epoch``, ``wall_time_s`` (training time so far,
  evaluation excluded), ``metric``, ``loss``, ``frozen``, ``trainable_share``,
  ``flops_per_step`` (forward and backward), and in format 2 ``backward_flops_per_step`` and
  ``backward_share`` (the backward FLOPs per step over the first step's, nothing frozen);
- ``modules``, ``module_params``, ``total_params``, ``events``, ``plasticity``,
  ``controller``;
- ``final``: ``metric``, ``wall_time_s``, ``total_flops``, and in format 2
  ``total_backward_flops``.

Format 1 is format 2 without ``layout`` and the backward FLOPs. :func:`load_runs` gives each
run without a recorded layout one (``{"name": ..., "inferred_from": ...}``) by the rule in
its docstring, so every loaded run has ``run["layout"]["name"]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from os import PathLike
from pathlib import Path
from typing import Any

from ..config import RULES, EgeriaConfig
from .allocator import HEAPS
from .layouts import LAYOUTS, LEGACY_LAYOUT, layout_of_path, split_layout_prefix

__all__ = ["RUN_FORMAT", "RUN_FORMATS", "load_runs", "check_run", "layout_name", "policy_label"]

logger = logging.getLogger(__name__)

RUN_FORMAT = 2
"""The newest run-file format."""

RUN_FORMATS = (1, 2)
"""The run-file formats this module reads."""

_REQUIRED = (
    "task", "policy", "seed", "metric", "records", "final", "machine",
)  # fmt: skip
_REQUIRED_FINAL = ("metric", "wall_time_s", "total_flops")


def layout_name(run: dict) -> str:
    """The run's layout: the one recorded (or given by :func:`load_runs`), else
    :data:`~egeria.bench.layouts.LEGACY_LAYOUT` (a run made before layouts)."""
    layout = run.get("layout")
    if isinstance(layout, dict) and layout.get("name") is not None:
        return str(layout["name"])
    return LEGACY_LAYOUT


def policy_label(run: dict) -> str:
    """The policy as shown: its name, with its options where it has any, the config
    fields an Egeria run changed from the defaults (``egeria bench --set``) in brackets, and
    ``+cache`` for a run trained through the activation cache (``egeria bench --cache``). Where the
    ``"accel"`` layout runs the controller (``executor``, ``controller_cpus``) is the
    layout's, shown with it, not here."""
    label = str(run["policy"])
    options = run.get("policy_options") or {}
    if options:
        label += "(" + ", ".join(f"{k}={v}" for k, v in sorted(options.items())) + ")"
    # Egeria's config fields matter to Egeria's policy only (the baselines have no controller).
    changed = _changed_fields(run.get("config") or {}, run.get("layout") or {"name": LEGACY_LAYOUT}) if label == "egeria" else {}
    if changed:
        label += "[" + ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) + "]"
    if run.get("cache"):
        label += "+cache"
    return label


def _changed_fields(config: dict, layout: Any) -> dict:
    """Fields of a recorded config that differ from today's defaults for the rule it ran
    (the policy aside, and under ``"accel"`` where the controller runs, which is the
    layout's); fields it does not record are left out. The rule shows where it is not
    today's default one; a run that records no rule predates them and ran the paper's.
    Fields that follow the speed (the horizon) are compared with the defaults at the run's
    speed, so a run at ``speed="fast"`` reads ``speed=fast`` alone."""
    if not config:
        return {}  # a run that records no config says nothing about it
    today = EgeriaConfig()
    rule = config.get("rule", "paper")
    rule = rule if rule in RULES else today.rule
    try:
        defaults = EgeriaConfig(rule=rule, speed=config.get("speed", today.speed)).to_dict()
    except (TypeError, ValueError):  # a speed today's config does not take: shown as changed below
        defaults = EgeriaConfig(rule=rule).to_dict()
    defaults["speed"] = today.speed
    skip = {"policy", "policy_options"}
    if isinstance(layout, dict) and layout.get("name") == "accel":
        skip |= {"executor", "controller_cpus"}
    changed = {k: v for k, v in config.items() if k in defaults and k not in skip and v != defaults[k]}
    if rule != today.rule:
        changed["rule"] = rule
    return changed


def load_runs(paths: Iterable[str | PathLike[str]] | str | PathLike[str]) -> list[dict]:
    """Read run files (formats 1 and 2) from files and directories.

    A named file must be a run file. Directories are searched recursively for ``*.json``;
    JSON files there without a ``format`` key (e.g. an earlier ``report.json``) are skipped,
    while one with a ``format`` this module does not read is an error. The same file
    reached twice is read once.

    A run's layout is the one it recorded. A run that records none (format 1) gets, in this
    order: the layout of a ``LAYOUT=PATH`` argument (``"accel=benchmarks/old-runs"``), else
    the nearest folder on its path named ``cpu``, ``accel``, ``runs-cpu`` or ``runs-accel``,
    else ``"accel"``, the layout every run made before layouts was made in (one core, one
    torch thread).

    Args:
        paths: files and/or directories, each optionally prefixed ``cpu=`` or ``accel=``
            (a single path is accepted too).

    Returns:
        The run dicts as stored, each with ``"source"`` (its path) added, and
        ``"layout"`` where it recorded none; ordered by task, layout, policy and seed.

    Raises:
        ValueError: a path does not exist, a file is not valid JSON or not a run file of a
            format this module reads (naming the file and what is wrong), a ``LAYOUT=``
            prefix contradicts the layout a run recorded, or no run file was found at all.
    """
    if isinstance(paths, (str, PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise ValueError("load_runs: no paths given")
    runs: list[dict] = []
    seen: set[Path] = set()
    for raw in paths:
        given, text = split_layout_prefix(str(raw))
        path = Path(text)
        if path.is_dir():
            for file in sorted(path.rglob("*.json")):
                run = _read_json(file)
                if not isinstance(run, dict) or "format" not in run:
                    logger.debug("skipping %s: not a run file (no 'format' key)", file)
                    continue
                _add_run(runs, seen, file, run, given)
        elif path.is_file():
            _add_run(runs, seen, path, _read_json(path), given)
        else:
            raise ValueError(f"load_runs: {text!r} is neither a file nor a directory")
    if not runs:
        raise ValueError(
            f"load_runs: no run files (JSON with \"format\" in {list(RUN_FORMATS)}) found in "
            + ", ".join(repr(str(p)) for p in paths)
        )
    runs.sort(key=lambda r: (str(r["task"]), LAYOUTS.index(layout_name(r)), str(r["policy"]), r["seed"]))
    return runs


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _add_run(runs: list[dict], seen: set[Path], path: Path, run: Any, given: str | None) -> None:
    key = path.resolve()
    if key in seen:
        return
    seen.add(key)
    check_run(run, str(path))
    run = {**run, "source": str(path)}
    if isinstance(run.get("layout"), dict):
        if given is not None and run["layout"]["name"] != given:
            raise ValueError(
                f"{path}: recorded layout {run['layout']['name']!r} but the argument says {given}=; "
                "a recorded layout cannot be overridden"
            )
    elif given is not None:
        run["layout"] = {"name": given, "inferred_from": "argument"}
    elif (folder := layout_of_path(path)) is not None:
        run["layout"] = {"name": folder, "inferred_from": "folder"}
    else:
        run["layout"] = {"name": LEGACY_LAYOUT, "inferred_from": "default"}
    runs.append(run)


def check_run(run: Any, where: str) -> None:
    """Raise ValueError unless ``run`` has the fields of its format that reports read."""
    if not isinstance(run, dict):
        raise ValueError(f"{where}: a run must be a JSON object, got {type(run).__name__}")
    if run.get("format") not in RUN_FORMATS:
        raise ValueError(
            f"{where}: not an egeria run file of format {' or '.join(map(str, RUN_FORMATS))} "
            f"(format={run.get('format')!r})"
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
    if run.get("heap", "default") not in HEAPS:
        raise ValueError(f"{where}: 'heap' must be {' or '.join(map(repr, HEAPS))}, got {run['heap']!r}")
    note = run.get("timing_unreliable")
    if note is not None and (not isinstance(note, str) or not note.strip()):
        raise ValueError(f"{where}: 'timing_unreliable' must say why in words, got {note!r}")
    layout = run.get("layout")
    if run["format"] >= 2 and "layout" not in run:
        raise ValueError(f"{where}: a format-{run['format']} run must record its layout")
    if layout is not None and (not isinstance(layout, dict) or layout.get("name") not in LAYOUTS):
        raise ValueError(f"{where}: 'layout' must be a dict whose name is one of {list(LAYOUTS)}, got {layout!r}")
