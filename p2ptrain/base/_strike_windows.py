"""Strikes in a sliding window, per peer: the one record behind "bad in k of its last n".

Why: two judges need it, each of a peer that hurts a pipelined run without a lie to catch. A driver
judges a replica a straggler when it stalled ``k`` of the last ``n`` steps (pipeline/_stragglers.py);
every member judges a driver the step's culprit when its step failed alone in ``k`` of the last
``n`` summaries (protocol/_stage_verdicts.py). A window, not a streak: a peer that lets every third
step through would never complete a streak. The records are bounded (plans change members; the
peer judged longest ago is forgotten first). Pure: no clock, the caller hands in each judgement.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable


class StrikeWindows:
    """Each peer's last ``window`` judgements (a strike or not), for at most ``max_kept`` peers."""

    def __init__(self, limit: int, window: int, max_kept: int) -> None:
        if not 1 <= limit <= window or max_kept < 1:
            raise ValueError("strike windows need 1 <= limit <= window and max_kept >= 1")
        self.limit, self.window, self.max_kept = limit, window, max_kept
        self._records: dict[Hashable, collections.deque[bool]] = {}  # the most recently judged last

    def note(self, peer: Hashable, strike: bool) -> bool:
        """One more judgement of ``peer``: whether it now has ``limit`` strikes in its window."""
        record = self._records.pop(peer, None) or collections.deque(maxlen=self.window)
        self._records[peer] = record
        while len(self._records) > self.max_kept:
            del self._records[next(iter(self._records))]
        record.append(strike)
        return sum(record) >= self.limit

    def forget(self, peer: Hashable) -> None:
        """Start ``peer``'s record again (it was judged: back after its quarantine with a clean one)."""
        self._records.pop(peer, None)

    def __len__(self) -> int:
        return len(self._records)
