"""What machine a measurement ran on, recorded beside every demo and benchmark result."""

from __future__ import annotations

import os
import platform

import torch

__all__ = ["describe_machine", "training_device"]

# CPU features that decide how fast int8 and bf16 kernels run.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")


def describe_machine(device: str = "cpu") -> dict:
    """Platform, Python, CPU model and its int8/bf16 features, cores, torch build and threads;
    for a run on another ``device``, the accelerator's name as ``accelerator``."""
    cpu: str | None = None
    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name") and cpu is None:
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    have = set(line.split(":", 1)[1].split())
                    flags = [f for f in _CPU_FLAGS if f in have]
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu or platform.processor() or platform.machine() or "unknown",
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "quantized_engines": list(torch.backends.quantized.supported_engines),
        **({} if device == "cpu" else {"accelerator": torch.cuda.get_device_name(device)
                                       if device.startswith("cuda") else device}),
    }


def training_device(name: str, label: str) -> torch.device:
    """``name`` as a torch device a run can train on.

    Raises:
        ValueError: starting with ``label``, for a name torch does not read as a device, or
            a CUDA device where torch sees none.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{label}: not a torch device (cpu, cuda, cuda:1, ...)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{label}: this machine's torch sees no CUDA device")
    return device
