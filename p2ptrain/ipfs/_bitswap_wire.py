"""Bitswap on the wire: length-prefixed protobuf messages, as Kubo and Helia speak them.

The message schema is Bitswap's own (``libp2p.bitswap.pb.bitswap_pb2``, the 1.0/1.1/1.2 ``Message``); this
module only frames and bounds it. Everything that arrives here comes from a peer, so:

* a message is at most :data:`MAX_MESSAGE_SIZE` bytes (the spec's 4 MiB; Kubo's reader has the same cap)
  and a block at most :data:`MAX_BLOCK_SIZE`; a frame announcing more is refused before it is buffered;
* a block's CID is *computed* from its bytes (sha2-256 of the data, named with the sender's CID prefix),
  never taken from the sender, so a block either is the one its CID names or names nothing we asked for.
  Prefixes with any other hash function are dropped: we cannot check them.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio
from google.protobuf.message import DecodeError as ProtobufDecodeError
from libp2p.abc import INetStream
from libp2p.bitswap.pb.bitswap_pb2 import Message
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.stream_muxer.exceptions import MuxedStreamEOF

from p2ptrain.ipfs._cid import CID, DAG_PB, RAW, InvalidCID, cid_from_digest, parse_cid
from p2ptrain.ipfs._dagpb import MAX_BLOCK_SIZE, varint

__all__ = [
    "PROTOCOLS",
    "MAX_MESSAGE_SIZE",
    "MAX_BLOCK_SIZE",
    "TARGET_MESSAGE_SIZE",
    "WireError",
    "WantEntry",
    "Received",
    "WireBlock",
    "encode_message",
    "decode_message",
    "block_prefix",
    "MessageReader",
    "ByteBudget",
]

# Newest first: multistream-select takes the first one both sides speak. 1.2.0 adds want-have and
# DontHave; 1.1.0 adds CID prefixes (CIDv1); 1.0.0 is CIDv0 blocks only.
PROTOCOLS: tuple[TProtocol, ...] = (
    TProtocol("/ipfs/bitswap/1.2.0"),
    TProtocol("/ipfs/bitswap/1.1.0"),
    TProtocol("/ipfs/bitswap/1.0.0"),
)
PROTOCOL_1_0 = PROTOCOLS[2]

MAX_MESSAGE_SIZE = 4 * 1024 * 1024
# What our sender packs into one message. Big messages mean few Python-level writes (the cost on a
# libp2p stream is per frame and per call, not per byte), while staying well under the 4 MiB cap.
TARGET_MESSAGE_SIZE = 2 * 1024 * 1024
# One read() asks the muxer for at most this much of a message whose size is known: yamux returns
# what it has buffered, up to this. A read never goes past the end of the current message.
READ_SIZE = 8 * 1024 * 1024
# What one read asks for while the next message's length prefix is not yet in: small, because
# those bytes are held before the message's size has been checked against the peer's budget.
HEAD_READ = 64 * 1024

# Wantlist entries and block presences one message may carry. Each entry costs a CID parse (tens
# of microseconds): a 4 MiB message of bare CIDs would be ~110,000 of them, seconds of CPU. Our
# server queues at most 8,192 wants per peer anyway (serving.MAX_PEER_WANTS), as Kubo does.
MAX_ENTRIES = 8192

_SHA2_256 = 0x12
_MH_PREFIX = b"\x12\x20"  # sha2-256, 32 bytes
_CODECS = {0x70: DAG_PB, 0x55: RAW}
_CODE_OF = {DAG_PB: 0x70, RAW: 0x55}


class WireError(ValueError):
    """A peer sent bytes that are not a Bitswap message we accept; the stream is dropped."""


@dataclass(frozen=True)
class WantEntry:
    """One wantlist entry as received: a want (block or have) or a cancel."""

    cid: CID
    cancel: bool = False
    want_have: bool = False
    send_dont_have: bool = False


@dataclass(frozen=True, slots=True)
class WireBlock:
    """A received block, named by the sha2-256 multihash of its own bytes (computed here, never sent).

    Kept as plain bytes rather than a :class:`CID` on purpose: building a ``multiformats`` CID costs
    ~0.2 ms of type validation, more than hashing a 256 KiB block; :meth:`cid` makes one when needed.
    """

    multihash: bytes
    version: int
    codec: str
    data: bytes

    def cid(self) -> CID:
        return cid_from_digest(self.multihash[2:], self.codec, self.version)


@dataclass
class Received:
    """A decoded message."""

    wants: list[WantEntry] = field(default_factory=list)
    full_wantlist: bool = False
    blocks: list[WireBlock] = field(default_factory=list)
    haves: list[CID] = field(default_factory=list)
    dont_haves: list[CID] = field(default_factory=list)
    dropped_blocks: int = 0  # blocks we could not name (unknown codec or hash): never trusted
    ignored_wants: int = 0  # wants for CIDs we do not handle (other codecs or hashes)


def block_prefix(cid: CID) -> bytes:
    """Bitswap 1.1's CID prefix: version, codec, multihash code and length, as varints."""
    return b"".join(
        (varint(cid.version), varint(_CODE_OF[cid.codec.name]), varint(_SHA2_256), varint(32))
    )


