"""Egeria's checkpoint: :class:`Checkpointing`, the engine's ``state_dict``, ``save``,
``load`` and ``load_state_dict``.

What a checkpoint holds (format 5): the config, the layer modules (names, parameters,
blocks; :meth:`~egeria.partition.Partition.to_state`), the step count and run length, the
learning-rate schedule's cadence, the modules' weight computation (for the cap of a run
resumed before its first forward pass), the frozen count, the decisions so far, and the
policy's name and own state (Egeria's: its stage, window, interval, bootstrap readings and
controller: readings, rule state, the reference model's snapshot). Names, steps and
histories in a JSON-safe dict; tensors stay tensors in the folder's ``.pt`` file
(:mod:`egeria.checkpoint.serialization`). The whole state is checked against the model
(:mod:`egeria.checkpoint.saved_state`) before anything in the engine changes.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from ..checks import finite_count
from ..decision import Decision
from .dcp import TrainingState
from .saved_state import check_saved_state, policy_state_spec, sealed
from .serialization import decode_tensor, encode_tensor, read_state, write_state
from .statecheck import check

if TYPE_CHECKING:
    from ..config import EgeriaConfig
    from ..distributed import Ranks, WholeWeights
    from ..freezing import FrozenPrefix
    from ..layers import RunLayers
    from ..lr_schedule import ScheduleWatch
    from ..policies import FreezePolicy
    from ..stepcount import OptimizerSteps

__all__ = ["Checkpointing", "STATE_FORMAT"]

logger = logging.getLogger(__name__)

#: The format this version writes and reads (5: no fixed probe; issue 28).
STATE_FORMAT = 5


class Checkpointing:
    """The checkpoint methods of :class:`~egeria.engine.Egeria`, which holds the state
    they save and restore (the attributes below) and provides ``_check_open()``,
    ``_bind()`` (the frozen prefix, binding the policy at the first call), ``_release()``
    (unbinds the policy, lets go of the prefix), ``_decides`` (whether this process
    runs the policy: rank 0 alone under torchrun) and ``_from_rank0`` (rank 0's value on
    every rank)."""

    config: EgeriaConfig
    model: Any
    policy: FreezePolicy
    steps: int
    total_steps: int | None
    events: list[Decision]
    _layers: RunLayers
    _schedule: ScheduleWatch
    _prefix: FrozenPrefix | None
    _cache: Any
    _counter: OptimizerSteps
    _whole: WholeWeights | None
    _fsdp2_ranks: Ranks | None
    _state_is_collective: bool

    def state_dict(self) -> dict:
        """Egeria's state as a JSON-safe dict.

        Together with the model's and optimizer's state it reproduces the same frozen
        set and the same later decisions. Egeria's own policy adds the reference model's
        snapshot tensors that differ from the model's current weights (those of the watched
        module, base64-encoded) and its int8 calibration, so it is larger than a few numbers.

        Under FSDP2 with Egeria's rule or freezing to the average every rank must call it
        (as DCP and Lightning do): the rule's state is made from the whole weights, and the
        averages are saved whole, which every rank gathers.

        Raises:
            RuntimeError: after :meth:`close`.
        """
        self._check_open()
        if self._whole is not None and self._layers.known:
            self._whole.gather()
        prefix = self._bind()
        return sealed({
            "format": STATE_FORMAT,
            "config": self.config.to_dict(),
            "partition": prefix.partition.to_state(),
            "steps": self.steps,
            "total_steps": self.total_steps,
            "lr_cadence": self._schedule.steps_per_epoch,  # optimizer steps per scheduler step, once learnt
            # the learning rates of the steps taken, once the schedule is known: a resumed run's
            # schedule holds them (its jumps and peak are the uninterrupted run's)
            "lr_taken": None if (taken := self._schedule.taken(self.steps)) is None else encode_tensor(taken),
            "module_flops": self._layers.module_flops(prefix.partition),  # for the cap of a run resumed before a forward
            "frozen": prefix.count,
            "events": [d.to_dict() for d in self.events],
            "policy": self.policy.name,
            # Under torchrun only rank 0 runs the policy; the other ranks' states lack it.
            "policy_state": self.policy.state_dict() if self._decides else None,
            # freezing to the average (egeria.averaging): the averages and re-estimates under way
            "average": None if prefix.average is None else prefix.average.state_dict(encode_tensor),
        })

    def dcp_state(self) -> TrainingState:
        """The model, the optimizer and Egeria as one ``Stateful`` for
        ``torch.distributed.checkpoint``: ``dcp.save({"train": eg.dcp_state()}, ...)`` and
        ``dcp.load({"train": eg.dcp_state()}, ...)`` on every rank (an FSDP2 model's
        shards stay sharded). Loading keeps the frozen modules' optimizer state, which DCP
        would drop if they were frozen then (:mod:`egeria.checkpoint.dcp`)."""
        return TrainingState(self)  # type: ignore[arg-type]  # the engine is a Checkpointing

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes :meth:`state_dict` into ``directory`` as ``egeria.json`` (a few numbers
        and names) and ``egeria-<id>.pt`` (the reference model's tensors as tensors); the
        JSON is renamed into place last, so a crash or a full disk at any point leaves the
        previous checkpoint whole (:mod:`egeria.checkpoint.serialization`).

        Raises:
            OSError: the files cannot be written (the previous ones are kept).
            RuntimeError: after :meth:`close`.
        """
        write_state(self.state_dict(), directory)

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restores what :meth:`save` wrote (restore the model and optimizer first).

        Raises:
            FileNotFoundError: ``directory`` holds no Egeria checkpoint.
            ValueError: the checkpoint cannot be read or does not fit this model.
        """
        self.load_state_dict(read_state(directory))

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output. Load the model's and optimizer's checkpoint
        first: the frozen modules and the reference are rebuilt from the model's weights.

        The whole state is checked against this model first (every field's type and
        range, the partition, the tensors' shapes and dtypes, the policy's state), so a
        state it refuses leaves this Egeria as it was.

        Under FSDP2 with Egeria's rule or freezing to the average every rank must call it
        (as for DDP): the reference is rebuilt from the whole weights, which every rank
        gathers, and each rank takes its shards of the averages.

        Raises:
            ValueError: naming the field that does not fit this model or this format.
        """
        self._check_open()
        if self._whole is not None:
            self._whole.gather()
        flops = state.get("module_flops") if isinstance(state, dict) else None
        flops = flops if isinstance(flops, list) and all(finite_count(f) for f in flops) else None
        try:
            partition, context = check_saved_state(
                state,
                model=self.model,
                format=STATE_FORMAT,
                policy=self.policy.name,
                decides=self._decides,
                current=self._layers.partition if self._layers.partition is not None else self._layers.computed(),
                cap=lambda p: self._layers.capped_partition(p, saved_flops=flops),
            )
            if self._decides:
                check(state["policy_state"], policy_state_spec(self.policy, context), "state.policy_state")
        except ValueError as err:
            self._agree_to_load(err)
            raise
        self._agree_to_load(None)
        # a field the saved config lacks is newer than the checkpoint: not a difference
        changed = {
            k: (v, state["config"][k]) for k, v in self.config.to_dict().items()
            if k in state["config"] and state["config"][k] != v
        }
        if changed:
            logger.warning("Egeria config differs from the saved one (now, saved): %s", changed)
        # Checked: nothing above changed this Egeria; from here on it takes the state.
        if self.total_steps is None and state.get("total_steps") is not None:
            self.total_steps = state["total_steps"]
        self._schedule.assume_cadence(state.get("lr_cadence"))
        self._schedule.assume_taken(None if state.get("lr_taken") is None else decode_tensor(state["lr_taken"]))
        self._release()
        self._layers.restore(partition, flops)
        self._prefix = None
        self.steps = state["steps"]
        self.events = [Decision.from_dict(e) for e in state["events"]]
        prefix = self._bind()
        average, prefix.average = prefix.average, None  # the saved frozen set, not frozen anew to averages
        prefix.move_to(state["frozen"])
        prefix.average = average
        self._load_average(state.get("average"))
        if self._decides:
            self.policy.load_state_dict(state["policy_state"])
        self._counter.settle()

    def _load_average(self, saved: dict | None) -> None:
        """The averages and BatchNorm re-estimates of a state (checked), where this Egeria
        freezes to the average; a state without them starts the averages afresh."""
        prefix = self._prefix
        assert prefix is not None
        if prefix.average is None:
            if saved is not None:
                logger.warning("the Egeria state holds weight averages, which this Egeria (average=None) does not use")
            return
        if saved is None:
            prefix.average.unfreeze()  # nothing saved: averages from the weights as they are
        else:
            prefix.average.load_state_dict(saved, decode_tensor)
        if self._cache is not None:
            self._cache.set_frozen(prefix.settled)

    def _agree_to_load(self, refused: ValueError | None) -> None:
        """Under FSDP2 with Egeria's rule or freezing to the average every rank loads (the
        reference is rebuilt from whole weights they gather, the averages are cut into each
        rank's shards) and only rank 0 checks the policy's state: every rank
        takes the state, or none does. Raises on a rank whose own check passed where
        another's refused (the refusing rank raises its own error)."""
        ranks = self._fsdp2_ranks if self._state_is_collective else None
        if ranks is None:
            return
        if not ranks.all_true(refused is None, "eg.load_state_dict() (every rank, under FSDP2)") and refused is None:
            raise ValueError("another rank refused this Egeria state (rank 0 checks the policy's state; its error says why); "
                             "nothing of Egeria's changed")
