"""How our log lines name peers, and how a flood of bad input is kept out of the log.

A leaf (imports nothing of ours), so every layer, including ``net/muxer.py`` below
``net/streams.py``, uses the same helpers instead of a copy. ``fmt_bytes`` and ``fmt_s`` keep values
in log lines short and readable (never a 17-digit float).
"""

from __future__ import annotations

import collections
import logging

from libp2p.peer.id import ID

# Characters of a base58 peer ID kept in log lines: its last 8 tell the peers of a run apart
# (58**8, about 1e14 values) and keep lines short. Logs and tests rely on this exact form.
SHORT_ID_CHARS = 8


def short_id(peer_id: ID | str) -> str:
    """The short form of a peer ID (an :class:`ID` or its base58 text) used in logs: its last 8 characters."""
    text = peer_id.to_base58() if isinstance(peer_id, ID) else str(peer_id)
    return text[-SHORT_ID_CHARS:]


def count_rejection(
    counters: collections.Counter[str], reason: str, log: logging.Logger, level: int, message: str,
    *args: object, exc_info: bool = False,
) -> None:
    """Count one rejection of remote input and log it, but only the 1st, 2nd, 4th, 8th, … of each
    reason: a peer that floods us with bad input must not flood the log (and the disk) as well."""
    counters[reason] += 1
    n = counters[reason]
    if n & (n - 1) == 0:
        log.log(level, message + " [%s: %d so far]", *args, reason, n, exc_info=exc_info)


def fmt_bytes(n: float) -> str:
    """Bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.1 GiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_s(seconds: float) -> str:
    """A duration for people: ``850 ms`` below 10 s, else ``12.3 s``."""
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"
