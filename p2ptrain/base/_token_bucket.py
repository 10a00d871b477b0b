"""The one token-bucket refill: what a bucket holds at ``now``.

Two rate gates keep buckets (pubsub's per-peer inbound read in ``net``, the per-sender message
types in ``mesh``); each keeps its own table and decides what a token costs, but both must refill
the same way, so that a rate said in one place means the same in the other.
"""

from __future__ import annotations


def refilled(tokens: float, at: float, now: float, per_s: float, burst: float) -> float:
    """Tokens a bucket that held ``tokens`` at ``at`` holds at ``now``: refilled at ``per_s`` a
    second, never above ``burst``. A clock that went back (``now < at``) refills nothing."""
    return min(float(burst), tokens + max(0.0, now - at) * per_s)
