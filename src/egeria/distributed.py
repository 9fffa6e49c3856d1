"""Egeria under ``torchrun``: one decision source, the same frozen set on every rank at the
same step, and frozen parameters out of DDP's all-reduce.

- :class:`Ranks`: rank 0 runs the freezing policy (and Egeria's controller); at every step
  boundary it broadcasts the frozen count it wants (one int64 over a CPU ``gloo`` group of
  Egeria's own, so a GPU job does not synchronise its stream for it and Egeria's
  collectives never interleave with DDP's), and the move's reason when there is one.
  Every rank applies the same move at the same step. With it every rank sends its step
  count and a digest of its state (partition, frozen set, policy): a rank that differs
  makes every rank raise :class:`RanksDisagree` naming it and what differs; a boundary
  that a rank skips is reported after :data:`BOUNDARY_TIMEOUT_S` instead of hanging.
- :func:`rebuild_ddp`: ``DistributedDataParallel`` registers the parameters that need
  gradients when it is built, and expects each of them to get one every step. After a
  freeze or an unfreeze Egeria builds it again, in place (the object the loop calls stays
  the same), over the parameters that now train, with the options it had, its
  communication hooks and its own hooks kept: frozen parameters are no longer
  all-reduced, and unfrozen ones are again.
- FSDP2 (a model sharded with ``torch.distributed.fsdp.fully_shard``; no wrapper to
  rebuild): each parameter is a ``DTensor`` shard with its own ``requires_grad``, which
  FSDP2 copies to the gathered parameter at every unshard, and its reduce-scatter takes
  only the parameters that received a gradient. So the same freeze as without FSDP
  (``requires_grad`` False, grad None, at the same step on every rank) takes frozen
  parameters out of the reduce-scatter, and a frozen prefix, whose input needs no
  gradient, runs without autograd and is not gathered again for backward, except the
  FSDP unit just before the first trainable one, which FSDP2's implicit backward prefetch
  gathers anyway (no public switch; ``benchmarks/fsdp2_bytes.py`` counts it).
  :class:`WholeWeights` gathers the whole weights for Egeria's rule (its reference and
  readings) at the step boundaries where rank 0's rule reads them, every rank joining;
  :func:`check_fsdp2_policy` refuses the other policies that read the model on rank 0 (no
  rank holds a layer module whole); :meth:`Ranks.share_buffers` gives every rank rank 0's
  buffers of the modules that freeze (FSDP2 replicates buffers but never synchronises
  them, and a frozen module's BatchNorm runs in eval mode on its running statistics).
  See docs/decisions/027-fsdp2.md.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .policies import Move

__all__ = [
    "Ranks",
    "RanksDisagree",
    "WholeWeights",
    "BOUNDARY_TIMEOUT_S",
    "FSDP2_POLICIES",
    "distributed_run",
    "rebuild_ddp",
    "check_ddp",
    "check_fsdp2_policy",
]

logger = logging.getLogger(__name__)

# nn.Module.__init__ resets these; the wrapper's own hooks must survive a rebuild.
_MODULE_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_is_full_backward_hook",
)


def distributed_run() -> bool:
    """Whether this process is one of several ranks of an initialised process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


#: How long a rank waits at a step boundary for the others (seconds): Egeria's own limit on
#: its collectives, far below the process group's (30 minutes by default), so a boundary
#: that one rank skipped is reported by name instead of hanging. Legitimate waits here are
#: short: DDP's all-reduce in every backward keeps the ranks within a step of each other.
BOUNDARY_TIMEOUT_S = 300.0


class RanksDisagree(RuntimeError):
    """The ranks of a distributed run hold different Egeria states (partition, step, frozen
    set, policy): continuing would train different models or hang."""


