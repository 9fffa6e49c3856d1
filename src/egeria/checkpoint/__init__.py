"""What a checkpoint holds and how it is checked: ``saved_state`` (the engine's state dict
and what it is tied to), ``statecheck`` (the declarative checks every part's saved state
passes before it is used) and ``serialization`` (state folders on disk: one JSON file and
one tensor file, written atomically)."""

from __future__ import annotations

__all__: list[str] = []
