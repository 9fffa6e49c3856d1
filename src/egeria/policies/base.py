"""What a freezing policy sees and returns: the one seam between *when* and *how* to freeze.

A policy decides, at each step boundary, how many leading layer modules should be frozen;
the engine applies that with the same mechanics for every policy (``requires_grad``,
dropped gradients, eval-mode BatchNorm), so policies differ only in their timing.
Egeria's own knowledge-guided rule (:class:`~egeria.knowledge.KnowledgeGuided`, the
default ``policy="egeria"``) is one policy among them; the others are the baselines it is
measured against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Union, runtime_checkable

import torch
from torch import nn

from ..checkpoint.statecheck import record
from ..decision import Decision
from ..partition import Partition

if TYPE_CHECKING:
    from ..lr_schedule import LRSchedule
    from ..checkpoint.saved_state import SavedContext
    from ..checkpoint.statecheck import Spec

__all__ = ["StepInfo", "Binding", "Move", "FreezePolicy", "PolicyView", "StatelessPolicy", "as_move"]


@dataclass(frozen=True)
class StepInfo:
    """The state of training at one step boundary.

    Attributes:
        step: optimizer steps taken so far (1 after the first).
        total_steps: steps the run will take, or None when unknown.
        frozen: how many leading modules are frozen now.
        freezable: how many leading modules may be frozen at most.
        lr: the largest learning rate among the optimizer's param groups.
        loss: the step's training loss as given to ``Egeria.step`` (a detached scalar
            tensor or a float), or None.
    """

    step: int
    total_steps: int | None
    frozen: int
    freezable: int
    lr: float
    loss: torch.Tensor | float | None = None

    @property
    def progress(self) -> float | None:
        """Share of training done, in [0, 1], or None without ``total_steps``."""
        return None if not self.total_steps else min(1.0, self.step / self.total_steps)


@dataclass(frozen=True)
class Binding:
    """What a policy may use once the layer modules are known.

    Attributes:
        model: the training model (the module whose forward the user calls).
        partition: its layer modules.
        optimizer: the training optimizer (never changed by Egeria).
        frozen: how many leading modules are frozen now (the engine owns the count).
        step: optimizer steps taken so far (the engine owns the count).
        own_pass: true while Egeria runs a forward pass of its own, which hooks ignore.
        event: records an event that changes no frozen set (e.g. ``"guided"``).
        lr_schedule: the run's learning rate at every optimizer step
            (:class:`egeria.lr_schedule.LRSchedule`, read once, at the first call that can
            answer), else None: not known yet, or unknowable (one warning says why).
        weights: the model's whole state where ``model.state_dict()`` holds shards
            (FSDP2): every rank gathers it at the step boundaries where the policy's
            ``reads_weights_now()`` said so, before ``target``, and for checkpoints; rank 0
            reads the last gathering (:class:`egeria.distributed.WholeWeights`). None:
            read ``model.state_dict()``, at any time.
    """

    model: nn.Module
    partition: Partition
    optimizer: Any
    frozen: Callable[[], int]
    step: Callable[[], int]
    own_pass: Callable[[], bool]
    event: Callable[[Decision], None]
    lr_schedule: Callable[[], LRSchedule | None] = lambda: None
    weights: Callable[[], Mapping[str, torch.Tensor]] | None = None


@dataclass(frozen=True)
class Move:
    """A policy's answer with its cause: freeze the first ``frozen`` modules.

    Attributes:
        frozen: how many leading modules should be frozen (fewer unfreezes all first).
        reason: a short human-readable cause, kept in the event.
        evaluated_at: the step of the reading that decided it, if earlier than now.
        modules: the modules this move freezes, named by whoever decided them (Egeria's
            controller names them in its decision), in order; empty when the policy gives
            a count alone. The engine freezes by the count and records these names, after
            checking that they are the ones the count adds to the frozen prefix.
    """

    frozen: int
    reason: str = ""
    evaluated_at: int | None = None
    modules: tuple[str, ...] = ()


#: What :meth:`FreezePolicy.target` returns.
Target = Union[int, Move, None]


def as_move(target: Target, policy: str) -> Move | None:
    """A policy's answer as a :class:`Move` (a bare count gets ``"<policy> policy"`` as its reason)."""
    if target is None or isinstance(target, Move):
        return target
    return Move(int(target), f"{policy} policy")