class Ranks:
    """The ranks of a distributed run agreeing on Egeria's moves; rank 0 decides.

    Build it on every rank at the same point: it creates a process group of its own (CPU,
    gloo), so Egeria's collectives never interleave with DDP's and time out on their own
    limit (:data:`BOUNDARY_TIMEOUT_S`).
    """

    def __init__(self, timeout_s: float | None = None) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = BOUNDARY_TIMEOUT_S if timeout_s is None else float(timeout_s)
        # A CPU group for the decisions: a broadcast over NCCL would need a device tensor
        # and a synchronising read of it at every step.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self._layout: tuple[Any, list] | None = None  # a partition's names and shapes, for the digest

    def summary(self, model: nn.Module, prefix: Any, policy: str) -> dict[str, Any]:
        """What every rank must hold alike (its digest travels with every step boundary's
        agreement, :meth:`agree`): the layer modules with their parameters' shapes, the
        frozen set (``prefix``, a :class:`~egeria.freezing.FrozenPrefix`) and the policy's name."""
        if self._layout is None or self._layout[0] is not prefix.partition:
            named = dict(model.named_parameters())
            self._layout = (prefix.partition, [
                (m.name, [(p, tuple(named[p].shape)) for p in m.params if p in named]) for m in prefix.partition.modules
            ])
        return {"layer modules": self._layout[1], "frozen set": prefix.names, "policy": policy}

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree(self, move: Move | None, step: int, summary: Callable[[], dict[str, Any]]) -> Move | None:
        """Rank 0's ``move`` (None: keep the frozen set), on every rank, at boundary ``step``.

        Every rank sends its step count and a digest of its ``summary()`` (what must be
        equal everywhere: partition, frozen set, policy) with it, in one all-gather, which
        no rank can pass alone (unlike a broadcast, whose sender may run ahead): a rank
        that skipped a boundary or holds another state is named on every rank, and a rank
        that stopped calling makes the others give up after :attr:`timeout_s`. Every rank
        runs the same collectives in the same order whatever it finds, so a disagreement is
        an error, never a mismatched collective (which gloo answers by aborting).

        Raises:
            RanksDisagree: the ranks are at different step counts or hold different states.
            RuntimeError: a rank did not reach this boundary in time.
        """
        mine = torch.tensor(
            [step, _digest(summary()), -1 if move is None or not self.leader else move.frozen], dtype=torch.int64
        )
        heads = [torch.empty_like(mine) for _ in range(self.world)]
        self._collective(lambda: dist.all_gather(heads, mine, group=self.group), "eg.step()", step)
        steps = [int(h[0]) for h in heads]
        if len(set(steps)) > 1:
            other = next(r for r, s in enumerate(steps) if s != steps[0])
            raise RanksDisagree(
                f"Egeria's ranks disagree at a step boundary: rank {other}'s step count is {steps[other]}, rank 0's "
                f"is {steps[0]} (this is rank {self.rank}); call eg.step() on every rank after every optimizer step, "
                "and load the same Egeria checkpoint on every rank"
            )
        if len({int(h[1]) for h in heads}) > 1:
            self._name_difference(summary(), step)
        target = int(heads[0][2])
        if target < 0:
            return None
        detail: list[Any] = [None if move is None else (move.reason, move.evaluated_at, move.modules)]
        self._collective(lambda: dist.broadcast_object_list(detail, src=0, group=self.group), "eg.step()", step)
        reason, evaluated_at, modules = detail[0]
        return Move(target, reason if self.leader else f"rank 0: {reason}", evaluated_at, tuple(modules))

    def from_leader(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank; ``what`` names the call
        for the error if a rank never makes it."""
        box = [value if self.leader else None]
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=self.group), what, None)
        return box[0]

    def flag_from_leader(self, flag: bool, what: str) -> bool:
        """Rank 0's ``flag`` on every rank (one int64 broadcast over Egeria's CPU group)."""
        box = torch.tensor([int(flag)], dtype=torch.int64)
        self._collective(lambda: dist.broadcast(box, src=0, group=self.group), what, None)
        return bool(box.item())

    def all_true(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is true on every rank (one int64 all-reduce over Egeria's CPU group)."""
        box = torch.tensor([int(flag)], dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group), what, None)
        return bool(box.item())

    def share_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Rank 0's values of ``buffers`` (plain tensors, on any device) on every rank, in
        place, in one broadcast over Egeria's CPU group. Every rank must call it with
        buffers of the same shapes and dtypes in the same order."""
        if not buffers:
            return
        # One flat float64 tensor: exact for float32/16 and bfloat16 values and for
        # integer counters below 2**53 (BatchNorm's num_batches_tracked).
        flat = torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in buffers])
        self._collective(lambda: dist.broadcast(flat, src=0, group=self.group), "eg.step()", None)
        offset = 0
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view(b.shape))
            offset += b.numel()

    def with_rank0_buffers(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """A model state dict of an FSDP2 model (its parameters sharded) with rank 0's
        values of its plain tensors (the buffers, which FSDP2 never synchronises), as
        copies: a checkpoint writer (DCP, Lightning's) saves one rank's copy of a tensor
        every rank holds, whichever its plan picks, and a resume gives that copy to every
        rank. Rank 0's, so that a resumed rank 0 (which runs Egeria's rule, reading its own
        BatchNorm statistics) goes on as if uninterrupted. Every rank must call it."""
        from torch.distributed.tensor import DTensor

        copies = {k: v.clone() for k, v in model_state.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)}
        self.share_buffers(list(copies.values()))
        return {**model_state, **copies}

    def _name_difference(self, summary: dict[str, Any], step: int) -> None:
        """Raises :class:`RanksDisagree` naming the first rank and field that differ from
        rank 0's (every rank calls it: the digests told them all)."""
        gathered: list[Any] = [None] * self.world
        self._collective(lambda: dist.all_gather_object(gathered, summary, group=self.group), "eg.step()", step)
        leader = gathered[0]
        for rank, other in enumerate(gathered[1:], start=1):
            for field in sorted(set(leader) | set(other)):
                if leader.get(field) != other.get(field):
                    raise RanksDisagree(
                        f"Egeria's ranks disagree at step {step}: rank {rank}'s {field} is {other.get(field)!r}, "
                        f"rank 0's is {leader.get(field)!r} (this is rank {self.rank}). Every rank must build the same "
                        "model, call eg.step() after every optimizer step, and load the same Egeria checkpoint"
                    )
        raise RanksDisagree(f"Egeria's ranks hold different states at step {step} (digests differ)")

    def _collective(self, call: Callable[[], Any], what: str, step: int | None) -> None:
        try:
            call()
        except RuntimeError as err:  # gloo's timeout or a peer that left
            at = "" if step is None else f" at step {step}"
            raise RuntimeError(
                f"Egeria: rank {self.rank} waited{at} for {what} on the other ranks and gave up after "
                f"{self.timeout_s:g} s or on a lost peer ({err}); call {what} on every rank at the same point "
                "(after every optimizer step, never on rank 0 alone)"
            ) from err


