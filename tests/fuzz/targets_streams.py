"""Fuzz targets of the inbound stream handlers' decoders: Bitswap messages (one body, and the
length-prefixed reader over a whole stream), collective frame headers and ABORT bodies, yamux frame
headers and Noise message framing."""

from __future__ import annotations

import struct

import trio
from _p2ptrain_fuzzing import FuzzTarget
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2ptrain.ipfs import MAX_MESSAGE_SIZE, make_cid
from p2ptrain.ipfs._bitswap_wire import ByteBudget, MessageReader, WantEntry, WireError, decode_message, encode_message
from p2ptrain.net._yamux_frames import YamuxFrameError, parse_frame_header
from p2ptrain.net._noise import NoiseFrameError, message_spans
from p2ptrain.wire import HEADER, Header, Kind, abort_frame, parse_abort, parse_header
from p2ptrain.wire._frames import FrameError

_LEAF = make_cid(b"leaf", version=1)
_V0 = make_cid(b"v0 leaf", codec="dag-pb", version=0)
_PEER = ID.from_pubkey(create_new_key_pair().public_key)


def _body(wire: bytes) -> bytes:
    """A message without its varint length prefix."""
    i = 0
    while wire[i] & 0x80:
        i += 1
    return wire[i + 1 :]


_MESSAGES = [
    encode_message(wants=[WantEntry(_LEAF, send_dont_have=True)], blocks=[(_LEAF, b"leaf")], dont_haves=[_LEAF]),
    encode_message(wants=[WantEntry(_V0, cancel=True), WantEntry(_LEAF, want_have=True)], haves=[_V0]),
    encode_message(blocks=[(_V0, b"v0 leaf")], protocol="/ipfs/bitswap/1.0.0"),
]


class _Bytes:
    """A stream that returns ``data`` in reads of at most 7 bytes, then ends."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)

    async def read(self, n: int) -> bytes:
        await trio.lowlevel.checkpoint()
        out, self._data = bytes(self._data[: min(n, 7)]), self._data[min(n, 7) :]
        return out


def _read_stream(data: bytes) -> list[bytes]:
    """Every message of ``data`` read as a stream, within a budget of one maximum message."""

    async def run() -> list[bytes]:
        budget = ByteBudget(MAX_MESSAGE_SIZE)
        reader = MessageReader(_Bytes(data), budget)
        out = []
        try:
            while (body := await reader.next_body()) is not None:
                decode_message(body)
                out.append(body)
                assert reader.held <= len(data)
        finally:
            reader.release()
            assert budget.used == 0
        return out

    return trio.run(run)


def _collective_frame(data: bytes) -> object:
    header = parse_header(data)
    if header.kind == Kind.ABORT:
        culprit, reason = parse_abort(data, header)
        assert len(reason.encode("utf-8", "replace")) <= 4 * 512
        return culprit
    return header


def _noise_spans(data: bytes) -> int:
    spans, off = message_spans(data, len(data))
    assert off <= len(data) and all(start + size <= len(data) for start, size in spans)
    return off


_YAMUX = struct.Struct(">BBHII")

TARGETS = [
    FuzzTarget("bitswap.message", decode_message, (WireError,), [_body(m) for m in _MESSAGES]),
    FuzzTarget("bitswap.stream", _read_stream, (WireError,), [b"".join(_MESSAGES), _MESSAGES[0]]),
    FuzzTarget(
        "collective.frame",
        _collective_frame,
        (FrameError,),
        [
            Header(Kind.HELLO, 7).pack() + bytes(32),
            Header(Kind.DATA, 1, 2, 3, 0, 16, 1).pack() + bytes(64),
            abort_frame(9, _PEER, "did not answer"),
            Header(Kind.BUSY, 3).pack(),
        ],
    ),
    FuzzTarget(
        "yamux.header",
        parse_frame_header,
        (YamuxFrameError,),
        [
            _YAMUX.pack(0, 0, 0x1, 1, 1024),  # DATA with SYN
            _YAMUX.pack(0, 1, 0x2, 2, 262144),  # WINDOW_UPDATE with ACK
            _YAMUX.pack(0, 2, 0x1, 0, 77),  # PING
            _YAMUX.pack(0, 3, 0, 0, 0),  # GO_AWAY
        ],
    ),
    FuzzTarget(
        "noise.framing",
        _noise_spans,
        (NoiseFrameError,),
        [b"\x00\x10" + bytes(16), b"\x00\x20" + bytes(32) + b"\x00\x11" + bytes(5)],
    ),
]

assert HEADER.size == 24
