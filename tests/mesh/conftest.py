"""Message types used only by the mesh tests (registered once per test session)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.wire.messages import MESSAGE_TYPES, message

if "test.note" not in MESSAGE_TYPES:

    @message("test.note")
    @dataclass(frozen=True)
    class Note:
        text: str
        n: int = 0

    @message("test.blob")
    @dataclass(frozen=True)
    class Blob:
        data: str = field(metadata={"max_len": 1 << 20})

Note = MESSAGE_TYPES["test.note"]
Blob = MESSAGE_TYPES["test.blob"]
