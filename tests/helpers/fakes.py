"""Fake transports for the controller: the same service loop, with the test deciding
when messages are delivered (not a test file)."""

from __future__ import annotations

from typing import Any

from egeria.knowledge.executors import InlineExecutor
from egeria.knowledge.protocol import Control
from egeria.knowledge.weights import PackedState


class Recorder(InlineExecutor):
    """An inline executor that keeps a copy of every message it was given, in order."""

    def __init__(self, spec, **kw) -> None:
        super().__init__(spec, **kw)
        self.messages: list[tuple[str, Any]] = []

    def weights(self, state, keys):
        return PackedState(state, keys)  # a copy, so the recording keeps this step's values

    def _put(self, channel, message) -> None:
        kind = {id(self.channels.requests): "request", id(self.channels.readouts): "readout"}.get(id(channel))
        if kind is None:
            kind = message.kind
        self.messages.append((kind, message))
        super()._put(channel, message)


class Delayed(InlineExecutor):
    """A controller whose evaluations wait in an outbox until the test delivers them: an
    asynchronous controller whose answers come exactly as late as the test says. Control
    messages are obeyed at once, as the real service reads them before evaluations."""

    def __init__(self, spec, **kw) -> None:
        super().__init__(spec, **kw)
        self.outbox: list[tuple[Any, Any]] = []
        self.delivered = 0

    def weights(self, state, keys):
        return PackedState(state, keys)  # handled later: a copy of this step's weights

    def _put(self, channel, message) -> None:
        if not isinstance(message, Control):
            self.outbox.append((channel, message))
        elif message.kind in ("state", "load", "stop"):
            channel.put_nowait(message)
            self.deliver()  # these wait for every evaluation sent before them
        else:
            channel.put_nowait(message)
            self.service.obey_control()

    def wait(self, seqs):
        """The training side waits for answers due now: the controller gets to them."""
        self.deliver()
        return super().wait(seqs)

    def deliver(self, upto: int | None = None) -> None:
        """Hands the controller the messages sent so far (the first ``upto`` ever sent)."""
        upto = len(self.outbox) if upto is None else upto
        for channel, message in self.outbox[self.delivered : upto]:
            channel.put_nowait(message)
        self.delivered = max(self.delivered, upto)
        self.service.pump()