def _digest(summary: dict[str, Any]) -> int:
    """A 63-bit digest of ``summary`` (its repr: names, shapes and counts), the same on
    every rank for equal summaries."""
    return int.from_bytes(hashlib.sha256(repr(sorted(summary.items())).encode()).digest()[:8], "big") >> 1


class WholeWeights:
    """The whole weights of a model sharded with ``fully_shard`` (FSDP2), for a policy
    that reads them (Egeria's rule: its reference model and the weights each reading
    compares with it).

    Under FSDP2 each rank holds a shard of every parameter, and making one whole is an
    all-gather every rank must join. So the weights are gathered only at agreed points:
    at the step boundaries where rank 0's policy says it reads them
    (``reads_weights_now()``, sent to every rank with :meth:`Ranks.flag_from_leader`),
    always at the first one (the policy binds there and copies the model), and for
    Egeria's checkpoints, which every rank saves and loads (DCP and Lightning call them
    on every rank). Each tensor is gathered in turn and copied to the host on rank 0
    (the others drop it at once), so no rank holds the whole model on its device.
    Buffers (not sharded; FSDP2 never synchronises them) are rank 0's own. Rank 0 keeps
    the last gathering until the next one: a controller replaced between readings builds
    its reference from it.

    Args:
        model: the model (or the submodule Egeria freezes) as sharded.
        ranks: the run's :class:`Ranks`; None for a one-process run.
    """

    def __init__(self, model: nn.Module, ranks: Ranks | None) -> None:
        self.model = model
        self.ranks = ranks
        self._state: dict[str, torch.Tensor] | None = None

    def at_boundary(self, first: bool, wanted: bool) -> None:
        """Every rank, at every step boundary, before the policy: gathers at the ``first``
        boundary, and where rank 0's policy ``wanted`` the weights (the other ranks' value
        is not read)."""
        if self.ranks is not None:
            wanted = self.ranks.flag_from_leader(wanted, "eg.step()")
        if first or wanted:
            self.gather()

    def gather(self) -> None:
        """Every rank at once: the whole state, on the host on rank 0."""
        from torch.distributed.tensor import DTensor

        keep = self.ranks is None or self.ranks.leader
        state: dict[str, torch.Tensor] = {}
        for key, value in self.model.state_dict().items():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            if keep:
                state[key] = whole.detach().to("cpu", copy=True)
        self._state = state if keep else None

    def read(self) -> dict[str, torch.Tensor]:
        """The last gathering (rank 0).

        Raises:
            RuntimeError: on a rank that gathered nothing (another rank than 0, or before
                the first step boundary).
        """
        if self._state is None:
            raise RuntimeError(
                "Egeria: the whole weights of this FSDP2 model were not gathered on this rank; Egeria's rule reads "
                "them on rank 0 at the step boundaries and checkpoints every rank joins"
            )
        return self._state


#: The policies that decide from the step alone (and a policy object of the user's), the
#: ones that work under FSDP2 (:func:`check_fsdp2_policy`) beside Egeria's rule.
FSDP2_POLICIES = ("egeria", "linear", "static", "freezeout", "none")


