"""Parse JSON from the network or disk with explicit bounds: nesting depth, number ranges, size.

Why not plain :func:`json.loads`: its C decoder recurses per level, so 100,000 ``[`` raise
``RecursionError`` (which callers did not expect), it turns ``1e400`` into ``inf`` and
accepts ``NaN``, and it parses a 400-digit integer that later overflows a float comparison
(``abs(now - 10**400)`` raised ``OverflowError`` and stopped a node). Every decoder of untrusted
JSON goes through :func:`loads`, which raises one declared error, :class:`JSONBoundsError`, for
all of that. Its counterpart :func:`canonical` is the one encoder of JSON whose bytes are hashed
into a CID or signed. This module is a leaf: it imports nothing of ours.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

# Deeper than any document we produce (tasks and records nest four levels); far below the
# interpreter's recursion limit, so neither the decoder nor a recursive walk over the result can
# overflow the stack.
MAX_DEPTH = 32
# Integers we accept are signed 64-bit: every count, size and sequence number fits, and so does any
# timestamp; nothing larger can be compared with a float without overflowing.
MAX_INT = 2**63 - 1
MIN_INT = -(2**63)
# The longest literal that can still be a 64-bit integer ("-9223372036854775808"); checked before
# int() runs, so a 4,000-digit number costs nothing.
_MAX_INT_DIGITS = 20

# A JSON string, as "unrolled" runs of plain characters between escapes: one step per run, where
# an alternation per character took 10 ms over a 57 KB message (the regex was most of its decode).
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


class JSONBoundsError(ValueError):
    """The text is not JSON, or is JSON outside our bounds (depth, number range, size)."""


def nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of JSON text, without recursing (strings are skipped)."""
    skeleton = _STRINGS.sub(b"", data)
    if not skeleton:
        return 0
    steps = _OPEN[np.frombuffer(skeleton, dtype=np.uint8)]
    if not steps.any():
        return 0
    return int(np.cumsum(steps, dtype=np.int64).max())


def _int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS - 1:
        raise JSONBoundsError(f"integer of {len(text)} digits is out of range")
    value = int(text)
    if not MIN_INT <= value <= MAX_INT:
        raise JSONBoundsError("integer is out of the signed 64-bit range")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONBoundsError(f"number {text[:32]} is out of the float range")
    return value


def _constant(name: str) -> Any:
    raise JSONBoundsError(f"non-finite number {name}")


def loads(
    data: bytes | str,
    *,
    max_bytes: int | None = None,
    max_depth: int = MAX_DEPTH,
    what: str = "JSON",
) -> Any:
    """Parse ``data`` as JSON within bounds; raise :class:`JSONBoundsError` (naming ``what``) otherwise.

    Integers must fit in a signed 64-bit range, floats must be finite, NaN and Infinity are
    refused, and no array or object may nest deeper than ``max_depth``.
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if max_bytes is not None and len(raw) > max_bytes:
        raise JSONBoundsError(f"{what}: {len(raw)} B is over the {max_bytes} B limit")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise JSONBoundsError(f"{what}: nested {depth} levels deep, over the limit of {max_depth}")
    try:
        return json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except JSONBoundsError as exc:
        raise JSONBoundsError(f"{what}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise JSONBoundsError(f"{what}: not JSON ({exc})") from None


def canonical(value: Any) -> bytes:
    """The canonical JSON bytes of ``value``: sorted keys, no spaces, ASCII (``\\u`` escapes).

    The one encoder of every document that is hashed into a CID or signed (wire messages, signed
    bodies and records, task files, dataset manifests, model cards), so one value has one encoding,
    the one peers running older code produce too (tests/wire/test_canonical.py pins it). NaN and
    Infinity raise ``ValueError``: :func:`loads` refuses them, so a document carrying one could never
    be read back.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
