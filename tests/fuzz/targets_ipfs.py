"""Fuzz targets of the content layer: dag-pb nodes and UnixFS data (from any peer's blocks), CIDs (in
links, Bitswap messages, announcements and manifests), the pin file (on disk), and a one-block file
read (the reader's own checks on a node a peer made)."""

from __future__ import annotations

import hashlib
import io
import json

from _p2ptrain_fuzzing import FuzzTarget

from p2ptrain.ipfs import (
    BlockMismatch,
    DAG_PB,
    DagError,
    DecodeError,
    InvalidCID,
    PinFileError,
    cid_from_digest,
    cid_str,
    decode_node,
    decode_unixfs,
    encode_file_leaf,
    encode_file_node,
    import_stream,
    make_cid,
    parse_cid,
    read_file,
)
from p2ptrain.ipfs._blockstore import parse_pins

_FILE_BLOCKS = list(import_stream(io.BytesIO(b"hello world\n" * 30_000)))  # two leaves and a root
_NODES = [encode_file_leaf(b""), encode_file_leaf(b"hello world\n"), _FILE_BLOCKS[-1][1], b""]
_UNIXFS = [bytes(decode_node(n).data) for n in _NODES[:3]]
_CIDS = [bytes(cid) for cid, _ in _FILE_BLOCKS] + [bytes(make_cid(b"x"))]
_CID_TEXT = [cid_str(cid).encode() for cid, _ in _FILE_BLOCKS] + [cid_str(make_cid(b"x")).encode()]
_PINS = [json.dumps({"version": 1, "pins": {_CID_TEXT[0].decode(): "recursive",
                                             _CID_TEXT[-1].decode(): "direct"}}).encode()]


def _parse_cid_text(data: bytes) -> object:
    return parse_cid(data.decode("utf-8", errors="replace"))


class _Missing(LookupError):
    """A child block the fuzzed node links to (the fuzz case is one block: children are absent)."""


def _read_one_block(data: bytes) -> object:
    """Read a fuzzed block as a file's root; its children are missing, so only the node's own
    checks (types, sizes, the empty-subtree rule, the byte limit) can decide."""
    root = cid_from_digest(hashlib.sha256(data).digest(), DAG_PB, 0)

    def get(cid):
        if cid.digest == root.digest:
            return data
        raise _Missing(cid_str(cid))

    return b"".join(read_file(root, get, max_bytes=1 << 20))


TARGETS = [
    FuzzTarget("ipfs.dagpb.node", decode_node, (DecodeError,), _NODES),
    FuzzTarget("ipfs.unixfs.data", decode_unixfs, (DecodeError,), _UNIXFS),
    FuzzTarget("ipfs.cid.bytes", parse_cid, (InvalidCID,), _CIDS),
    FuzzTarget("ipfs.cid.text", _parse_cid_text, (InvalidCID,), _CID_TEXT),
    FuzzTarget("ipfs.pins_file", parse_pins, (PinFileError,), _PINS),
    FuzzTarget("ipfs.unixfs.read_root", _read_one_block, (DagError, BlockMismatch, _Missing),
               [encode_file_leaf(b"hello"), encode_file_node([], [])]),
]
