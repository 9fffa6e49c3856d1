"""Egeria under ``torchrun``: one decision source, the same frozen set on every rank at the
same step, and frozen parameters out of DDP's all-reduce.

- :class:`Ranks`: rank 0 runs the freezing policy (and Egeria's controller); at every step
  boundary it broadcasts the frozen count it wants (one int64 over a CPU ``gloo`` group,
  so a GPU job does not synchronise its stream for it), and the move's reason when there
  is one. Every rank applies the same move at the same step.
- :func:`rebuild_ddp`: ``DistributedDataParallel`` registers the parameters that need
  gradients when it is built, and expects each of them to get one every step. After a
  freeze or an unfreeze Egeria builds it again, in place (the object the loop calls stays
  the same), over the parameters that now train, with the options it had, its
  communication hooks and its own hooks kept: frozen parameters are no longer
  all-reduced, and unfrozen ones are again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .policies import Move

__all__ = ["Ranks", "distributed_run", "rebuild_ddp", "check_ddp"]

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


class Ranks:
    """The ranks of a distributed run agreeing on Egeria's moves; rank 0 decides.

    Build it on every rank at the same point (it may create a process group).
    """

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # A CPU group for the decisions: a broadcast over NCCL would need a device tensor
        # and a synchronising read of it at every step.
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def agree(self, move: Move | None) -> Move | None:
        """Rank 0's ``move`` (None: keep the frozen set), on every rank."""
        head = torch.tensor([-1 if move is None else move.frozen], dtype=torch.int64)
        dist.broadcast(head, src=0, group=self.group)
        target = int(head.item())
        if target < 0:
            return None
        detail: list[Any] = [None if move is None else (move.reason, move.evaluated_at)]
        dist.broadcast_object_list(detail, src=0, group=self.group)
        reason, evaluated_at = detail[0]
        return Move(target, reason if self.leader else f"rank 0: {reason}", evaluated_at)


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
