"""Low-precision copies of single blocks for the reference model (paper 4.1.3, 5).

Blocks are converted one by one so the reference keeps the training model's module
names (hooks and the early stop work on it) and its Python ``forward`` with whatever
arguments the blocks take. Convolutional blocks get static int8 post-training
quantization (FX graph mode, ``x86`` backend, calibrated on real activations);
Linear-only blocks get dynamic int8 quantization; bf16 casts a block and its inputs
(:class:`CastBlock`) where the CPU has native bf16 arithmetic, and elsewhere computes in
fp32 on values rounded to bf16 (:class:`RoundedBlock`: the same numbers, many times faster there).
``torch.ao.quantization`` is deprecated in recent PyTorch: its warnings are silenced
here, and where it is missing :func:`int8_unavailable` says why and callers fall back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from ..nested import map_tensors

__all__ = [
    "int8_unavailable",
    "has_layers",
    "StaticInt8",
    "dynamic_int8",
    "CastBlock",
    "RoundedBlock",
    "native_bf16",
    "bf16_kind",
    "bf16_block",
    "CONV_TYPES",
]

logger = logging.getLogger(__name__)

CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_ENGINE = "x86"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


@contextlib.contextmanager
def _engine() -> Iterator[None]:
    """Runs int8 kernels on the x86 backend, restoring the process-wide setting after."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = _ENGINE
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def int8_unavailable() -> str | None:
    """Why int8 quantization cannot run here, or None when it can."""
    try:
        with _quiet():
            import torch.ao.quantization  # noqa: F401
            from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the torch build
        return f"torch.ao.quantization is not available ({err})"
    if _ENGINE not in torch.backends.quantized.supported_engines:
        return f"the {_ENGINE!r} quantized engine is not in this torch build"
    return None


def has_layers(block: nn.Module, types: tuple[type, ...]) -> bool:
    return any(isinstance(m, types) for m in block.modules())


class StaticInt8:
    """Static int8 quantization of one block in three steps: prepare, calibrate, convert.

    The calibration result (each activation observer's range) is plain numbers, so a
    checkpoint can carry it and rebuild the same int8 block without the calibration data.

    Args:
        block: an fp32 block in eval mode; it is not modified.
        example_args: positional tensor arguments the block is called with.

    Raises:
        Exception: whatever FX tracing raises for a block it cannot trace.
    """

    def __init__(self, block: nn.Module, example_args: tuple[torch.Tensor, ...]) -> None:
        with _quiet():
            from torch.ao.quantization import (
                MinMaxObserver,
                QConfig,
                QConfigMapping,
                default_per_channel_weight_observer,
            )
            from torch.ao.quantization.quantize_fx import prepare_fx

            qconfig = QConfig(
                activation=MinMaxObserver.with_args(dtype=torch.quint8, reduce_range=True),
                weight=default_per_channel_weight_observer,
            )
            mapping = QConfigMapping().set_global(qconfig)
            with _engine():
                self._prepared = prepare_fx(_eval_copy(block), mapping, example_inputs=example_args)

    @torch.no_grad()
    def calibrate(self, args: tuple[torch.Tensor, ...]) -> None:
        """Runs the observed block on real inputs to learn activation ranges."""
        with _quiet(), _engine():
            self._prepared(*args)

    def observer_state(self) -> dict[str, Any]:
        """The calibrated ranges (nested lists of the observers' shapes), JSON-safe."""
        return {
            key: value.tolist()
            for key, value in self._prepared.state_dict().items()
            if "activation_post_process" in key and key.rsplit(".", 1)[-1] in ("min_val", "max_val")
        }

    def load_observer_state(self, state: dict[str, Any]) -> None:
        """Restores ranges saved by :meth:`observer_state` instead of calibrating."""
        current = self._prepared.state_dict()
        missing = [k for k in state if k not in current]
        if missing:
            raise ValueError(f"saved int8 calibration does not fit this block: no {missing[:3]!r}")
        loaded = {k: torch.tensor(v, dtype=current[k].dtype) for k, v in state.items()}
        self._prepared.load_state_dict(loaded, strict=False)

    def convert(self) -> nn.Module:
        """The int8 block: takes and returns fp32 tensors, runs int8 kernels inside."""
        with _quiet():
            from torch.ao.quantization.quantize_fx import convert_fx

            with _engine():
                return _EngineBlock(convert_fx(self._prepared))


