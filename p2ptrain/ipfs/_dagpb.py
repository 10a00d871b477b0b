"""The two tiny protobufs of an IPFS file: dag-pb nodes (PBNode/PBLink) and the UnixFS ``Data`` inside them.

Hand-written rather than generated because they are small, because the encoder must produce Kubo's
exact bytes (the CID is a hash of them), and because the decoder reads bytes from untrusted peers: it
is strict (the dag-pb spec's canonical form, known fields and wire types only, every length bounded by
the block) so garbage is rejected with :class:`DecodeError` instead of being half-understood.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.ipfs._cid import CID, InvalidCID, parse_cid

# Bitswap and Kubo refuse blocks over 2 MiB; nothing we make comes near it (leaves are 256 KiB).
MAX_BLOCK_SIZE = 2 * 1024 * 1024
MAX_FILE_SIZE = 1 << 62
# Links in one node. Files have at most 174 (Kubo's balanced layout); a plain directory is turned into
# a HAMT shard by Kubo past 256 KiB of block (about 6,500 entries), whose nodes have at most 256 links.
# 8,192 admits all of those and keeps a 2 MiB block of 38-byte links (55,000) from being one node.
MAX_LINKS_PER_NODE = 8192
# A link's name (a directory entry): 255 bytes is the file name limit of every common filesystem;
# 1,024 leaves room for other tools' names and keeps names from being where a block's bytes go.
MAX_LINK_NAME_BYTES = 1024

# UnixFS Data.DataType values.
RAW_TYPE = 0
DIRECTORY = 1
FILE = 2
METADATA = 3
SYMLINK = 4
HAMT_SHARD = 5

_VARINT = 0
_LEN = 2


class DecodeError(ValueError):
    """Bytes that are not a well-formed dag-pb node or UnixFS message."""


@dataclass(frozen=True)
class PBLink:
    cid: CID
    name: str | None
    tsize: int | None


@dataclass(frozen=True)
class PBNode:
    links: list[PBLink]
    data: memoryview | None  # a view into the block: no copy of a 256 KiB leaf


@dataclass(frozen=True)
class UnixFSData:
    type: int
    data: memoryview | None = None  # a view into the decoded buffer
    filesize: int | None = None
    blocksizes: list[int] = field(default_factory=list)


# ---- encoding ------------------------------------------------------------------------------------


def varint(n: int) -> bytes:
    """Unsigned LEB128, as protobuf writes it."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(tag: int, payload: bytes) -> bytes:
    return bytes([tag]) + varint(len(payload)) + payload


def encode_file_leaf(chunk: bytes) -> bytes:
    """A dag-pb leaf holding ``chunk`` as UnixFS file data (Kubo's CIDv0 leaves); one copy of the chunk."""
    n = len(chunk)
    if n == 0:
        unixfs = b"\x08\x02\x18\x00"  # the empty file: Type=File, filesize=0, no Data field
    else:
        unixfs = b"".join((b"\x08\x02\x12", varint(n), chunk, b"\x18", varint(n)))
    return b"".join((b"\x0a", varint(len(unixfs)), unixfs))


def encode_file_node(links: list[tuple[bytes, int]], blocksizes: list[int]) -> bytes:
    """An inner file node: links ``(cid_bytes, tsize)`` in order, each child's file size in blocksizes."""
    parts = []
    for cid_bytes, tsize in links:
        link = b"".join((_len_field(0x0A, cid_bytes), b"\x12\x00", b"\x18", varint(tsize)))
        parts.append(_len_field(0x12, link))
    unixfs = b"".join(
        [b"\x08\x02", b"\x18", varint(sum(blocksizes))] + [b"\x20" + varint(s) for s in blocksizes]
    )
    parts.append(_len_field(0x0A, unixfs))
    return b"".join(parts)


# ---- decoding ------------------------------------------------------------------------------------


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    for i in range(10):
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            if i > 0 and b == 0:
                raise DecodeError("non-minimal varint")
            if result >= 1 << 63:
                raise DecodeError("varint out of range")
            return result, pos
    raise DecodeError("varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """Yield ``(field_number, wire_type, value)``; value is an int or a memoryview slice of ``buf``."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        value: int | memoryview
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos)
            if size > len(buf) - pos:
                raise DecodeError(f"field {number} claims {size} bytes, {len(buf) - pos} left")
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise DecodeError(f"field {number} has unsupported wire type {wire}")
        yield number, wire, value


