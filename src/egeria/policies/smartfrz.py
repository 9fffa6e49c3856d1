"""SmartFRZ (Li et al., ICLR 2023): a trained attention predictor says which front layer
modules have converged, from a window of samples of their weights.

At every ``sample_every`` steps the policy reads a fixed random sample of each active
(unfrozen, freezable) module's weights into that module's window of the last ``window``
samples (:mod:`~egeria.policies.smartfrz_sampling`); at each freezing stage, every
``stage_steps`` steps, it runs the predictor (:mod:`~egeria.policies.smartfrz_predictor`)
once over all full windows and freezes the contiguous front run of modules it predicts
converged: a module freezes only with, or after, the one before it. It never unfreezes.
Nothing runs inside the model's forward or backward; the engine applies the moves as for
every policy (activation cache, DDP rebuild, rank 0 decides, checkpoints).

The method card, with the choices of window, sample size and stage timing and what they
cost: ``SMARTFRZ.md`` beside this file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from ..checkpoint.serialization import decode_tensor, encode_tensor
from ..checks import check_int
from .base import Binding, Move, StepInfo
from .smartfrz_predictor import AttentionPredictor, load_shipped
from .smartfrz_sampling import ModuleSample, Windows, build_samples, normalise_window, read_sample

__all__ = ["SmartFRZ", "stage_plan", "front_run"]

logger = logging.getLogger(__name__)


def stage_plan(total_steps: int, stages: int, window: int) -> tuple[int, int]:
    """(steps between freezing stages, steps between weight samples) for a run of
    ``total_steps``: ``stages`` stages over the run, each reading a window of ``window``
    samples spread over the stage (one per step where a stage is shorter than the window).
    """
    stage_steps = max(1, total_steps // stages)
    return stage_steps, max(1, stage_steps // window)


def front_run(probabilities: list[float]) -> int:
    """How many leading modules freeze: those before the first whose p(freeze) is not
    above one half (SmartFRZ freezes front to back)."""
    count = 0
    for p in probabilities:
        if p <= 0.5:
            break
        count += 1
    return count


@dataclass
class SmartFRZ:
    """SmartFRZ's attention-guided freezing as a policy.

    Args:
        window: samples per window (T); the predictor's keys and values come from the
            T - 1 older ones, its query from the newest. Must match the shipped weights.
        size: weights sampled per layer module (S). Must match the shipped weights.
        stages: freezing stages over the run (needs ``total_steps``), unless
            ``stage_every`` is given.
        stage_every: steps between freezing stages, overriding ``stages``.
        seed: seeds which weights are sampled (the same ones in every process).
        weights: a weights file of the user's (from ``benchmarks/smartfrz_train.py``);
            default the one shipped with egeria, checked against its SHA-256.
    """

    window: int = 30
    size: int = 1024
    stages: int = 50
    stage_every: int | None = None
    seed: int = 0
    weights: str | None = None
    name: str = "smartfrz"
    stages_run: int = 0  # freezing stages run so far ("stage" in the saved state)
    probabilities: list[float] = field(default_factory=list)
    _predictor: AttentionPredictor | None = field(default=None, repr=False)
    _samples: list[ModuleSample] = field(default_factory=list, repr=False)
    _windows: Windows | None = field(default=None, repr=False)
    _named: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    #: It reads the model's weight samples (refused under FSDP2: :class:`~egeria.policies.PolicyView`).
    reads_model: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int(self.window, "SmartFRZ window", minimum=2)
        check_int(self.size, "SmartFRZ size")
        check_int(self.stages, "SmartFRZ stages")
        if self.stage_every is not None:
            check_int(self.stage_every, "SmartFRZ stage_every")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"SmartFRZ seed={self.seed!r} must be a non-negative integer")
        if self.weights is not None and not Path(self.weights).is_file():
            raise ValueError(f"SmartFRZ weights={self.weights!r} is not a file")

    # -- the policy interface ------------------------------------------------------

    def bind(self, binding: Binding) -> None:
        predictor, meta = load_shipped(self.weights)
        if predictor.size != self.size or meta.get("window", self.window) != self.window:
            raise ValueError(
                f"SmartFRZ size={self.size}, window={self.window} differ from the predictor's "
                f"(size {predictor.size}, window {meta.get('window')}); retrain it with benchmarks/smartfrz_train.py"
            )
        self._predictor = predictor
        partition = binding.partition
        self._named = dict(binding.model.named_parameters())
        self._samples = build_samples(binding.model, partition, partition.freezable, self.size, self.seed)
        self._windows = Windows(len(self._samples), self.window)

    def unbind(self) -> None:
        self._named = {}

    def plan(self, info: StepInfo) -> tuple[int, int]:
        """(stage_steps, sample_every) for this run."""
        if self.stage_every is not None:
            return self.stage_every, max(1, self.stage_every // self.window)
        if not info.total_steps:
            raise ValueError(
                "the 'smartfrz' policy spreads its stages over the run; pass total_steps= to Egeria, call "
                "eg.set_schedule(total_steps=...) before training, or give policy_options={'stage_every': N}"
            )
        return stage_plan(info.total_steps, self.stages, self.window)

    def target(self, info: StepInfo) -> Move | None:
        assert self._windows is not None, "SmartFRZ.target before bind"
        stage_steps, sample_every = self.plan(info)
        active = range(info.frozen, len(self._samples))
        if info.step % sample_every == 0:
            for index in active:
                self._windows.add(index, read_sample(self._named, self._samples[index]))
        if info.step % stage_steps != 0:
            return None
        return self._stage(info)

    def _stage(self, info: StepInfo) -> Move | None:
        """One freezing stage: the predictor over every full window of an active module,
        then the front run of modules it says to freeze."""
        assert self._windows is not None and self._predictor is not None
        ready = []
        for index in range(info.frozen, len(self._samples)):
            if not self._windows.full(index):
                break
            ready.append(index)
        if not ready:
            return None
        self.stages_run += 1
        windows = normalise_window(torch.stack([self._windows.stacked(i) for i in ready]))
        with torch.no_grad():
            probabilities = self._predictor(windows).softmax(dim=1)[:, 1].tolist()
        self.probabilities = probabilities
        count = front_run(probabilities)
        if count == 0:
            return None
        for index in ready[:count]:
            self._windows.clear(index)  # frozen: its weights no longer move
        shown = ", ".join(f"{p:.2f}" for p in probabilities[:count])
        return Move(info.frozen + count, f"smartfrz stage {self.stages_run}: predictor p(freeze) {shown}")

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Settings that must match on resume, the stage count, the last probabilities and
        every window's samples (tensors, encoded as the engine's state expects)."""
        assert self._windows is not None, "SmartFRZ.state_dict before bind"
        return {
            "seed": self.seed,
            "size": self.size,
            "window": self.window,
            "stage": self.stages_run,
            "probabilities": list(self.probabilities),
            "windows": [
                encode_tensor(self._windows.stacked(i)) if self._windows.snapshots[i] else None
                for i in range(len(self._samples))
            ],
        }

    def state_spec(self, context: Any) -> Callable[[Any, str], None]:
        """The check :meth:`load_state_dict` runs, for an engine that checks a whole saved
        state before loading any of it: ``spec(state, path)`` raises ``ValueError`` naming
        the first bad field of a state that does not fit ``context.partition``."""
        modules = context.partition.freezable

        def spec(state: Any, path: str) -> None:
            _checked_state(state, self.seed, self.size, self.window, modules)

        return spec

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output after checking all of it.

        Raises:
            ValueError: naming the first field that is missing, malformed, or saved with
                other settings than this policy's (seed, size, window) or another model.
        """
        assert self._windows is not None, "SmartFRZ.load_state_dict before bind"
        windows = _checked_state(state, self.seed, self.size, self.window, len(self._samples))
        self.stages_run = state["stage"]
        self.probabilities = [float(p) for p in state["probabilities"]]
        self._windows = Windows(len(self._samples), self.window)
        for index, held in enumerate(windows):
            for row in held:
                self._windows.add(index, row.clone())


def _checked_state(state: Any, seed: int, size: int, window: int, modules: int) -> list[torch.Tensor]:
    """The windows of a saved state, each (held, size) float32; ValueError naming the first
    bad field."""

    def bad(path: str, value: Any, problem: str) -> ValueError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return ValueError(f"SmartFRZ state field {path} = {shown} {problem}")

    if not isinstance(state, dict):
        raise bad("policy_state", state, "is not a mapping")
    for key in ("seed", "size", "window", "stage", "probabilities", "windows"):
        if key not in state:
            raise bad(key, None, "is missing")
    for key, ours in (("seed", seed), ("size", size), ("window", window)):
        if state[key] != ours or type(state[key]) is not int:
            raise bad(key, state[key], f"differs from this policy's {key}={ours}: the windows were sampled otherwise")
    if type(state["stage"]) is not int or state["stage"] < 0:
        raise bad("stage", state["stage"], "is not a non-negative integer")
    probabilities = state["probabilities"]
    if not isinstance(probabilities, list) or not all(
        type(p) in (int, float) and 0 <= p <= 1 for p in probabilities
    ):
        raise bad("probabilities", probabilities, "is not a list of probabilities in [0, 1]")
    saved = state["windows"]
    if not isinstance(saved, list) or len(saved) != modules:
        raise bad("windows", saved if not isinstance(saved, list) else f"<{len(saved)} windows>",
                  f"does not hold one entry per freezable layer module ({modules})")
    windows = []
    for index, entry in enumerate(saved):
        if entry is None:
            windows.append(torch.empty(0, size))
            continue
        try:
            tensor = decode_tensor(entry) if isinstance(entry, dict) else None
        except (ValueError, KeyError, TypeError, RuntimeError):
            tensor = None
        if tensor is None:
            raise bad(f"windows[{index}]", entry, "is not an encoded tensor")
        if tensor.dtype != torch.float32 or tensor.dim() != 2 or tensor.shape[1] != size or not 1 <= len(tensor) <= window:
            raise bad(f"windows[{index}]", f"<{tensor.dtype} {tuple(tensor.shape)}>",
                      f"is not 1 to {window} samples of {size} float32 values")
        if not torch.isfinite(tensor).all():
            raise bad(f"windows[{index}]", f"<{tuple(tensor.shape)}>", "holds non-finite values")
        windows.append(tensor)
    return windows
