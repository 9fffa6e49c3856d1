"""Time-to-accuracy benchmarks: real tasks, every freezing policy, one JSON per run."""

from __future__ import annotations

from .run import HEAPS, POLICY_NAMES, run_bench
from .tasks import TASKS, build_task

__all__ = ["run_bench", "POLICY_NAMES", "HEAPS", "TASKS", "build_task"]
