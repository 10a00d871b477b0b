"""Peers left out of plans for a while: a map of peer -> until when, kept small.

A peer named in a failed round, a coordinator that fell silent, a peer a round found unreachable:
each is left out for :data:`FAILED_PEER_QUARANTINE_S` (protocol/_round_book.py keeps the maps). The
peers come from the network, so a map holds only those left out now.

A replica the drivers convict again and again (:class:`Convictions`) is left out longer each time.
"""

from __future__ import annotations

# A peer named in a failed round (or a coordinator that fell silent) is left out of plans this long.
FAILED_PEER_QUARANTINE_S = 10.0
# A replica convicted again is left out twice as long as the last time, up to this long.
CONVICTED_MAX_S = 320.0
# A conviction this long after the last one's time out ended counts as a first one again.
CONVICTION_MEMORY_S = 600.0
MAX_CONVICTED_KEPT = 1024  # replicas whose convictions are remembered (the oldest dropped first)


def until_later(deadlines: dict[str, float], now: float) -> frozenset[str]:
    """The peers whose entry in ``deadlines`` (peer -> until when) has not run out at ``now``."""
    return frozenset(p for p, until in deadlines.items() if until > now)


def exclude(deadlines: dict[str, float], peer: str, now: float) -> None:
    """Leave ``peer`` out until FAILED_PEER_QUARANTINE_S from ``now``; entries that ran out go, so
    the map holds only the peers excluded now (reporters come from the network)."""
    for p in [p for p, until in deadlines.items() if until <= now]:
        del deadlines[p]
    deadlines[peer] = now + FAILED_PEER_QUARANTINE_S


class Convictions:
    """How long each replica a pipelined step's summary convicted (protocol/_stage_verdicts.py) is
    left out of plans: the quarantine the first time, then twice as long at each conviction that
    follows within :data:`CONVICTION_MEMORY_S` of the last one's end, up to :data:`CONVICTED_MAX_S`.

    Why: a replica comes back after its quarantine, and one that stalls every step is convicted
    again three steps later (pipeline/_stragglers.py). With spare members each return cost a failed
    step; in a run of exactly ``peers.min`` usable members nobody else could take its place, so the
    run waited out each 10 s quarantine and took the replica back, failing a step every ~25 s for
    the whole run. Doubling bounds what a repeat offender costs (a few steps per
    :data:`CONVICTED_MAX_S`), while an honest replica convicted once under a passing load is back
    after the usual 10 s. Pure: the caller passes the time; every member reads the same summaries,
    so every book convicts alike, and a new coordinator's book leaves out whom the last one did.
    """

    def __init__(self) -> None:
        self._records: dict[str, tuple[int, float]] = {}  # replica -> (convictions in a row, left out until)

    def convict(self, peer: str, now: float) -> float:
        """``peer`` convicted at ``now``: the seconds it is left out of plans from now."""
        times, until = self._records.pop(peer, (0, now))
        times = times + 1 if now <= until + CONVICTION_MEMORY_S else 1
        seconds = _length(times)
        self._records[peer] = (times, max(until, now + seconds))
        while len(self._records) > MAX_CONVICTED_KEPT:
            del self._records[next(iter(self._records))]
        return seconds

    def length(self, peer: str) -> float:
        """How long ``peer``'s latest time out is, in all (0 for a replica never convicted): what
        a status shows beside the seconds left, which a reader sees shrink as it reads them."""
        record = self._records.get(peer)
        return _length(record[0]) if record is not None else 0.0

    def out(self, now: float) -> dict[str, float]:
        """The replicas left out at ``now``, each with until when."""
        return {p: until for p, (_, until) in self._records.items() if until > now}


def _length(times: int) -> float:
    """A time out's length at the ``times``-th conviction in a row: the quarantine, doubled each time."""
    return min(FAILED_PEER_QUARANTINE_S * (1 << min(times - 1, 32)), CONVICTED_MAX_S)
