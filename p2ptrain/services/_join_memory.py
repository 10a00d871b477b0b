"""Which announced tasks this node will not try to join again yet, and until when.

A join that failed is not retried on every announcement: a hostile announcer repeating a bad CID
would cost a fetch each time. How long depends on why it failed: a task this node cannot run (or
bytes that are no task) is kept out for FAILED_JOIN_MEMORY_S; a join that failed only because no
peer had the task's bytes yet is tried again soon, later with each such failure. A pure state
machine: the caller passes the time (trio's clock in the node, any clock in a test).
"""

from __future__ import annotations

# How long a task CID whose join failed is not tried again: long enough that a hostile announcer
# repeating a bad CID costs one failed fetch per 10 minutes, short enough that a task whose data was
# briefly unreachable is joined again without restarting the node.
FAILED_JOIN_MEMORY_S = 600.0
# ... except a join that failed only because no peer could give the task's bytes yet (its members
# still fetching it, its publisher behind a NAT we have no route to yet): tried again after this,
# doubling with each such failure up to FAILED_JOIN_MEMORY_S. A NATed peer that heard a task first
# from another NATed peer was otherwise out of the run for 10 minutes, and a run whose peers.min
# counted it never started (seen in tests/wan/test_training_behind_nat.py).
UNAVAILABLE_JOIN_RETRY_S = 15.0
# Failed CIDs remembered at once (oldest forgotten first): bounds the memory a flood of distinct bad
# CIDs can take to ~1024 short entries.
MAX_FAILED_JOINS = 1024


class JoinMemory:
    """Failed joins by task CID: until when each is held off, and its failures in a row for want of
    bytes. An entry outlives its hold-off, so the next failure for want of bytes doubles the wait."""

    def __init__(self) -> None:
        self._failed: dict[str, tuple[float, int]] = {}  # task CID -> (held off until, misses in a row)

    def __len__(self) -> int:
        return len(self._failed)

    def failed(self, task_cid: str, now: float, *, unavailable: bool) -> None:
        """The join of ``task_cid`` failed at ``now``; ``unavailable``: only because no peer had its bytes."""
        _, misses = self._failed.pop(task_cid, (0.0, 0))
        while len(self._failed) >= MAX_FAILED_JOINS:
            self._failed.pop(next(iter(self._failed)))
        misses = misses + 1 if unavailable else 0
        memory = FAILED_JOIN_MEMORY_S
        if misses:
            memory = min(UNAVAILABLE_JOIN_RETRY_S * 2 ** (misses - 1), FAILED_JOIN_MEMORY_S)
        self._failed[task_cid] = (now + memory, misses)

    def held_off(self, task_cid: str, now: float) -> bool:
        """Whether an announcement of ``task_cid`` at ``now`` must not start a join."""
        failed = self._failed.get(task_cid)
        return failed is not None and now < failed[0]

    def joined(self, task_cid: str) -> None:
        """``task_cid`` was joined: its failures are forgotten."""
        self._failed.pop(task_cid, None)
