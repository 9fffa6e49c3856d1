"""Where Egeria's controller runs, and on how many threads: the choices that depend on
the machine and on where the model lives, in one place.

The reference's precision is bf16 everywhere unless asked otherwise (computed in fp32 on
bf16-rounded values where the CPU has no native bf16: :mod:`egeria.knowledge.quantization`).

On CPU-only training every core already trains, so a controller beside the trainer only
takes cores from it: ``executor="auto"`` runs it inline, between steps, on the trainer's
own threads, and the cost budget spaces its readings. Beside an accelerator the host's
CPUs are idle: ``"auto"`` runs it in its own process (the paper's design), on one thread
unless ``controller_cpus`` names the cores it may use.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch
from torch import nn

__all__ = ["model_device", "resolve_executor", "reference_home", "resolve_precision", "controller_threads", "pin_to"]

logger = logging.getLogger(__name__)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for an empty model."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def resolve_executor(kind: str, model: nn.Module, reference_device: str = "cpu") -> str:
    """``kind`` itself, or for ``"auto"``: ``"inline"`` for a model on the CPU or a
    reference on the model's device, else ``"process"``."""
    if kind != "auto":
        return kind
    return "inline" if model_device(model).type == "cpu" or reference_device == "model" else "process"


def reference_home(reference_device: str, model: nn.Module) -> torch.device:
    """The device the controller's reference and front live on."""
    return model_device(model) if reference_device == "model" else torch.device("cpu")


def resolve_precision(precision: str) -> str:
    """``precision`` itself, or ``"bf16"`` for ``"auto"``, on every device.

    A bf16 reference refreshes with a cast where an int8 one re-quantizes, and its error is
    the one the rule's ``floor_ratio`` was measured with. On a CPU without native bf16 it
    computes in fp32 on bf16-rounded values (:class:`~egeria.knowledge.quantization.RoundedBlock`),
    far faster there than torch's bf16 kernels. See docs/decisions/002-reference-precision.md."""
    return "bf16" if precision == "auto" else precision


def controller_threads(executor: str, cpus: Sequence[int] | None) -> int | None:
    """Torch threads for the controller's work (None: leave torch's setting).

    Inline, the trainer's own threads (the trainer waits for the reading); a thread shares
    the trainer's pool; a process gets one thread per core in ``cpus``, or one.
    """
    if executor in ("inline", "thread"):
        return None
    return len(cpus) if cpus else 1


def pin_to(cpus: Sequence[int] | None) -> None:
    """Restricts the calling process to ``cpus`` (Linux); a warning where that fails."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("Egeria: controller_cpus=%s ignored: this platform cannot pin processes", list(cpus))
        return
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as err:
        logger.warning("Egeria: controller_cpus=%s ignored: %s", list(cpus), err)
