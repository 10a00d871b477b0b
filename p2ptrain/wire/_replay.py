"""Refuse replayed messages: a (sender, seq) pair is accepted once.

Senders start their sequence at the current time in microseconds and count up, so sequence numbers
keep growing across restarts without any stored state. The guard keeps a window of recent numbers
per sender; anything at or below the window's floor is refused too.

The guard's memory is bounded however many identities write to us (throwaway keys cost an
attacker nothing): at most ``max_entries`` numbers in all, and the senders heard from least
recently are forgotten first. Honest peers heartbeat every second, so they are always among the
most recent; a forgotten sender's old messages are still refused by the clock-skew check once
they are older than MAX_CLOCK_SKEW_S.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from libp2p.peer.id import ID

from p2ptrain.wire._limits import REPLAY_MAX_ENTRIES, REPLAY_WINDOW


class ReplayGuard:
    """Per-sender sliding window of seen sequence numbers, with a global bound on memory."""

    def __init__(self, window: int = REPLAY_WINDOW, max_entries: int = REPLAY_MAX_ENTRIES) -> None:
        self._window = window
        self._max_entries = max(max_entries, window)
        self._seen: OrderedDict[ID, tuple[set[int], list[int]]] = OrderedDict()
        self._entries = 0
        self.evicted = 0  # senders forgotten to stay within max_entries

    def __len__(self) -> int:
        """How many senders are remembered."""
        return len(self._seen)

    @property
    def entries(self) -> int:
        """How many sequence numbers are remembered, over all senders."""
        return self._entries

    def accept(self, sender: ID, seq: int) -> bool:
        """Record ``seq`` from ``sender``; return False if it was seen or is too old to judge."""
        window = self._seen.get(sender)
        if window is None:
            window = self._seen[sender] = (set(), [])
        else:
            self._seen.move_to_end(sender)
        seen, heap = window
        if seq in seen or (len(heap) >= self._window and seq <= heap[0]):
            return False
        seen.add(seq)
        heapq.heappush(heap, seq)
        self._entries += 1
        if len(heap) > self._window:
            seen.discard(heapq.heappop(heap))
            self._entries -= 1
        while self._entries > self._max_entries:
            _, (_, oldest_heap) = self._seen.popitem(last=False)
            self._entries -= len(oldest_heap)
            self.evicted += 1
        return True

    def forget(self, sender: ID) -> None:
        """Drop a sender's window (it left); its old messages are still stale by timestamp."""
        window = self._seen.pop(sender, None)
        if window is not None:
            self._entries -= len(window[1])