def _read_varint(buf: bytes | bytearray, pos: int) -> tuple[int, int]:
    """``(value, next_pos)``; ``(-1, pos)`` when ``buf`` ends before the varint does."""
    result = shift = 0
    while pos < len(buf):
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 9 bytes")
    return -1, pos


def _name_block(prefix: bytes, data: bytes) -> WireBlock | None:
    """Name ``data`` with the sender's ``prefix``; None if the prefix is one we cannot verify."""
    version, pos = _read_varint(prefix, 0)
    codec, pos = _read_varint(prefix, pos)
    mh_code, pos = _read_varint(prefix, pos)
    mh_len, pos = _read_varint(prefix, pos)
    if pos != len(prefix) or mh_code != _SHA2_256 or mh_len != 32 or codec not in _CODECS:
        return None
    if version not in (0, 1) or (version == 0 and codec != 0x70):
        return None
    return WireBlock(_MH_PREFIX + hashlib.sha256(data).digest(), version, _CODECS[codec], data)


def encode_message(
    *,
    wants: Iterable[WantEntry] = (),
    blocks: Iterable[tuple[CID, bytes]] = (),
    haves: Iterable[CID] = (),
    dont_haves: Iterable[CID] = (),
    protocol: str = PROTOCOLS[0],
) -> bytes:
    """One message with its varint length prefix, in the form ``protocol`` understands."""
    msg = Message()
    for want in wants:
        entry = msg.wantlist.entries.add()
        entry.block = bytes(want.cid)
        if want.cancel:
            entry.cancel = True
        else:
            entry.priority = 1
            if protocol != PROTOCOL_1_0:
                entry.wantType = Message.Wantlist.Have if want.want_have else Message.Wantlist.Block
                entry.sendDontHave = want.send_dont_have
    if protocol != PROTOCOL_1_0:
        for cid in haves:
            msg.blockPresences.add(cid=bytes(cid), type=Message.Have)
        for cid in dont_haves:
            msg.blockPresences.add(cid=bytes(cid), type=Message.DontHave)
    # Blocks are encoded by hand and appended: protobuf lets a message be the concatenation of its
    # fields, and building them through the protobuf API copies every block twice more (~5 ms per
    # 2 MiB message, a third of a server's time per message when measured).
    parts = [msg.SerializeToString()]
    for cid, data in blocks:
        if protocol == PROTOCOL_1_0:  # 1.0 peers only know CIDv0 and hash the data themselves
            parts += (b"\x12", varint(len(data)), data)  # Message.blocks = 2
        else:
            prefix = block_prefix(cid)
            head = b"\x0a" + varint(len(prefix)) + prefix + b"\x12" + varint(len(data))
            parts += (b"\x1a", varint(len(head) + len(data)), head, data)  # Message.payload = 3
    size = sum(map(len, parts))
    return b"".join([varint(size), *parts])


def _parse_peer_cid(raw: bytes) -> CID | None:
    """The CID, or None for one we do not handle (another codec or hash: a Kubo peer may well want
    dag-cbor blocks from everyone it knows; that is not an offence, we just never have them)."""
    try:
        return parse_cid(raw)
    except InvalidCID:
        return None


def decode_message(body: bytes) -> Received:
    """Decode one message body (without its length prefix); :class:`WireError` is its only error."""
    if len(body) > MAX_MESSAGE_SIZE:
        raise WireError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_SIZE}")
    msg = Message()
    try:
        msg.ParseFromString(body)
    except ProtobufDecodeError as exc:
        raise WireError(f"not a Bitswap message: {exc}") from None
    if len(msg.wantlist.entries) > MAX_ENTRIES or len(msg.blockPresences) > MAX_ENTRIES:
        raise WireError(
            f"message with {len(msg.wantlist.entries)} wants and {len(msg.blockPresences)} "
            f"presences (at most {MAX_ENTRIES} each)"
        )
    out = Received(full_wantlist=msg.wantlist.full)
    for entry in msg.wantlist.entries:
        cid = _parse_peer_cid(entry.block)
        if cid is None:
            out.ignored_wants += 1
            continue
        out.wants.append(
            WantEntry(
                cid=cid,
                cancel=entry.cancel,
                want_have=entry.wantType == Message.Wantlist.Have,
                send_dont_have=entry.sendDontHave,
            )
        )
    for data in msg.blocks:  # 1.0: CIDv0 dag-pb implied
        if len(data) > MAX_BLOCK_SIZE:
            out.dropped_blocks += 1
            continue
        out.blocks.append(WireBlock(_MH_PREFIX + hashlib.sha256(data).digest(), 0, DAG_PB, data))
    for block in msg.payload:
        data = block.data
        named = _name_block(block.prefix, data) if len(data) <= MAX_BLOCK_SIZE else None
        if named is None:
            out.dropped_blocks += 1
        else:
            out.blocks.append(named)
    for presence in msg.blockPresences:
        cid = _parse_peer_cid(presence.cid)
        if cid is not None:
            (out.haves if presence.type == Message.Have else out.dont_haves).append(cid)
    return out


