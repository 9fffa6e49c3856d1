"""The reference model: a cheap low-precision snapshot of the training model (paper 4.1.3, 5).

The reference is a copy of the training model (on the CPU, or with
``reference_device="model"`` on the model's device) whose blocks, up to the module being
watched, are swapped for low-precision versions while it runs. It runs only as far as
the watched module's output and is stopped there.

When it is refreshed. Egeria refreshes it from the training model after every reading
and whenever a module freezes. A plasticity reading then measures how far the watched module moved since the
previous reading, plus the fixed quantization error. A reference kept for longer makes
each reading grow with the reference's age and fall back at its refresh, a saw-tooth the
slope test would read as movement; the paper saw the same effect ("a stale reference
model can amplify the inherent fluctuations"). Blocks of frozen modules no longer change,
so they are converted once and reused; a refresh converts only the active module's blocks.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..checkpoint.serialization import decode_tensor, encode_tensor
from ..checkpoint.statecheck import Spec, encoded_tensor, integer, items, keyed, mapping, nested, number, record, sequence, text
from ..nested import map_tensors
from ..partition import Partition
from .placement import model_device
from .quantization import CONV_TYPES, StaticInt8, bf16_block, dynamic_int8, has_layers, int8_unavailable, retake_bf16
from .threads import limited_threads
from .truncated import outputs_until, run_until
from .weights import ModuleKeys, float_snapshot

__all__ = ["ReferenceModel", "Batch"]

logger = logging.getLogger(__name__)

#: A model's call arguments, ``(args, kwargs)``, on the CPU.
Batch = tuple[tuple, dict]


class ReferenceModel:
    """A snapshot of the training model in ``precision``, refreshed block by block, on the
    device of ``template``.

    Weights come in as mappings from ``state_dict`` keys to tensors (the training model's
    own ``state_dict()`` inline, a copy sent by the worker otherwise); only the entries of
    the modules being refreshed, and those outside every block, are read.

    Args:
        template: a model of the same structure (the controller's snapshot of the training
            model, on the device the reference is to live on); it is copied, never modified.
        partition: its layer modules.
        precision: ``"int8"``, ``"bf16"`` or ``"fp32"``. bf16 blocks compute in bf16
            where that is fast, else in fp32 on bf16-rounded values
            (:func:`~egeria.knowledge.quantization.bf16_block`).
        threads: torch threads for the reference's work (None: leave torch's setting).
    """

    def __init__(
        self,
        template: nn.Module,
        partition: Partition,
        precision: str,
        *,
        threads: int | None = 1,
    ) -> None:
        reason = int8_unavailable() if precision == "int8" else None
        if reason:
            logger.warning("int8 reference unavailable (%s); using fp32", reason)
            precision = "fp32"
        device = model_device(template)
        if precision == "int8" and device.type != "cpu":
            raise ValueError(f"an int8 reference runs on the CPU only, not on {device}")
        self.precision = precision
        self.threads = threads
        self._partition = partition
        self._float = float_snapshot(template, device)
        self._keys = ModuleKeys(self._float, partition)
        self._built: dict[str, nn.Module] = {}
        self._observers: dict[str, dict[str, list[float]]] = {}
        self._input_specs: dict[str, list[list]] = {}
        self.kinds: dict[str, str] = {}
        self._final: set[int] = set()
        self.upto = -1
        self._buffers = {name for name, _ in self._float.named_buffers()}

    def _blocks_of(self, modules: Sequence[int]) -> list[str]:
        """The blocks of the layer modules at indices ``modules``, in order."""
        return [b for j in modules for b in self._partition.modules[j].blocks]

    # -- refresh -----------------------------------------------------------------

    @torch.no_grad()
    def refresh(self, weights: Mapping[str, torch.Tensor], frozen_count: int, upto: int, calibration: Batch) -> None:
        """Takes the training model's current weights for modules ``0..upto``.

        Modules frozen at an earlier refresh keep their blocks: their weights are final.

        Args:
            weights: the training model's state (at least modules ``0..upto`` not yet final).
            frozen_count: how many leading modules are frozen now.
            upto: index of the deepest module the reference must run (the watched one).
            calibration: one real batch, used to calibrate static int8 blocks.
        """
        targets = [j for j in range(upto + 1) if j not in self._final]
        self._rebuild_modules(weights, targets, calibration)
        self._final.update(j for j in targets if j < frozen_count)
        self.upto = max(self.upto, upto)

    @torch.no_grad()
    def refinalize(self, weights: Mapping[str, torch.Tensor], modules: Iterable[int], calibration: Batch) -> None:
        """Takes the final weights of frozen ``modules`` (they trained a few more steps
        between the freeze decision and its application)."""
        targets = sorted(j for j in set(modules) if j <= self.upto)
        self._rebuild_modules(weights, targets, calibration)
        self._final.update(targets)

    def _rebuild_modules(self, weights: Mapping[str, torch.Tensor], targets: Sequence[int], calibration: Batch) -> None:
        target_blocks = self._blocks_of(targets)
        with limited_threads(self.threads):
            self._copy_from(weights, targets)
            if self.precision == "bf16":  # a bf16 block built before takes the new weights in place
                target_blocks = [b for b in target_blocks if not self._retake(b)]
        for block in target_blocks:
            self._built.pop(block, None)
        inputs = self._block_inputs(calibration, target_blocks) if self.precision == "int8" else {}
        with limited_threads(self.threads):
            for block in target_blocks:
                self._build(block, inputs.get(block))

    def _retake(self, name: str) -> bool:
        """Whether block ``name``'s built bf16 copy took the snapshot's weights in place."""
        built = self._built.get(name)
        return built is not None and retake_bf16(built, self._float.get_submodule(name))

    def _build(self, name: str, call: Batch | None, observers: dict[str, list[float]] | None = None) -> None:
        block = self._float.get_submodule(name)
        if self.precision == "fp32":
            self.kinds[name] = "fp32"
            return
        if self.precision == "bf16":
            self._built[name], kind = bf16_block(block, model_device(self._float))
            if self.kinds.get(name) != kind:
                logger.debug("reference block %s runs as %s", name, kind)
            self.kinds[name] = kind
            return
        kind, reason = "fp32", "it has no convolution or Linear layer"
        if has_layers(block, CONV_TYPES):
            try:
                self._built[name] = self._static_int8(name, block, call, observers)
                kind = "int8-static"
            except Exception as err:  # FX cannot trace every block; fall back, never fail
                reason = f"static quantization failed: {type(err).__name__}: {err}"
        if kind == "fp32" and has_layers(block, (nn.Linear,)):
            self._built[name] = dynamic_int8(block)
            kind = "int8-dynamic"
        if self.kinds.get(name) != kind:
            if kind == "fp32" and any(True for _ in block.parameters()):
                logger.info("reference block %s runs in fp32: %s", name, reason)
            else:
                logger.debug("reference block %s runs as %s", name, kind)
        self.kinds[name] = kind

    def _static_int8(
        self, name: str, block: nn.Module, call: Batch | None, observers: dict[str, list[float]] | None
    ) -> nn.Module:
        if observers is None:
            if call is None:
                raise RuntimeError("the block did not run on the calibration batch")
            args, kwargs = call
            if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
                raise TypeError("it takes keyword or non-tensor arguments")
            self._input_specs[name] = [[list(a.shape), str(a.dtype).removeprefix("torch.")] for a in args]
            quantizer = StaticInt8(block, args)
            quantizer.calibrate(args)
            self._observers[name] = quantizer.observer_state()
        else:
            example = tuple(
                torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in self._input_specs[name]
            )
            quantizer = StaticInt8(block, example)
            quantizer.load_observer_state(observers)
            self._observers[name] = observers
        return quantizer.convert()

    def _copy_from(self, weights: Mapping[str, torch.Tensor], modules: Sequence[int]) -> None:
        own = self._float.state_dict()
        for key in self._keys.of(modules):
            if key in weights:
                own[key].copy_(weights[key])
            elif key not in self._keys.loose:
                raise KeyError(f"the weights sent for refreshing lack {key!r}")

    def _block_inputs(self, batch: Batch, blocks: Sequence[str]) -> dict[str, Batch]:
        """Each block's call arguments when the reference runs ``batch``."""
        seen: dict[str, Batch] = {}
        handles = []
        for name in blocks:
            def grab(module: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                seen.setdefault(name, map_tensors((args, kwargs), torch.Tensor.detach))

            handles.append(self._float.get_submodule(name).register_forward_pre_hook(grab, with_kwargs=True))
        try:
            self._run_until(batch, blocks[-1] if blocks else None)
        finally:
            for handle in handles:
                handle.remove()
        return seen

    def final_state(self) -> dict[str, torch.Tensor]:
        """The state of the modules the reference holds final (frozen, or decided frozen by
        the controller and not yet applied by the training side), by ``state_dict`` key: the
        fp32 weights and buffers its forward pass runs them with."""
        own = self._float.state_dict()
        return {k: own[k] for k in self._keys.of(sorted(self._final), loose=False)}

    def statistics(self) -> dict[str, torch.Tensor]:
        """The running statistics (the buffers, e.g. batch norm's running mean and variance)
        of modules ``0..upto`` as of their latest refresh, by ``state_dict`` key: what the
        reference's forward pass normalizes with."""
        own = self._float.state_dict()
        return {k: own[k] for k in self._keys.of(range(self.upto + 1)) if k in self._buffers}

    # -- running -----------------------------------------------------------------

    @torch.no_grad()
    def activation(self, batch: Batch, module_index: int) -> torch.Tensor:
        """The reference's fp32 activation at the output of layer module ``module_index``.

        Raises:
            RuntimeError: when the reference was not refreshed as far as that module, or
                the module's output block did not run.
        """
        return self.activations(batch, [module_index])[0]

    @torch.no_grad()
    def activations(self, batch: Batch, module_indices: Sequence[int]) -> list[torch.Tensor]:
        """The reference's fp32 activations at the outputs of several layer modules, from
        one forward pass that stops at the deepest of them.

        Raises:
            RuntimeError: when the reference was not refreshed as far as the deepest
                module, or an output block did not run.
        """
        deepest = max(module_indices)
        if deepest > self.upto:
            raise RuntimeError(f"reference built up to module {self.upto}, asked for {deepest}")
        blocks = [self._partition.modules[i].output_block for i in module_indices]
        args, kwargs = batch
        with limited_threads(self.threads), self._swapped():
            outputs = outputs_until(self._float, blocks, args, kwargs)
        return [t.float() for t in outputs]

    def _run_until(self, batch: Batch, block: str | None) -> Any:
        args, kwargs = batch
        with limited_threads(self.threads), self._swapped():
            return run_until(self._float, block, args, kwargs)

    @contextlib.contextmanager
    def _swapped(self) -> Iterator[None]:
        originals = {name: self._float.get_submodule(name) for name in self._built}
        for name, module in self._built.items():
            _set_submodule(self._float, name, module)
        try:
            yield
        finally:
            for name, module in originals.items():
                _set_submodule(self._float, name, module)


    # -- checkpointing -----------------------------------------------------------

    def state_dict(self, live: Mapping[str, torch.Tensor]) -> dict:
        """JSON-safe state: the snapshot's tensors that differ from the training model's
        ``live`` state now, and the int8 calibration, enough to rebuild this exact
        reference from that model later."""
        upto_blocks = self._blocks_of(range(self.upto + 1))
        own = self._float.state_dict()
        changed = {
            k: encode_tensor(own[k])
            for k in self._keys.of(range(self.upto + 1))
            if k not in live or not torch.equal(own[k], live[k].detach().to(own[k].device))
        }
        return {
            "precision": self.precision,
            "upto": self.upto,
            "final": sorted(self._final),
            "tensors": changed,
            "observers": {b: dict(v) for b, v in self._observers.items() if b in upto_blocks},
            "input_specs": {b: v for b, v in self._input_specs.items() if b in upto_blocks},
            # both bf16 kinds compute the same numbers; each machine loads its faster one
            "kinds": {b: "bf16" if k == "bf16-rounded" else k for b, k in self.kinds.items() if b in upto_blocks},
        }

    @staticmethod
    def state_spec(partition: Partition, weights: Mapping[str, torch.Tensor]) -> Spec:
        """What :meth:`state_dict` output holds for ``partition`` of a model whose state is
        ``weights``: its tensors are that model's, of exactly their shapes (fp32 where the
        model's are floating point), its blocks are the partition's."""
        blocks = text([b for m in partition.modules for b in m.blocks])
        tensors = {
            key: encoded_tensor(value.shape, torch.float32 if value.is_floating_point() else value.dtype)
            for key, value in weights.items()
        }

        dims = items(integer(0, 2**40), most=16)
        return record(
            {
                "precision": text(("int8", "bf16", "fp32")),
                "upto": integer(-1, len(partition) - 1),
                "final": items(integer(0, len(partition) - 1), unique=True),
                "tensors": keyed(tensors, "names no tensor of this model"),
                "observers": mapping(mapping(nested(number())), keys=blocks),
                "input_specs": mapping(items(sequence(dims, text(pattern=r"[a-z0-9]+"))), keys=blocks),
                "kinds": mapping(text(("fp32", "int8-static", "int8-dynamic", "bf16", "bf16-rounded")), keys=blocks),
            }
        )

    @torch.no_grad()
    def load_state_dict(self, state: dict, weights: Mapping[str, torch.Tensor]) -> None:
        """Rebuilds the reference saved by :meth:`state_dict` on top of the training
        model's ``weights`` (at least the modules the saved reference ran)."""
        if state["precision"] != self.precision:
            raise ValueError(
                f"saved reference precision {state['precision']!r} differs from {self.precision!r}"
            )
        own = self._float.state_dict()
        for key, value in weights.items():
            if key in own:
                own[key].copy_(value)
        for key, entry in state["tensors"].items():
            if key not in own:
                raise ValueError(f"saved reference tensor {key!r} is not in this model")
            own[key].copy_(decode_tensor(entry))
        self._built.clear()
        self._input_specs = {b: v for b, v in state["input_specs"].items()}
        self.upto = int(state["upto"])
        blocks = self._blocks_of(range(self.upto + 1))
        kinds = state["kinds"]
        with limited_threads(self.threads):
            for block in blocks:
                self._rebuild(block, kinds.get(block, "fp32"), state["observers"].get(block))
        self._final = set(state["final"])

    def _rebuild(self, name: str, kind: str, observers: dict[str, list[float]] | None) -> None:
        block = self._float.get_submodule(name)
        if kind == "int8-static":
            self._built[name] = self._static_int8(name, block, None, observers or {})
        elif kind == "int8-dynamic":
            self._built[name] = dynamic_int8(block)
        elif kind in ("bf16", "bf16-rounded"):  # the same numbers: this machine's faster way
            self._built[name], kind = bf16_block(block, model_device(self._float))
        elif kind != "fp32":
            raise ValueError(f"unknown reference block kind {kind!r} in saved state")
        self.kinds[name] = kind


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, leaf, module)
