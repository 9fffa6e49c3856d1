"""Egeria in a ``torch.distributed.checkpoint`` (DCP) checkpoint, with the model and the
optimizer it freezes: :class:`TrainingState`, what ``eg.dcp_state()`` returns.

Why the three together: DCP's optimizer state dicts
(``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``) load the state of
the parameters that need gradients only. Loaded into a model whose modules are frozen,
the momentum and Adam moments of the frozen modules would be silently dropped, and an
unfreeze after the resume would train them from zero state. So :meth:`TrainingState.load_state_dict`
unfreezes first, loads the model and the optimizer, and only then Egeria's state, which
freezes the saved set again: a resumed run equals an uninterrupted one, unfreezes
included (``tests/test_fsdp.py``).

Use, on every rank (an FSDP2 model's state stays sharded: each rank writes its shards)::

    import torch.distributed.checkpoint as dcp
    dcp.save({"train": eg.dcp_state()}, checkpoint_id=path)
    ...                                            # a new run: model, optimizer, Egeria
    dcp.load({"train": eg.dcp_state()}, checkpoint_id=path)

A learning-rate scheduler, the data position and anything else of the loop's go in the
same dict under keys of their own.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine import Egeria

__all__ = ["TrainingState"]


class TrainingState:
    """A DCP ``Stateful`` of the model, the optimizer and Egeria (see the module's text).

    Args:
        eg: the Egeria whose model (as the loop calls it), optimizer and state it holds.
    """

    def __init__(self, eg: Egeria) -> None:
        self.eg = eg

    def state_dict(self) -> dict[str, Any]:
        """``model`` and ``optimizer``: DCP's state dicts (sharded tensors under FSDP2);
        ``egeria``: rank 0's :meth:`~egeria.Egeria.state_dict` as JSON text (every rank
        holds the same text, so whichever rank DCP lets write it, rank 0's is saved).
        Every rank must call it (DCP's save and load do)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        eg = self.eg
        # Before the first forward pass there are no layer modules and no state to save:
        # the entry is null then (the template dcp.load asks for in a resumed run). Every
        # rank makes its state (under FSDP2 Egeria's rule gathers the whole weights for
        # it, a collective); rank 0's is the one kept.
        mine = eg.state_dict() if eg._layers.known else None
        state = eg._from_rank0(mine if eg._decides else None, "eg.dcp_state().state_dict()")
        return {
            "model": self._model_state(),
            "optimizer": get_optimizer_state_dict(eg.wrapper, eg.optimizer),
            "egeria": json.dumps(state),
        }

    def _model_state(self) -> dict[str, Any]:
        """DCP's model state dict; under FSDP2 with rank 0's buffers
        (:meth:`~egeria.distributed.Ranks.with_rank0_buffers`: DCP keeps one rank's copy)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.eg.wrapper)
        ranks = self.eg._fsdp2_ranks
        return state if ranks is None else ranks.with_rank0_buffers(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Unfreezes, loads the model and the optimizer (every parameter's state, frozen
        or not, with every parameter trainable), then Egeria's state, which freezes the
        saved set.

        Raises:
            ValueError: ``state`` lacks one of the three parts, Egeria's is empty (saved
                before the first forward pass) or does not fit this model (nothing of Egeria's changed then; the model and optimizer are
                loaded already).
        """
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        missing = [k for k in ("model", "optimizer", "egeria") if k not in state]
        if missing:
            raise ValueError(f"an Egeria DCP state needs model, optimizer and egeria; {missing} missing")
        saved = json.loads(state["egeria"])
        if saved is None:
            raise ValueError("this DCP checkpoint's Egeria state is empty: it was saved before the first forward pass")
        eg = self.eg
        eg._check_open()
        if eg._prefix is not None:
            eg._prefix.move_to(0)  # every parameter's optimizer state loads (see the module's text)
        set_model_state_dict(eg.wrapper, state["model"])
        set_optimizer_state_dict(eg.wrapper, eg.optimizer, state["optimizer"])
        eg.load_state_dict(saved)
