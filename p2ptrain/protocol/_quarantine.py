"""Peers left out of plans for a while: a map of peer -> until when, kept small.

A peer named in a failed round, a coordinator that fell silent, a peer a round found unreachable:
each is left out for :data:`FAILED_PEER_QUARANTINE_S` (protocol/_round_book.py keeps the maps). The
peers come from the network, so a map holds only those left out now.
"""

from __future__ import annotations

# A peer named in a failed round (or a coordinator that fell silent) is left out of plans this long.
FAILED_PEER_QUARANTINE_S = 10.0


def until_later(deadlines: dict[str, float], now: float) -> frozenset[str]:
    """The peers whose entry in ``deadlines`` (peer -> until when) has not run out at ``now``."""
    return frozenset(p for p, until in deadlines.items() if until > now)


def exclude(deadlines: dict[str, float], peer: str, now: float) -> None:
    """Leave ``peer`` out until FAILED_PEER_QUARANTINE_S from ``now``; entries that ran out go, so
    the map holds only the peers excluded now (reporters come from the network)."""
    for p in [p for p, until in deadlines.items() if until <= now]:
        del deadlines[p]
    deadlines[peer] = now + FAILED_PEER_QUARANTINE_S
