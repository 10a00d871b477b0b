"""The schemas of every message that travels on pubsub, registered by type name.

A message is a frozen dataclass checked by :mod:`p2ptrain.wire.schema`. Adding a type means adding
a class here with ``@message("name")``; a receiver drops any type it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

MESSAGE_TYPES: dict[str, type] = {}

M = TypeVar("M")


def message(name: str) -> Callable[[type[M]], type[M]]:
    """Register a dataclass as the schema of message type ``name``."""

    def register(cls: type[M]) -> type[M]:
        if name in MESSAGE_TYPES:
            raise ValueError(f"message type {name!r} registered twice")
        MESSAGE_TYPES[name] = cls
        cls.TYPE = name  # type: ignore[attr-defined]
        return cls

    return register


def type_name(msg: Any) -> str:
    """The registered type name of a message instance."""
    return type(msg).TYPE  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Capabilities:
    """What a peer offers, so tasks can pick peers that fit their requirements."""

    device: str  # "cpu" or "cuda"
    cpu_count: int
    free_ram_bytes: int
    version: str
    gpu_name: str | None = None
    gpu_memory_bytes: int | None = None


@message("heartbeat")
@dataclass(frozen=True)
class Heartbeat:
    """Sent every heartbeat interval on the membership topic: 'I am alive, here is how to reach me'."""

    addrs: tuple[str, ...] = field(metadata={"max_items": 16})
    caps: Capabilities
    tasks: tuple[str, ...] = field(default=(), metadata={"max_items": 64})


@message("goodbye")
@dataclass(frozen=True)
class Goodbye:
    """Sent on clean shutdown so peers mark us gone at once instead of after the liveness timeout."""

    reason: str = field(default="", metadata={"max_len": 256})
