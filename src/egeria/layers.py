"""The layer modules of one run, as the engine learns them: the blocks' execution order
from the model's first forward pass (:class:`~egeria.partition.ExecutionTrace`), the
partition built from it on demand, capped to ``EgeriaConfig.max_frozen_flops`` of the
model's weight computation where the policy takes the cap, or the partition a checkpoint
restored.

:class:`RunLayers` holds them for :class:`~egeria.engine.Egeria`; building the partition
itself (blocks, merges, the frozen-first order) is :mod:`egeria.partition`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .config import EgeriaConfig
from .hooks import mark
from .partition import ExecutionTrace, Partition, build_partition, chosen_modules, leading_within

__all__ = ["RunLayers"]

logger = logging.getLogger(__name__)


class RunLayers:
    """The run's layer modules, known after the model's first forward pass.

    Args:
        model: the module Egeria hooks (inside any wrappers).
        blocks: the candidate blocks (:func:`~egeria.partition.find_blocks`).
        config: the run's config (``modules``, ``max_modules``, ``max_frozen_flops``).
        capped: whether ``config.max_frozen_flops`` limits the freezable modules (the
            policy's answer, :class:`~egeria.policies.PolicyView`).
        quiet_passes: whether a module past the cap may still freeze once it no longer
            moves at all (the policy's answer; Egeria's rule): the cap then bounds
            ``Partition.cap``, not ``Partition.freezable``.
    """

    def __init__(self, model: nn.Module, blocks: list[str], config: EgeriaConfig, *, capped: bool,
                 quiet_passes: bool = False) -> None:
        self.model = model
        self.blocks = blocks
        self.config = config
        self.capped = capped
        self.quiet_passes = quiet_passes
        self.partition: Partition | None = None
        self.error: ValueError | None = None
        self.saved_flops: list[float] | None = None  # the layer modules' weight computation a checkpoint recorded
        self._told_nothing_freezes = False
        self.trace: ExecutionTrace | None = ExecutionTrace(model, blocks)
        self._trace_end = mark(model.register_forward_hook(self._on_forward_end))

    def _on_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        """The first forward pass ended: the execution order is known (built on demand)."""
        if self.trace is not None:
            self.trace.remove()
            self._trace_end.remove()

    def stop_tracing(self) -> None:
        """Removes the trace's hooks (a restored partition or :meth:`Egeria.close`)."""
        if self.trace is not None:
            self.trace.remove()
            self._trace_end.remove()

    def finished_order(self) -> list[str] | None:
        """The blocks' execution order once the first forward pass has ended, else None."""
        trace = self.trace
        if trace is None or trace.active or not trace.order:
            return None
        return trace.order

    @property
    def known(self) -> bool:
        """Whether the layer modules are known or can be built now."""
        return self.partition is not None or self.finished_order() is not None

    def computed(self) -> Partition | None:
        """This model's layer modules (capped), where the first forward pass has ended."""
        order = self.finished_order()
        if order is None:
            return None
        return self.capped_partition(
            build_partition(
                self.model,
                self.blocks,
                order,
                max_modules=self.config.max_modules,
                user_chosen=chosen_modules(self.model, self.config.modules),
            )
        )

    def require(self, what: str) -> Partition:
        """The layer modules, built at the first call after the first forward pass.

        Raises:
            RuntimeError: before the first forward pass (``what`` names the caller).
            ValueError: the model cannot be split into layer modules (every later call too).
        """
        if self.error is not None:
            raise ValueError(str(self.error)) from self.error
        if self.partition is None:
            order = self.finished_order()
            if order is None:
                raise RuntimeError(
                    f"{what} needs the layer modules, which Egeria learns from the model's first forward "
                    "pass: call it after a forward pass (or pass example_inputs= to Egeria)"
                )
            try:
                self.partition = self.computed()
            except ValueError as err:
                logger.error("Egeria cannot split this model into layer modules: %s", err)
                self.error = err
                raise
        return self.partition

    def restore(self, partition: Partition, flops: list[float] | None) -> None:
        """Takes a checkpoint's partition and the weight computation it recorded."""
        self.stop_tracing()
        self.partition = partition
        self.saved_flops = flops

    def capped_partition(self, partition: Partition, saved_flops: list[float] | None = None) -> Partition:
        """``partition`` with its freezable modules holding at most
        ``config.max_frozen_flops`` of the model's weight computation, under Egeria's own
        policy or a baseline the config names (which takes no cap unless one is given); a
        policy object of the user's is not capped by it. Under a policy whose modules pass
        the cap once they no longer move (``quiet_passes``), the cap sets ``partition.cap``
        and ``freezable`` stays. Where the cap leaves nothing to freeze, one WARNING says why
        and what to change (a model of one layer module is refused outright)."""
        flops = self.module_flops(partition, saved_flops)
        share = self.config.max_frozen_flops
        if share is not None and self.capped and flops is not None and sum(flops) > 0:
            allowed = leading_within(flops, share, partition.freezable)
            if allowed == 0 < partition.freezable:
                self._nothing_can_freeze(
                    f"its first layer module {partition.modules[0].name!r} holds "
                    f"{100 * flops[0] / sum(flops):.0f}% of the model's weight computation, above "
                    f"EgeriaConfig.max_frozen_flops={share:g}; raise max_frozen_flops, "
                    "or pass modules= naming smaller layer modules",
                    quiet=self.quiet_passes,
                )
            if self.quiet_passes:
                partition.cap = min(partition.freezable, allowed)
            else:
                partition.freezable = min(partition.freezable, allowed)
        return partition

    def module_flops(self, partition: Partition, saved: list[float] | None = None) -> list[float] | None:
        """Each layer module's weight computation in the first forward pass, as this
        process's trace counted it, or as a checkpoint recorded it (``saved``, or the one
        loaded: a run resumed before its first forward pass); None where neither is known."""
        if self.trace is not None and self.trace.flops:
            return partition.flops(self.trace.flops)
        saved = saved if saved is not None else self.saved_flops
        return list(saved) if saved is not None and len(saved) == len(partition) else None

    def _nothing_can_freeze(self, why: str, *, quiet: bool = False) -> None:
        """The one warning of a run in which no module can ever freeze (``quiet``: none
        while it still moves)."""
        if not self._told_nothing_freezes:
            self._told_nothing_freezes = True
            when = " while it still moves" if quiet else ""
            logger.warning("Egeria can freeze nothing in this model%s: %s", when, why)
