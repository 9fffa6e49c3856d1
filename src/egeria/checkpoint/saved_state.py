"""What an Egeria state holds, and the check of a whole saved one against this model
before an ``Egeria`` takes any of it (:meth:`egeria.Egeria.load_state_dict`).

The check covers the engine's fields here and the policy's through the policy's own
``state_spec``; every refusal is one ``ValueError`` naming the field and its value.

A state carries a digest of its content (:func:`sealed`), so that damage a field check
cannot see (a step count one off, a flipped byte in a tensor) is refused too. A state
without one (written by hand, or before digests) is checked field by field only."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from ..averaging import average_dtype
from ..decision import Decision
from ..partition import Partition
from .serialization import decode_tensor
from .statecheck import (
    StateError,
    anything,
    check,
    encoded_tensor,
    integer,
    items,
    keyed,
    mapping,
    number,
    optional,
    record,
    text,
)

__all__ = ["SavedContext", "check_saved_state", "policy_state_spec", "sealed", "without_policy_state", "STEPS"]

#: Step counts a state may hold (a 64-bit signed counter).
STEPS = integer(0, 2**63 - 1)

_NAMES = items(text(), most=1_000_000)
_PARTITION = items(record({"name": text(), "blocks": _NAMES, "params": _NAMES}), most=100_000)


def _lr_taken(value: Any, path: str) -> None:
    """The learning rates of the steps taken (float64, one a step), each finite and at least 0."""
    encoded_tensor(dtype=torch.float64)(value, path)
    if len(value["shape"]) != 1:
        raise StateError(f"{path}.shape", value["shape"], "is not one learning rate a step (1-D)")
    lrs = decode_tensor(value)
    if not bool(torch.isfinite(lrs).all()) or bool((lrs < 0).any()):
        raise StateError(path, "...", "holds a learning rate that is negative or not finite")


def _digest(state: dict) -> str | None:
    """The SHA-256 of ``state``'s content (its digest left out), None if it is not JSON."""
    body = {k: v for k, v in state.items() if k != "digest"}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def sealed(state: dict) -> dict:
    """``state`` with the digest of its content."""
    return {**state, "digest": _digest(state)}


def without_policy_state(state: dict) -> dict:
    """``state`` as the ranks that do not run the policy take it (sealed anew)."""
    return sealed({**state, "policy_state": None})


@dataclass(frozen=True)
class SavedContext:
    """What a policy's state is checked against: the partition the state will be loaded
    with, its frozen count and step, and the model's tensors (``model.state_dict()``)."""

    partition: Partition
    frozen: int
    steps: int
    weights: Mapping[str, torch.Tensor]


def check_saved_state(
    state: Any,
    *,
    model: nn.Module,
    format: int,
    policy: str,
    decides: bool,
    current: Partition | None,
    cap: Any,
) -> tuple[Partition, SavedContext]:
    """Checks ``state``'s engine fields; returns the partition it is to be loaded with
    (``cap`` applied: the engine's caps for this config) and the context its policy state
    is checked against.

    Args:
        current: the partition computed for this model, where one is known (a forward
            pass ran); the saved one must equal it. Without one the saved partition must
            fit the model: every block and parameter present, each parameter in one module.

    Raises:
        ValueError: naming the first field that is wrong.
    """
    if type(state) is not dict:
        raise StateError("state", state, "is not a mapping")
    if state.get("format") != format:
        raise StateError("state.format", state.get("format"), f"is not {format}, the format this Egeria reads")
    check(
        state,
        record(
            {
                "format": anything,
                "config": mapping(anything),
                "partition": _PARTITION,
                "steps": STEPS,
                "total_steps": optional(integer(1, 2**63 - 1)),
                "lr_cadence": optional(integer(1, 2**63 - 1)),
                "lr_taken": optional(_lr_taken),
                "module_flops": optional(items(number(0))),
                "frozen": integer(0),
                "events": items(anything),
                "policy": text(),
                "policy_state": optional(mapping(anything)),
                "average": optional(mapping(anything)),
                "digest": text(pattern="[0-9a-f]{64}"),
            },
            optional=("total_steps", "lr_cadence", "lr_taken", "module_flops", "average", "digest"),
        ),
    )
    if "digest" in state and state["digest"] != _digest(state):
        raise StateError(
            "state.digest", state["digest"], "does not match the state's content: it was changed or damaged after it was saved"
        )
    if state["policy"] != policy:
        raise StateError("state.policy", state["policy"], f"was saved by another policy; this Egeria runs {policy!r}")
    if decides and state["policy_state"] is None:
        raise StateError(
            "state.policy_state", None,
            "was saved on a rank other than 0, which does not run the policy; load rank 0's",
        )
    partition = _partition(model, state["partition"], current, cap)
    if state["frozen"] > partition.freezable:
        raise StateError("state.frozen", state["frozen"], f"is above the {partition.freezable} modules that may freeze")
    steps = state["steps"]
    check(state["events"], items(Decision.state_spec(partition.names, steps)), "state.events")
    if state.get("average") is not None:
        check(state["average"], _average_spec(model, partition, state["frozen"], steps), "state.average")
    return partition, SavedContext(partition, state["frozen"], steps, model.state_dict())


def _average_spec(model: nn.Module, partition: Partition, frozen: int, steps: int) -> Any:
    """Freezing to the average (:meth:`egeria.averaging.FreezeToAverage.state_dict`): an
    average for parameters of the unfrozen freezable modules only, each of its parameter's
    shape in float32 (float64 for float64 weights); re-estimates of frozen modules only."""
    params = dict(model.named_parameters())
    averaged = {
        name: encoded_tensor(params[name].shape, average_dtype(params[name]))
        for module in partition.modules[frozen : partition.freezable]
        for name in module.params
        if name in params
    }
    return record({
        "span": integer(1),
        "updates": STEPS,
        "averages": keyed(averaged, "is not a parameter of an unfrozen module that may freeze"),
        "restats": items(
            record({
                "module": text(choices=partition.names[:frozen]),
                "left": integer(1, steps + 2**31),
                "momenta": items(optional(number(0, 1))),
            })
        ),
    })


def _partition(model: nn.Module, saved: list[dict], current: Partition | None, cap: Any) -> Partition:
    if current is not None:
        if saved != current.to_state():
            differs = next(
                (i for i, (a, b) in enumerate(zip(saved, current.to_state())) if a != b), min(len(saved), len(current))
            )
            shown = saved[differs] if differs < len(saved) else None
            raise StateError(
                f"state.partition[{differs}]", shown,
                f"differs from this model's layer modules {current.names}",
            )
        return current
    try:
        return cap(Partition.from_state(model, saved))
    except (ValueError, AssertionError) as err:
        raise StateError("state.partition", [m["name"] for m in saved], f"does not fit this model: {err}") from None


def policy_state_spec(policy: Any, context: SavedContext) -> Any:
    """What ``policy``'s saved state must hold (its ``state_spec``; a policy object of the
    user's without one is checked by its own ``load_state_dict``)."""
    spec = getattr(policy, "state_spec", None)
    return anything if spec is None else spec(context)
