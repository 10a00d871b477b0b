"""The yamux frame header codec: the one checked parser of the 12 bytes before every frame.

A leaf of the muxer (``net/_muxer.py``): it decides, before any body is buffered, whether a header is
one a yamux peer may send (go-yamux's rules plus our largest window), with one error type.
"""

from __future__ import annotations

import struct

from libp2p.stream_muxer.yamux.yamux import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    HEADER_SIZE,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    YAMUX_HEADER_FORMAT,
)

__all__ = ["FRAME_HEADER", "RECV_WINDOW", "YamuxFrameError", "parse_frame_header"]

# Largest receive window per stream (go-yamux's maximum): the most unread data a stream can hold.
RECV_WINDOW = 16 << 20
FRAME_HEADER = struct.Struct(YAMUX_HEADER_FORMAT)
"""Version, type, flags, stream ID, length: packs and unpacks every frame header."""
_KNOWN_FLAGS = FLAG_SYN | FLAG_ACK | FLAG_FIN | FLAG_RST
_KNOWN_TYPES = (TYPE_DATA, TYPE_WINDOW_UPDATE, TYPE_PING, TYPE_GO_AWAY)


class YamuxFrameError(ValueError):
    """A frame header that no yamux peer may send; the connection is ended with GO_AWAY."""


def parse_frame_header(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """``(type, flags, stream_id, length)`` of a 12-byte yamux frame header, checked as go-yamux
    checks it: version 0, a known type, only known flags, a stream ID on DATA and WINDOW_UPDATE,
    and no DATA frame longer than the largest window we ever grant (:data:`RECV_WINDOW`), so a
    frame is refused before any of its body is buffered. :class:`YamuxFrameError` is its only error.
    """
    if len(raw) != HEADER_SIZE:
        raise YamuxFrameError(f"frame header of {len(raw)} bytes (expected {HEADER_SIZE})")
    version, typ, flags, stream_id, length = FRAME_HEADER.unpack(raw)
    if version != 0:
        raise YamuxFrameError(f"yamux version {version}")
    if typ not in _KNOWN_TYPES:
        raise YamuxFrameError(f"unknown frame type {typ}")
    if flags & ~_KNOWN_FLAGS:
        raise YamuxFrameError(f"unknown flags {flags:#x}")
    if typ in (TYPE_DATA, TYPE_WINDOW_UPDATE) and stream_id == 0:
        raise YamuxFrameError("DATA or WINDOW_UPDATE on stream 0")
    if typ == TYPE_DATA and length > RECV_WINDOW:
        raise YamuxFrameError(f"DATA frame of {length} B exceeds any window ({RECV_WINDOW} B)")
    return typ, flags, stream_id, length
