"""One benchmark run: a task trained under one freezing policy, recorded into one JSON.

A run trains in one of two layouts (:mod:`egeria.bench.layouts`): ``"cpu"``, on every core
the process may use, or ``"accel"``, on one core with one thread beside Egeria's controller
process on the other cores. The run pins itself for its length and records the layout.

At a fixed cadence it records training wall time (evaluation excluded), the validation
metric, the frozen modules, the trainable share of parameters and the FLOPs one training
step executes with the current frozen set, the backward's apart (counted by
``torch.utils.flop_counter`` on the first step after every change of the frozen set).
Egeria's plasticity readings and every freeze/unfreeze event go in too. Unless told
otherwise the process fixes its glibc heap thresholds first (:mod:`egeria.bench.allocator`), for
every policy alike, and records that. The schema is
documented in ``egeria.bench.report``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Mapping

import torch

from ..checks import check_int
from ..config import EgeriaConfig
from ..engine import Egeria
from .allocator import HEAPS, heap_state, steady_heap
from .flops import share
from .harness import StepResult, train
from .layouts import pinned, resolve_layout
from .machine import describe_machine
from .tasks import Task, build_task

__all__ = ["run_bench", "POLICY_NAMES", "HEAPS", "FORMAT"]

logger = logging.getLogger(__name__)

FORMAT = 2
"""The run-file format written: 2 added ``layout`` and the backward FLOPs (format 1 had
neither; :mod:`egeria.bench.report` reads both)."""
POLICY_NAMES = ("egeria", "freezeout", "autofreeze", "linear", "static", "smartfrz", "none")


def run_bench(
    task_name: str,
    policy: str,
    *,
    seed: int = 0,
    epochs: int | None = None,
    out_dir: str | Path = "benchmarks/results/runs",
    layout: str = "cpu",
    limit: int | None = None,
    eval_limit: int | None = None,
    records_per_epoch: int = 1,
    init: str | Path | None = None,
    config: EgeriaConfig | None = None,
    overrides: Mapping[str, Any] | None = None,
    command: str | None = None,
    progress: bool = False,
    cache: bool = False,
    snapshots: bool = False,
    heap: str = "steady",
) -> dict:
    """Trains ``task_name`` under ``policy`` in ``layout`` and writes
    ``<out_dir>/<layout>/<task>/<policy>-seed<seed>.json`` (``<policy>-cache-seed<seed>.json``
    with ``cache``).

    The trained weights go next to it as ``.pt`` (the fine-tuning task starts from the
    ``resnet-fmnist`` weights of the plain run). The process is pinned to the layout's
    training cores and torch threads for the run and restored after.

    Args:
        policy: one of :data:`POLICY_NAMES`.
        epochs: override the task's default number of epochs.
        out_dir: the runs' root folder.
        layout: ``"cpu"`` or ``"accel"`` (:func:`egeria.bench.layouts.resolve_layout`);
            under ``"accel"`` Egeria's config gets ``executor="process"`` and the
            controller's cores (``overrides`` still win).
        limit, eval_limit: first samples of the training / validation data only.
        records_per_epoch: records (with an evaluation) per epoch.
        init: checkpoint to start from (``finetune-mnist``); by default the plain
            ``resnet-fmnist`` run's weights in ``out_dir/layout``.
        config: Egeria's config for ``policy="egeria"`` (default: the paper's defaults).
        overrides: config fields to change from the defaults (or from ``config``), e.g.
            ``{"eval_interval": 20}``; an unknown field raises ``ValueError``.
        command: the command line to record.
        cache: train from :meth:`Egeria.cache_loader` (the frozen prefix's outputs cached
            and its forward pass skipped where that is faster); the run records the
            cache's summary. FLOPs are counted when the frozen set changes, before the
            cache can serve it, so they stay those of the full forward; the wall time
            shows the cache's effect.
        snapshots: also save the model's weights at every record, outside the timed
            training, as ``<stem>-snapshots/step<N>.pt`` beside the JSON (for the post-hoc
            study of when each module converged, ``benchmarks/studies/oracle.py``).
        heap: ``"steady"`` fixes this process's glibc heap thresholds before training
            (:func:`egeria.bench.allocator.steady_heap`: no page faults per step by the chance of
            the first allocations, for every policy alike); ``"default"`` leaves the heap as
            the process started. The run records the heap it trained with
            (:func:`egeria.bench.allocator.heap_state`: ``"default"`` where the C library is not
            glibc, ``"steady"`` where the process fixed it before, whatever ``heap`` says).

    Returns:
        The recorded run (also written as JSON).

    Raises:
        ValueError: an unknown task, policy or layout, too few cores for the layout, a bad
            ``records_per_epoch`` or override, or a missing fine-tuning checkpoint.
    """
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICY_NAMES)}")
    check_int(records_per_epoch, "records_per_epoch")
    if heap not in HEAPS:
        raise ValueError(f"unknown heap {heap!r}; choose one of {list(HEAPS)}")
    place = resolve_layout(layout)
    out = Path(out_dir) / layout
    if task_name == "finetune-mnist" and init is None:
        init = out / "resnet-fmnist" / "none-seed0.pt"
    if heap == "steady":
        steady_heap()
    with pinned(place):
        return _run(
            task_name, policy, seed=seed, epochs=epochs, out=out, layout=place.to_dict(), limit=limit,
            eval_limit=eval_limit, records_per_epoch=records_per_epoch, init=init, config=config,
            overrides={**place.config_overrides(policy), **(overrides or {})}, command=command, progress=progress,
            cache=cache, snapshots=snapshots,
        )


def _run(
    task_name: str,
    policy: str,
    *,
    seed: int,
    epochs: int | None,
    out: Path,
    layout: dict,
    limit: int | None,
    eval_limit: int | None,
    records_per_epoch: int,
    init: str | Path | None,
    config: EgeriaConfig | None,
    overrides: Mapping[str, Any],
    command: str | None,
    progress: bool,
    cache: bool,
    snapshots: bool = False,
) -> dict:
    """:func:`run_bench` inside its layout: trains and writes ``out/<task>/<stem>.json``."""
    task, epochs = build_task(task_name, seed=seed, epochs=epochs, limit=limit, eval_limit=eval_limit, init=init)
    total_steps = task.steps_per_epoch * epochs
    if policy == "egeria":
        cfg = config or EgeriaConfig()
    else:
        cfg = EgeriaConfig(policy=policy, policy_options=task.policy_options[policy])
    if overrides:
        cfg = cfg.replace(**overrides)
    eg = Egeria(task.model, task.optimizer, config=cfg, lr_scheduler=task.scheduler, total_steps=total_steps)
    record_every = max(1, task.steps_per_epoch // records_per_epoch)
    batches = task.batches
    if cache:
        cached = eg.cache_loader(task.batches())
        batches = lambda: cached  # noqa: E731 - the same wrapped loader every epoch

    result: dict[str, Any] = {
        "format": FORMAT,
        "task": task_name,
        "policy": policy,
        "policy_options": dict(cfg.policy_options),
        "seed": seed,
        "epochs": epochs,
        "command": command
        or f"egeria bench {task_name} --policy {policy} --seed {seed} --layout {layout['name']}" + (" --cache" if cache else ""),
        "machine": describe_machine(),
        "code": _code_commit(),
        "layout": layout,
        "config": cfg.to_dict(),
        "metric": {"name": task.metric, "higher_is_better": task.higher_is_better},
        "steps_per_epoch": task.steps_per_epoch,
        "total_steps": total_steps,
        "limit": limit,
        "eval_limit": eval_limit,
        "cache": cache,
        "heap": heap_state(),  # this process's, whatever asked for it
    }
    target = out / task_name / f"{policy}{'-cache' if cache else ''}-seed{seed}.json"
    snapshot_dir = target.with_name(target.stem + "-snapshots") if snapshots else None
    if snapshot_dir is not None:
        snapshot_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    losses: list[float] = []
    first: list[StepResult] = []  # the first step: nothing frozen yet
    bar = _progress(total_steps, f"{task_name}/{policy}", progress)

    def on_step(result: StepResult) -> None:
        if not first:
            first.append(result)
        losses.append(result.loss)
        bar.update(1)

    def record(result: StepResult) -> None:
        records.append(_record(eg, task, result, losses, first[0].backward_flops))
        losses.clear()
        if snapshot_dir is not None:
            torch.save(task.model.state_dict(), snapshot_dir / f"step{result.step}.pt")

    try:
        steps = train(
            task.model, task.optimizer, batches, task.loss, epochs=epochs, scheduler=task.scheduler, egeria=eg,
            count_flops=True, on_step=on_step, evaluate=record, eval_every=record_every,
        )
    finally:
        bar.close()
    wall = steps[-1].train_time_s
    total_flops = sum(r.flops or 0.0 for r in steps)
    total_backward = sum(r.backward_flops or 0.0 for r in steps)
    partition = eg.partition
    total_params = sum(m.num_params for m in partition.modules)
    result.update(
        {
            "modules": partition.names,
            "freezable": partition.freezable,  # how many leading modules may freeze
            "cap": partition.cap,  # of them, how many may freeze while they still move (None: all)
            "module_params": [m.num_params for m in partition.modules],
            "total_params": total_params,
            "records": records,
            "events": [d.to_dict() for d in eg.events],
            "plasticity": eg.history,
            "memory": eg.memory_history,  # bytes by part, sampled and around each change (egeria.memory)
            "controller": eg.controller_stats,
            "cache_stats": _cache_summary(eg) if cache else None,
            "final": {
                "metric": records[-1]["metric"],
                "wall_time_s": wall,
                "total_flops": total_flops,
                "total_backward_flops": total_backward,
            },
        }
    )
    eg.close()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1))
    torch.save(task.model.state_dict(), target.with_suffix(".pt"))
    logger.info("wrote %s", target)
    return result


def _code_commit() -> str | None:
    """The git commit of the egeria source this run used (the rule's behaviour can change
    with the code while its config fields stay the same), or None outside a checkout."""
    import subprocess

    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _cache_summary(eg: Egeria) -> dict:
    """The cache's counters and, per frozen-prefix level, where it kept its rows (disk file
    paths left out: they are temporary)."""
    summary = eg.cache_stats
    for level in summary.get("levels", {}).values():
        level.pop("files", None)
    return summary


def _record(eg: Egeria, task: Task, result: StepResult, losses: list[float], first_backward: float | None) -> dict:
    """One record after ``result``'s step (the model is in eval mode); ``losses``: the
    training losses since the previous record; ``first_backward``: the backward FLOPs of
    the first step, with nothing frozen."""
    metric = float(task.evaluate(task.model))
    partition = eg.partition
    frozen = set(eg.frozen)
    total = sum(m.num_params for m in partition.modules)
    trainable = sum(m.num_params for m in partition.modules if m.name not in frozen)
    finite = [v for v in losses if math.isfinite(v)]
    return {
        "step": result.step,
        "epoch": result.step / task.steps_per_epoch,
        "wall_time_s": result.train_time_s,
        "metric": metric,
        "loss": sum(finite) / len(finite) if finite else None,
        "frozen": list(eg.frozen),
        "trainable_share": trainable / total if total else 1.0,
        "flops_per_step": result.flops,
        "backward_flops_per_step": result.backward_flops,
        "backward_share": share(result.backward_flops, first_backward),
    }


def _progress(total: int, label: str, enabled: bool) -> Any:
    if enabled:
        from tqdm import tqdm

        return tqdm(total=total, desc=label, unit="step")

    class _Silent:
        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            pass

    return _Silent()