class _EngineBlock(nn.Module):
    """Runs a converted int8 block under the engine its weights were packed for."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _engine():
            return self.block(*args, **kwargs)


def dynamic_int8(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose Linear layers run with dynamic int8 quantization."""
    with _quiet():
        from torch.ao.quantization import quantize_dynamic

        with _engine():
            return _EngineBlock(quantize_dynamic(_eval_copy(block), {nn.Linear}, dtype=torch.qint8))


class CastBlock(nn.Module):
    """A copy of ``block`` in ``dtype``; floating inputs are cast to it and outputs back to fp32."""

    def __init__(self, block: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.block = _eval_copy(block).to(dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args = _cast(args, self.dtype)
        kwargs = _cast(kwargs, self.dtype)
        return _cast(self.block(*args, **kwargs), torch.float32)


class RoundedBlock(nn.Module):
    """bf16 numerics in fp32 arithmetic: a copy of ``block`` whose floating weights and
    buffers are rounded to bf16, whose floating inputs and every leaf module's inputs and
    outputs are rounded to bf16, and which computes in fp32.

    On a CPU where torch has no fast bf16 kernels (this project's AVX2-only VM) they run
    many times slower than fp32; this block costs a few fp32 forwards' time (its rounding
    passes) and reads the same error as a :class:`CastBlock` (``tests/knowledge/test_reference.py``;
    the measurements: docs/decisions/002-reference-precision.md).

    Rounding each leaf's inputs and outputs stands for the bf16 result of each layer and of
    the functional ops between layers (an activation, attention); a residual add's sum
    stays in fp32 until the next rounding. A leaf that works by changing its input in place
    and returning nothing useful would change a rounded copy instead; TorchScript leaves
    take no hooks and run unrounded inside.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = _eval_copy(block)
        with torch.no_grad():
            for tensor in [*self.block.parameters(), *self.block.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(_rounded(tensor))
        for module in self.block.modules():
            leaf = next(module.children(), None) is None
            if leaf and not isinstance(module, torch.jit.ScriptModule):  # round what it takes and returns
                module.register_forward_pre_hook(_round_inputs)
                module.register_forward_hook(_round_output)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = (_cast(_cast(v, torch.bfloat16), torch.float32) for v in (args, kwargs))
        return map_tensors(self.block(*args, **kwargs), _rounded)


def native_bf16() -> bool:
    """Whether torch runs bf16 fast on this CPU (oneDNN's bf16 kernels: native bf16
    arithmetic, or AVX-512 that oneDNN uses for it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def bf16_kind(device: torch.device) -> str:
    """How a bf16 block on ``device`` computes: ``"bf16"`` (torch's bf16 kernels) on an
    accelerator or where :func:`native_bf16`, else ``"bf16-rounded"`` (:class:`RoundedBlock`)."""
    return "bf16-rounded" if device.type == "cpu" and not native_bf16() else "bf16"


def bf16_block(block: nn.Module, device: torch.device) -> tuple[nn.Module, str]:
    """``block`` (living on ``device``) with bf16 numerics, and its kind: a
    :class:`CastBlock` (``"bf16"``) or a :class:`RoundedBlock` (``"bf16-rounded"``) as
    :func:`bf16_kind` says (a block it cannot hook gets a CastBlock)."""
    if bf16_kind(device) == "bf16-rounded":
        try:
            return RoundedBlock(block), "bf16-rounded"
        except RuntimeError as err:
            logger.info("reference block runs in torch's bf16 kernels (slow on this CPU): %s", err)
    return CastBlock(block, torch.bfloat16), "bf16"


@torch.no_grad()
def retake_bf16(built: nn.Module, block: nn.Module) -> bool:
    """Copies ``block``'s weights and buffers into ``built``, a block :func:`bf16_block` made
    from it, with the same numbers a new one would get: a refresh then costs a copy, not a
    deep copy of the block. False (nothing copied) where ``built`` is not such a block or
    no longer matches ``block``'s tensors (docs/decisions/037-reading-cost-sets-n.md)."""
    if isinstance(built, CastBlock):
        convert = functools.partial(_cast, dtype=built.dtype)
    elif isinstance(built, RoundedBlock):
        convert = _rounded
    else:
        return False
    own, theirs = built.block.state_dict(), block.state_dict()
    if own.keys() != theirs.keys() or any(own[k].shape != theirs[k].shape for k in own):
        return False
    for key, value in theirs.items():
        own[key].copy_(convert(value))
    return True


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() and t.dtype != torch.bfloat16 else t


def _round_inputs(module: nn.Module, args: tuple) -> tuple:
    return map_tensors(args, _rounded)


def _round_output(module: nn.Module, args: tuple, output: Any) -> Any:
    return map_tensors(output, _rounded)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _eval_copy(block: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(block).eval()
