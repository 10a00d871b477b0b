"""Refuse replayed messages: a (sender, seq) pair is accepted once.

Senders start their sequence at the current time in microseconds and count up, so sequence numbers
keep growing across restarts without any stored state. The guard keeps a window of recent numbers
per sender; anything at or below the window's floor is refused too.
"""

from __future__ import annotations

import heapq

from libp2p.peer.id import ID

from p2ptrain.wire.limits import REPLAY_WINDOW


class ReplayGuard:
    """Per-sender sliding window of seen sequence numbers."""

    def __init__(self, window: int = REPLAY_WINDOW) -> None:
        self._window = window
        self._seen: dict[ID, tuple[set[int], list[int]]] = {}

    def accept(self, sender: ID, seq: int) -> bool:
        """Record ``seq`` from ``sender``; return False if it was seen or is too old to judge."""
        seen, heap = self._seen.setdefault(sender, (set(), []))
        if seq in seen or (len(heap) >= self._window and seq <= heap[0]):
            return False
        seen.add(seq)
        heapq.heappush(heap, seq)
        if len(heap) > self._window:
            seen.discard(heapq.heappop(heap))
        return True

    def forget(self, sender: ID) -> None:
        """Drop a sender's window (it left); its old messages are still stale by timestamp."""
        self._seen.pop(sender, None)