def check_fsdp2_policy(name: str, reads_model: bool, gathers_weights: bool) -> None:
    """Refuses, under FSDP2, a policy that reads the model's weights or gradients on rank 0
    other than through gathered weights.

    AutoFreeze reads gradient norms and SmartFRZ samples weights, on rank 0 alone, at
    moments of their own; under FSDP2 rank 0 holds a shard of each parameter. They are
    refused rather than fed a shard. Egeria's rule reads whole weights only at the step
    boundaries it names, which every rank gathers (:class:`WholeWeights`).

    Raises:
        ValueError: naming the policy and the ones that work.
    """
    if reads_model and not gathers_weights:
        raise ValueError(
            f"the {name!r} policy reads the model's weights or gradients on rank 0, and under FSDP2 (fully_shard) "
            "rank 0 holds only a shard of each parameter; under FSDP2 choose EgeriaConfig(policy=...) one of "
            f"{', '.join(FSDP2_POLICIES)} (or a policy object of your own), or train with DistributedDataParallel "
            f"to use {name!r}"
        )


def check_ddp(ddp: nn.Module) -> None:
    """Refuses DDP options a rebuild cannot carry over.

    Raises:
        ValueError: naming the option.
    """
    if getattr(ddp, "_delay_all_reduce_params", None):
        raise ValueError(
            "Egeria rebuilds DistributedDataParallel when modules freeze and cannot carry over "
            "delay_all_reduce_named_params; build the DDP without it"
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError(
            "Egeria rebuilds DistributedDataParallel when modules freeze and cannot carry over DDP's own "
            "mixed_precision (it installs hooks on the module that a rebuild would duplicate); use torch.autocast"
        )


def _reset_bucket_state(state: Any) -> None:
    """A communication hook's state kept per bucket (PowerSGD's error feedback and low-rank
    memories) does not fit the rebuilt buckets: it starts afresh, as after DDP's own
    bucket rebuild."""
    if state is None:
        return
    reset = False
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        memory = getattr(state, name, None)
        if isinstance(memory, dict):
            memory.clear()
            reset = True
    if not reset:
        logger.warning(
            "Egeria rebuilt DistributedDataParallel's buckets; the state of its communication hook (%s) is kept "
            "as it is: if it is kept per bucket, reset it on_change",
            type(state).__name__,
        )


def _builtin_comm_hook(ddp: nn.Module) -> Any | None:
    """The built-in (C++) communication hook registered on ``ddp``
    (``_register_builtin_comm_hook``), or None. DDP keeps no Python record of one, only
    its name in its logging data."""
    if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "logger", None) is None:
        return None
    name = ddp.logger._get_ddp_logging_data().strs_map.get("comm_hook", "")
    prefix = "BuiltinCommHookType."
    return getattr(dist.BuiltinCommHookType, name[len(prefix):], None) if name.startswith(prefix) else None


def rebuild_ddp(ddp: nn.Module) -> None:
    """Builds ``ddp`` again, in place, over the parameters that need gradients now.

    Keeps its options, its communication hooks (Python and built-in), its own module hooks
    and its mode; the replicas are not re-broadcast (they agree already).
    """
    check_ddp(ddp)
    builtin = _builtin_comm_hook(ddp)
    hooks = list(getattr(ddp, "_comm_hooks", []))
    for _, state in hooks:
        _reset_bucket_state(state)
    kept = {name: getattr(ddp, name) for name in _MODULE_HOOKS if hasattr(ddp, name)}
    training = ddp.training
    options = dict(
        device_ids=ddp.device_ids,
        output_device=ddp.output_device,
        dim=ddp.dim,
        process_group=ddp.process_group,
        bucket_cap_mb=ddp.bucket_bytes_cap / 2**20,
        find_unused_parameters=ddp.find_unused_parameters,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        static_graph=ddp.static_graph,
        init_sync=False,
    )
    for name in ("skip_all_reduce_unused_params", "batched_grad_copy"):  # newer options
        if hasattr(ddp, name):
            options[name] = getattr(ddp, name)
    caps = getattr(ddp, "bucket_bytes_cap_list", None)
    if caps and getattr(ddp, "_bucket_config", None) is not None and ddp._bucket_config.per_bucket_bytes_caps:
        options["bucket_cap_mb_list"] = [cap / 2**20 for cap in caps]
    if hasattr(ddp, "forward_sync_buffers"):  # torch >= 2.12 names it so
        options["forward_sync_buffers"] = ddp.forward_sync_buffers
    else:
        options["broadcast_buffers"] = ddp.broadcast_buffers
    module = ddp.module
    type(ddp).__init__(ddp, module, **options)
    for name, value in kept.items():
        setattr(ddp, name, value)
    ddp.training = training  # the wrapper's flag only: the modules inside keep theirs
    for hook, state in hooks:
        ddp.register_comm_hook(state, hook)
    if builtin is not None:
        ddp._register_builtin_comm_hook(builtin)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    logger.info("Egeria: DistributedDataParallel rebuilt over %d trainable parameters", trainable)
