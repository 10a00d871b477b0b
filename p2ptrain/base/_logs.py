"""How our log lines name peers, and how a flood of bad input is kept out of the log.

A leaf (imports nothing of ours), so every layer, including ``net/_muxer.py`` below
``net/_streams.py``, uses the same helpers instead of a copy. ``fmt_bytes`` and ``fmt_s`` keep values
in log lines short and readable (never a 17-digit float).
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # libp2p costs ~1.3 s to import: the CLI's commands that never open a host skip it
    from libp2p.peer.id import ID

# Characters of a base58 peer ID kept in log lines: its last 8 tell the peers of a run apart
# (58**8, about 1e14 values) and keep lines short. Logs and tests rely on this exact form.
SHORT_ID_CHARS = 8


def short_id(peer_id: ID | str) -> str:
    """The short form of a peer ID (an :class:`ID` or its base58 text) used in logs: its last 8 characters."""
    text = peer_id if isinstance(peer_id, str) else peer_id.to_base58()
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
    """A duration for people: ``850 ms`` below a second, else ``12.3 s``."""
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


# The text form of every log line we write (stderr and <home>/logs/node.log).
TEXT_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
TEXT_DATEFMT = "%H:%M:%S"
LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers (``--log-format json``): ``ts`` (UTC, ISO 8601
    with milliseconds), ``level``, ``logger``, ``msg`` (the formatted message), and ``exc`` (the
    traceback) when there is one. The message is the same text as in the text format."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        line: dict[str, object] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def formatter(log_format: str = "text") -> logging.Formatter:
    """The formatter of ``log_format`` (one of :data:`LOG_FORMATS`)."""
    if log_format == "json":
        return JsonFormatter()
    return logging.Formatter(TEXT_FORMAT, TEXT_DATEFMT)