def _expect(number: int, wire: int, want: int) -> None:
    if wire != want:
        raise DecodeError(f"field {number} has wire type {wire}, expected {want}")


def _decode_link(buf: memoryview) -> PBLink:
    cid = name = tsize = None
    last = 0
    for number, wire, value in _fields(buf):
        if number <= last:
            raise DecodeError("PBLink fields out of order or repeated")
        last = number
        if number == 1:
            _expect(number, wire, _LEN)
            try:
                cid = parse_cid(bytes(value))
            except InvalidCID as exc:
                raise DecodeError(f"PBLink hash: {exc}") from None
        elif number == 2:
            _expect(number, wire, _LEN)
            if len(value) > MAX_LINK_NAME_BYTES:
                raise DecodeError(f"PBLink name of {len(value)} bytes exceeds {MAX_LINK_NAME_BYTES}")
            try:
                name = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise DecodeError("PBLink name is not UTF-8") from None
        elif number == 3:
            _expect(number, wire, _VARINT)
            if value > MAX_FILE_SIZE:
                raise DecodeError(f"PBLink Tsize {value} out of range")
            tsize = value
        else:
            raise DecodeError(f"unknown PBLink field {number}")
    if cid is None:
        raise DecodeError("PBLink without a hash")
    return PBLink(cid, name, tsize)


def decode_node(block: bytes) -> PBNode:
    """Decode a dag-pb block strictly: links (field 2) first, then at most one Data (field 1)."""
    if len(block) > MAX_BLOCK_SIZE:
        raise DecodeError(f"block of {len(block)} bytes exceeds {MAX_BLOCK_SIZE}")
    links: list[PBLink] = []
    data = None
    for number, wire, value in _fields(memoryview(block)):
        if data is not None:
            raise DecodeError("PBNode field after Data")
        _expect(number, wire, _LEN)
        if number == 2:
            if len(links) >= MAX_LINKS_PER_NODE:
                raise DecodeError(f"more than {MAX_LINKS_PER_NODE} links in one node")
            links.append(_decode_link(value))
        elif number == 1:
            data = value
        else:
            raise DecodeError(f"unknown PBNode field {number}")
    return PBNode(links, data)


def decode_unixfs(data: bytes | memoryview) -> UnixFSData:
    """Decode a UnixFS ``Data`` message; mode/mtime/hash-type/fanout are checked for shape and ignored."""
    if len(data) > MAX_BLOCK_SIZE:
        raise DecodeError(f"UnixFS data of {len(data)} bytes exceeds {MAX_BLOCK_SIZE}")
    kind = payload = filesize = None
    blocksizes: list[int] = []
    seen: set[int] = set()
    for number, wire, value in _fields(memoryview(data)):
        if number in seen and number != 4:
            raise DecodeError(f"UnixFS field {number} repeated")
        seen.add(number)
        if number == 1:
            _expect(number, wire, _VARINT)
            if value > HAMT_SHARD:
                raise DecodeError(f"unknown UnixFS type {value}")
            kind = value
        elif number == 2:
            _expect(number, wire, _LEN)
            payload = value
        elif number == 3:
            _expect(number, wire, _VARINT)
            if value > MAX_FILE_SIZE:
                raise DecodeError(f"UnixFS filesize {value} out of range")
            filesize = value
        elif number == 4:
            _expect(number, wire, _VARINT)
            if value > MAX_FILE_SIZE:
                raise DecodeError(f"UnixFS blocksize {value} out of range")
            if len(blocksizes) >= MAX_LINKS_PER_NODE:
                raise DecodeError(f"more than {MAX_LINKS_PER_NODE} UnixFS blocksizes")
            blocksizes.append(value)
        elif number in (5, 6, 7):  # hashType, fanout, mode
            _expect(number, wire, _VARINT)
        elif number == 8:  # mtime (a nested message)
            _expect(number, wire, _LEN)
        else:
            raise DecodeError(f"unknown UnixFS field {number}")
    if kind is None:
        raise DecodeError("UnixFS message without a type")
    return UnixFSData(kind, payload, filesize, blocksizes)
