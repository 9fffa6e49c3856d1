"""Where a benchmark run trains and where Egeria's controller runs: the two layouts.

- ``"cpu"`` (CPU-only training): training uses every core the process may use, with as
  many torch threads; Egeria's controller runs where its config decides (the default
  ``EgeriaConfig(executor="auto")`` runs it inline, between steps, for a model on the CPU).
- ``"accel"`` (the paper's setting, an accelerator beside an idle host CPU): training is
  pinned to ONE core with ONE torch thread, standing for the accelerator; Egeria's
  controller runs in its own process (``executor="process"``) pinned to the other cores
  (``controller_cpus``), standing for the host's idle cores. Runs of the other policies
  train on the same single core; they have no controller.

:func:`resolve_layout` turns a layout's name into the cores and threads (a
:class:`Layout`); :func:`pinned` applies it to the calling process for the length of a run.

Reports read the layout a run recorded; runs without one are placed by
:func:`layout_of_path` (a ``LAYOUT=`` prefix, or a folder named for a layout), else they
count as :data:`LEGACY_LAYOUT`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Iterable, Iterator

import torch

__all__ = [
    "LAYOUTS",
    "LEGACY_LAYOUT",
    "Layout",
    "resolve_layout",
    "usable_cpus",
    "pinned",
    "split_layout_prefix",
    "layout_of_path",
]

LAYOUTS = ("cpu", "accel")
"""The layout names, in the order reports show them."""

LEGACY_LAYOUT = "accel"
"""The layout of runs that record none. Every run made before layouts existed (the
committed ``benchmarks/results/runs/<task>/*.json``, format 1) was made by
``benchmarks/run_tta.sh`` pinned to one core (``taskset``) with one torch thread
(``OMP_NUM_THREADS=1``), and Egeria's runs among them used the process executor of the
time: the accel layout, except that the controller shared the training core."""

# Folder names that place the runs under them in a layout (the nearest one wins).
_FOLDERS = {"cpu": "cpu", "accel": "accel", "runs-cpu": "cpu", "runs-accel": "accel"}


@dataclass(frozen=True)
class Layout:
    """The cores and threads of one benchmark run.

    Attributes:
        name: ``"cpu"`` or ``"accel"``.
        train_cpus: cores the training process is pinned to.
        torch_threads: torch intra-op threads of the training process.
        controller_cpus: cores Egeria's controller process is pinned to (``"accel"``);
            None where the config decides (``"cpu"``).
    """

    name: str
    train_cpus: tuple[int, ...]
    torch_threads: int
    controller_cpus: tuple[int, ...] | None

    def config_overrides(self, policy: str) -> dict[str, Any]:
        """The ``EgeriaConfig`` fields this layout sets for ``policy``.

        Only Egeria's own policy has a controller: under ``"accel"`` it runs in a process
        on :attr:`controller_cpus`. Every other case changes nothing.
        """
        if policy == "egeria" and self.controller_cpus is not None:
            return {"executor": "process", "controller_cpus": list(self.controller_cpus)}
        return {}

    def to_dict(self) -> dict[str, Any]:
        """The layout as recorded in a run file (``"layout"``)."""
        return {
            "name": self.name,
            "train_cpus": list(self.train_cpus),
            "torch_threads": self.torch_threads,
            "controller_cpus": None if self.controller_cpus is None else list(self.controller_cpus),
        }


def usable_cpus() -> tuple[int, ...]:
    """The cores the calling process may run on, in order (all cores where the platform
    cannot tell)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def resolve_layout(name: str, cpus: Iterable[int] | None = None) -> Layout:
    """The cores and threads of layout ``name`` on ``cpus``.

    Args:
        name: one of :data:`LAYOUTS`.
        cpus: the cores to share out (default: :func:`usable_cpus`). ``"cpu"`` trains on
            all of them; ``"accel"`` trains on the first and gives the rest to the
            controller.

    Raises:
        ValueError: an unknown layout, no cores, or fewer than 2 cores for ``"accel"``.
    """
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {list(LAYOUTS)}")
    cores = tuple(sorted(set(usable_cpus() if cpus is None else cpus)))
    if not cores:
        raise ValueError(f"layout {name!r}: no cores to run on")
    if name == "cpu":
        return Layout("cpu", cores, len(cores), None)
    if len(cores) < 2:
        raise ValueError(
            f"layout 'accel' needs at least 2 cores (1 to train, 1 or more for Egeria's controller); "
            f"this process may use {len(cores)}: {list(cores)}. Run it without taskset, or use layout 'cpu'"
        )
    return Layout("accel", cores[:1], 1, cores[1:])


@contextlib.contextmanager
def pinned(layout: Layout) -> Iterator[None]:
    """Runs the body pinned to ``layout.train_cpus`` (Linux) with ``layout.torch_threads``
    torch threads; the process's cores and threads are restored after.

    A process the trainer starts (Egeria's controller) inherits the pinning and re-pins
    itself to its ``controller_cpus``.
    """
    can_pin = hasattr(os, "sched_setaffinity")
    previous_cpus = os.sched_getaffinity(0) if can_pin else None
    previous_threads = torch.get_num_threads()
    if can_pin:
        os.sched_setaffinity(0, set(layout.train_cpus))
    torch.set_num_threads(layout.torch_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous_threads)
        if previous_cpus is not None:
            os.sched_setaffinity(0, previous_cpus)


def split_layout_prefix(arg: str) -> tuple[str | None, str]:
    """``"accel=runs/x"`` -> ``("accel", "runs/x")``; a path without a layout prefix ->
    ``(None, path)``. Only the names in :data:`LAYOUTS` count as a prefix, so other paths
    holding ``=`` are left whole."""
    head, sep, rest = arg.partition("=")
    if sep and head in LAYOUTS and rest:
        return head, rest
    return None, arg


def layout_of_path(path: str | os.PathLike[str]) -> str | None:
    """The layout named by the nearest folder of ``path`` (as given, not resolved) called
    ``cpu``, ``accel``, ``runs-cpu`` or ``runs-accel``; None where no folder is."""
    for part in reversed(PurePath(path).parent.parts):
        if part in _FOLDERS:
            return _FOLDERS[part]
    return None
