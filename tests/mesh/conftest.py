"""Message types used only by the mesh tests, in a registry of their own.

The package's registry (:data:`p2ptrain.wire.MESSAGES`) is never touched: nodes that must
read these types are built with ``messages=TEST_MESSAGES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.wire import MESSAGES, message

TEST_MESSAGES = MESSAGES.copy()


@message("test.note", into=TEST_MESSAGES)
@dataclass(frozen=True)
class Note:
    text: str
    n: int = 0


@message("test.blob", into=TEST_MESSAGES)
@dataclass(frozen=True)
class Blob:
    data: str = field(metadata={"max_len": 1 << 20})