class ByteBudget:
    """Bytes of received messages one peer may hold with us at once, over all its streams.

    A message's whole announced size is taken from the budget as soon as its length prefix is in
    (before its body arrives), and given back when the next message is asked for: a peer that opens
    many streams and leaves a large message half-sent on each pins at most ``limit`` bytes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class MessageReader:
    """Reads length-prefixed messages off a stream with few, large reads, within deadlines and a
    byte budget.

    Reading the stream in big gulps matters for speed: each ``read()`` on a py-libp2p yamux stream costs
    Python work and may send a window update. Pieces are kept as read and joined once per message, so a
    2 MiB block message is copied once here, not once per read. A read never asks for more than the
    rest of the current message (or :data:`HEAD_READ` while its length is unknown), so what this
    reader holds is the current message, reserved in ``budget``, plus at most one small read.

    Deadlines: the next message must begin within ``idle_timeout`` (else the stream ends cleanly:
    :meth:`next_body` returns None) and, once begun, be complete within ``message_timeout`` (else
    :class:`WireError`).
    """

    def __init__(
        self,
        stream: INetStream,
        budget: ByteBudget | None = None,
        *,
        idle_timeout: float = math.inf,
        message_timeout: float = math.inf,
    ) -> None:
        self._stream = stream
        self._pieces: deque[bytes | memoryview] = deque()
        self._size = 0  # bytes held in _pieces
        self._budget = budget
        self._reserved = 0  # bytes of the current message taken from the budget
        self._idle_timeout = idle_timeout
        self._message_timeout = message_timeout

    @property
    def held(self) -> int:
        """Bytes this reader holds now: the message being read and what was read past it."""
        return self._size

    def release(self) -> None:
        """Give the current message's bytes back to the budget (done by :meth:`next_body` for the
        previous message; call it once the stream ends)."""
        if self._budget is not None and self._reserved:
            self._budget.give(self._reserved)
        self._reserved = 0

    async def next_body(self) -> bytes | None:
        """The next message body, or None at a clean end of stream (or idle timeout) between messages."""
        self.release()
        started = trio.current_time()
        deadline = started + self._idle_timeout if not self._size else started + self._message_timeout
        while True:
            size, header = _read_varint(self._peek(10), 0)
            if size > MAX_MESSAGE_SIZE:
                raise WireError(f"message of {size} bytes exceeds {MAX_MESSAGE_SIZE}")
            if size >= 0 and not self._reserved and self._budget is not None:
                if not self._budget.take(max(size, 1)):
                    raise WireError(
                        f"message of {size} bytes is over this peer's budget "
                        f"({self._budget.used} of {self._budget.limit} bytes in flight)"
                    )
                self._reserved = max(size, 1)
            if size >= 0 and self._size >= header + size:
                self._take(header)
                return self._take(size)
            want = header + size - self._size if size >= 0 else HEAD_READ
            with trio.move_on_after(max(0.0, deadline - trio.current_time())):
                chunk = await _read_or_eof(self._stream, min(want, READ_SIZE))
                if not chunk:
                    if self._size:
                        raise WireError(f"stream ended inside a message ({self._size} bytes pending)")
                    return None
                if not self._size:  # a message begins: it has message_timeout from now
                    deadline = trio.current_time() + self._message_timeout
                self._pieces.append(chunk)
                self._size += len(chunk)
                continue
            if self._size:
                raise WireError(
                    f"message incomplete after {self._message_timeout:g} s ({self._size} bytes in)"
                )
            return None  # idle

    def _peek(self, n: int) -> bytes:
        out = b""
        for piece in self._pieces:
            out += piece[: n - len(out)]
            if len(out) >= n:
                break
        return out

    def _take(self, n: int) -> bytes:
        parts = []
        while n:
            piece = self._pieces.popleft()
            if len(piece) > n:
                piece = memoryview(piece)  # split without copying the rest
                self._pieces.appendleft(piece[n:])
                piece = piece[:n]
            parts.append(piece)
            n -= len(piece)
            self._size -= len(piece)
        return parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)


async def _read_or_eof(stream: INetStream, n: int) -> bytes:
    """One read of at most ``n`` bytes; b"" at end of stream (py-libp2p raises EOF errors rather
    than returning b"")."""
    try:
        return await stream.read(n)
    except (StreamEOF, MuxedStreamEOF):
        return b""
