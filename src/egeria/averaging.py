"""Freezing to the average: a layer module freezes at the running average of its recent
weights instead of its last iterate, and its BatchNorm statistics are re-estimated for the
averaged weights on the training batches that follow.

The last iterate of a module that freezes while the learning rate is still high carries that
step's noise for the rest of the run; an average of its last steps carries less (the frontier
issue's item 2(i); measured against the last iterate in ``benchmarks/frontier.py``,
``egeria:SPEED:average=auto``). Opt in with ``Egeria(..., average=WeightAverage())``.

What it does, all at step boundaries (inside ``eg.step()``, never in a hook):

* every step, each unfrozen module that may freeze folds its parameters into its average:
  the plain mean of its first ``span`` steps, then an exponential average giving each new
  step a weight of ``1/span``. The averages are float32 (float64 for float64 weights), one
  copy of the freezable modules' trainable parameters, and a module's average is dropped
  when it freezes;
* a freeze copies the module's average into its parameters before they stop training. The
  modules behind it see the averaged module's output from then on;
* a frozen BatchNorm then runs in train mode on the next batches (batch statistics, as it
  did while it trained), its running statistics reset and accumulated as a plain mean, for
  as many batches as its own running statistics weigh (``1/momentum``, 10 for the default
  0.1); then it runs in eval mode on them, as every frozen module does. Until then the
  activation cache does not count the module as frozen (its output is not yet final), and
  under torchrun every rank takes rank 0's statistics when it ends.

An unfreeze restarts every average from the current weights. The averages and any
re-estimate under way are in Egeria's checkpoint (a resumed run equals an uninterrupted one).
Under DDP every rank computes the same averages from the same weights. Under FSDP2 each rank
averages its own shards of each parameter (the averaging is element by element, so the shards
of the averages are the averages of the whole weights) and a freeze copies them into its
shards; a checkpoint holds the whole averages, gathered by every rank (a collective, as Egeria's
rule's is), and a load gives each rank its shards of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from .hooks import mark, unmark
from .partition import LayerModule, Partition

__all__ = ["WeightAverage", "FreezeToAverage", "average_dtype", "DEFAULT_SPAN", "DEFAULT_RESTATS"]

#: Steps an average weighs when the policy has no readings to take its span from.
DEFAULT_SPAN = 50
#: Batches a re-estimate of BatchNorm statistics takes for a BatchNorm without a momentum.
DEFAULT_RESTATS = 10


@dataclass(frozen=True)
class WeightAverage:
    """Freeze each layer module to the running average of its recent weights.

    Args:
        span: the steps the average weighs: the plain mean over a module's first ``span``
            steps, then an exponential average weighing each new step ``1/span``. None:
            the span of the evidence a freeze rests on, W x n under Egeria's rule (its
            window of readings times the steps between two of them), else
            :data:`DEFAULT_SPAN` steps.

    Raises:
        ValueError: a span that is not a positive whole number.
    """

    span: int | None = None

    def __post_init__(self) -> None:
        if self.span is not None and (type(self.span) is not int or self.span < 1):
            raise ValueError(f"WeightAverage(span={self.span!r}): give a whole number of steps, 1 or more, or None")


def average_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's average is kept in: float64 for float64 weights, else float32."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: an FSDP2 parameter's shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` (this rank's part of a tensor sharded as ``param`` is) made whole: an
    all-gather every rank joins for an FSDP2 parameter; ``shard`` itself otherwise."""
    if not hasattr(param, "device_mesh"):
        return shard
    from torch.distributed.tensor import DTensor

    spread = DTensor.from_local(shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return spread.full_tensor()


def _shard(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` (a tensor of ``param``'s shape), cut as ``param`` is
    sharded; no communication (every rank holds ``whole``)."""
    if not hasattr(param, "device_mesh"):
        return whole
    from torch.distributed.tensor import distribute_tensor

    cut = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    return cut.to_local().clone()  # not a view that would keep the whole tensor


@dataclass
class _Restats:
    """A re-estimate of one frozen module's BatchNorm statistics under way."""

    module: str
    norms: list[_BatchNorm]
    momenta: list[float | None]
    left: int
    handles: list[RemovableHandle] = field(default_factory=list)


class FreezeToAverage:
    """The averages of one run's freezable modules and the re-estimates under way; the
    engine calls :meth:`update` at every step boundary and :meth:`tick` after it, the frozen
    prefix :meth:`freeze` before a module stops training and :meth:`unfreeze` after an
    unfreeze.

    Args:
        model: the module Egeria freezes in.
        partition: its layer modules.
        trainable: names of the parameters Egeria may freeze (those the user left trainable).
        span: steps an average weighs (see :class:`WeightAverage`).
    """

    def __init__(self, model: nn.Module, partition: Partition, trainable: set[str], span: int) -> None:
        self.model = model
        self.partition = partition
        self.span = span
        self._params = dict(model.named_parameters())
        self._owned = {m.name: [p for p in m.params if p in trainable] for m in partition.modules[: partition.freezable]}
        self.averages: dict[str, torch.Tensor] = {}  # parameter name -> its average (this rank's shard)
        self.updates = 0  # steps folded in since the averages (re)started
        self._restats: list[_Restats] = []

    # -- averages --------------------------------------------------------------------

    def update(self, frozen: int) -> None:
        """Folds the current weights of the unfrozen freezable modules into their averages."""
        names = [p for m in self.partition.modules[frozen : self.partition.freezable] for p in self._owned[m.name]]
        self.updates += 1
        weight = 1.0 / min(self.updates, self.span)
        with torch.no_grad():
            for name in names:
                value = _local(self._params[name].detach())
                average = self.averages.get(name)
                if average is None:
                    self.averages[name] = value.to(average_dtype(value), copy=True)
                else:
                    average.lerp_(value.to(average.dtype), weight)

    def freeze(self, module: LayerModule) -> None:
        """Gives ``module`` its averaged weights (it is about to stop training) and starts
        re-estimating its BatchNorm statistics."""
        with torch.no_grad():
            for name in self._owned.get(module.name, []):
                average = self.averages.pop(name, None)
                if average is not None:
                    target = _local(self._params[name].data)
                    target.copy_(average.to(target.dtype))
        self._start_restats(module, reset=True)

    def unfreeze(self) -> None:
        """After an unfreeze: every average restarts from the weights as they are, and a
        re-estimate under way ends where it is."""
        for restats in self._restats:
            self._end(restats)
        self._restats = []
        self.averages = {}
        self.updates = 0

    # -- BatchNorm statistics ---------------------------------------------------------

    def _norms(self, module: LayerModule) -> list[_BatchNorm]:
        """The BatchNorms of ``module`` that keep running statistics."""
        return [
            sub
            for block in module.blocks
            for sub in self.model.get_submodule(block).modules()
            if isinstance(sub, _BatchNorm) and sub.track_running_stats
        ]

    def _start_restats(self, module: LayerModule, *, reset: bool, left: int | None = None) -> _Restats | None:
        norms = self._norms(module)
        if not norms:
            return None
        momenta = [n.momentum for n in norms]
        if left is None:
            left = max(round(1 / m) if m else DEFAULT_RESTATS for m in momenta)
        restats = _Restats(module.name, norms, momenta, left)
        for norm in norms:
            if reset:
                norm.reset_running_stats()
            norm.momentum = None  # a plain mean of the batches it sees from here
            restats.handles.append(mark(norm.register_forward_pre_hook(self._train_as_model), traced=True))
        self._restats.append(restats)
        return restats

    def _train_as_model(self, norm: nn.Module, args: tuple) -> None:
        # The frozen block is held in eval mode (egeria.freezing.EvalLock); its BatchNorm
        # follows the model's own flag while it re-estimates: batch statistics in training
        # forwards, the statistics so far in the user's and Egeria's eval-mode passes.
        norm.training = self.model.training

    def _end(self, restats: _Restats) -> None:
        for norm, momentum in zip(restats.norms, restats.momenta):
            norm.momentum = momentum
            norm.training = False
        for handle in restats.handles:
            unmark(handle)

    def tick(self) -> list[str]:
        """Counts one more training batch for each re-estimate under way; returns the
        modules whose re-estimate ended (their BatchNorm runs in eval mode from now on)."""
        done = []
        for restats in self._restats:
            restats.left -= 1
            if restats.left <= 0:
                self._end(restats)
                done.append(restats.module)
        self._restats = [r for r in self._restats if r.left > 0]
        return done

    def settled(self, frozen: int) -> int:
        """How many of the ``frozen`` leading modules are final: the frozen ones before the
        first whose BatchNorm statistics are still being re-estimated."""
        names = self.partition.names
        pending = [names.index(r.module) for r in self._restats]
        return min([frozen, *pending])

    def buffers_of(self, modules: list[str]) -> list[torch.Tensor]:
        """The BatchNorm buffers of ``modules`` (to share rank 0's when a re-estimate ends)."""
        by_name = {m.name: m for m in self.partition.modules}
        return [buf for name in modules for norm in self._norms(by_name[name]) for buf in norm.buffers()]

    # -- checkpoint -------------------------------------------------------------------

    def state_dict(self, encode: Callable[[torch.Tensor], Any]) -> dict:
        """The averages (``encode`` turns each whole average into its saved form), the steps
        folded in and the re-estimates under way (module, batches left, the BatchNorm
        momenta to restore). Under FSDP2 every rank must call it: each average is gathered
        whole, in turn."""
        return {
            "span": self.span,
            "updates": self.updates,
            "averages": {name: encode(_whole(self._params[name], t)) for name, t in self.averages.items()},
            "restats": [{"module": r.module, "left": r.left, "momenta": list(r.momenta)} for r in self._restats],
        }

    def load_state_dict(self, state: dict, decode: Callable[[Any], torch.Tensor]) -> None:
        """Takes :meth:`state_dict`'s output (checked by the engine first). The frozen
        modules' BatchNorm statistics come with the model's own checkpoint; a re-estimate
        under way goes on from them without resetting them. Under FSDP2 each rank takes its
        shards of the whole averages."""
        self.unfreeze()
        self.updates = state["updates"]
        for name, saved in state["averages"].items():
            param = self._params[name]
            value = _local(param.detach())
            whole = decode(saved).to(device=value.device, dtype=average_dtype(value))
            self.averages[name] = _shard(param, whole)
        by_name = {m.name: m for m in self.partition.modules}
        for entry in state["restats"]:
            restats = self._start_restats(by_name[entry["module"]], reset=False, left=entry["left"])
            if restats is not None and len(entry["momenta"]) == len(restats.momenta):
                restats.momenta = list(entry["momenta"])