@runtime_checkable
class FreezePolicy(Protocol):
    """Decides how many leading layer modules are frozen after each step."""

    #: Short name, used in logs and benchmark results.
    name: str

    def bind(self, binding: Binding) -> None:
        """Called at the first step boundary, once the layer modules are known (hooks may
        be installed and helpers started here)."""

    def target(self, info: StepInfo) -> Target:
        """How many leading modules should be frozen now (an int or a :class:`Move`);
        None keeps the current set."""

    def unbind(self) -> None:
        """Removes whatever :meth:`bind` installed."""

    def state_dict(self) -> dict:
        """JSON-safe state for checkpoints."""

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict` output, which :meth:`state_spec` took first."""

    # Optional: ``state_spec(context) -> Spec`` (:mod:`egeria.checkpoint.statecheck`), what a saved
    # state must hold to fit ``context`` (:class:`egeria.checkpoint.saved_state.SavedContext`); the
    # engine checks the whole state with it before anything loads. A policy without it
    # gets its own load_state_dict's errors. The engine's other questions, each with the
    # answer it takes from a policy that lacks the member, are :class:`PolicyView`'s.


class PolicyView:
    """What the engine asks a policy beyond :class:`FreezePolicy`'s methods, with the
    answer it takes from a policy that lacks the member (the baselines lack them all, a
    user's policy may). The engine asks these, never which class the policy is.

    The optional members of a policy:

    * ``requires_total_steps: bool``: the first step boundary needs ``total_steps``
      (default False);
    * ``capped_by_config: bool``: ``EgeriaConfig.max_frozen_flops`` limits which leading
      modules it may freeze even when the policy object is the user's (default False; a
      policy the config names by ``EgeriaConfig.policy`` is always capped);
    * ``quiet_passes_cap: bool``: a module past that cap may still freeze once it no
      longer moves at all, which the policy itself tells (default False; Egeria's rule:
      docs/decisions/041-quiet-modules-pass-the-cap.md);
    * ``stage: str``: ``"bootstrap"`` while it waits for the loss to settle (default
      ``"guided"``);
    * ``window: int | None``: the window W of a plasticity rule (default None);
    * ``evaluation_interval(total_steps, modules, known) -> int | None``: the steps between
      evaluations, with ``modules()`` the number of layer modules, callable where ``known``
      (default None);
    * ``controller_stats() -> dict`` and ``history() -> list[dict]``: a controller's counts
      and readings (default empty);
    * ``reads_model: bool``: it reads the model's weights or gradients (on rank 0 under
      torchrun), so it cannot work on FSDP2's shards (default False: it decides from the
      step, as the schedules do; :func:`egeria.distributed.check_fsdp2_policy`), unless
    * ``reads_weights_now() -> bool``: asked on rank 0 at each step boundary before
      ``target``: whether the policy reads the whole weights at this boundary, through
      :attr:`Binding.weights` (which the engine gathers then under FSDP2). A policy with it
      reads the model only so, and works under FSDP2 (default: absent).
    """

    def __init__(self, policy: FreezePolicy) -> None:
        self.policy = policy

    @property
    def requires_total_steps(self) -> bool:
        return bool(getattr(self.policy, "requires_total_steps", False))

    @property
    def capped_by_config(self) -> bool:
        return bool(getattr(self.policy, "capped_by_config", False))

    @property
    def quiet_passes_cap(self) -> bool:
        return bool(getattr(self.policy, "quiet_passes_cap", False))

    @property
    def reads_model(self) -> bool:
        return bool(getattr(self.policy, "reads_model", False))

    @property
    def gathers_weights(self) -> bool:
        return callable(getattr(self.policy, "reads_weights_now", None))

    def reads_weights_now(self) -> bool:
        ask = getattr(self.policy, "reads_weights_now", None)
        return ask is not None and bool(ask())

    @property
    def stage(self) -> str:
        return getattr(self.policy, "stage", "guided")

    @property
    def window(self) -> int | None:
        return getattr(self.policy, "window", None)

    def evaluation_interval(self, total_steps: int | None, modules: Callable[[], int], known: bool) -> int | None:
        ask = getattr(self.policy, "evaluation_interval", None)
        return None if ask is None else ask(total_steps, modules, known)

    def controller_stats(self) -> dict:
        ask = getattr(self.policy, "controller_stats", None)
        return {} if ask is None else ask()

    def history(self) -> list[dict]:
        ask = getattr(self.policy, "history", None)
        return [] if ask is None else ask()


class StatelessPolicy:
    """Base for policies whose decision is a pure function of the step."""

    name = "stateless"

    def bind(self, binding: Binding) -> None:
        return None

    def unbind(self) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

    def state_spec(self, context: SavedContext) -> Spec:
        return record({})


def require_total_steps(info: StepInfo, policy: str) -> float:
    progress = info.progress
    if progress is None:
        raise ValueError(
            f"the {policy!r} policy schedules by the share of training done; pass total_steps= to Egeria "
            "or call eg.set_schedule(total_steps=...) before training"
        )
    return progress
