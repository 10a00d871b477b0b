"""CIDs: parse what users and peers hand us, print them the way Kubo does, and check blocks against them.

A thin layer over the ``multiformats`` package. It exists so the rest of p2ptrain has one place that
decides which CIDs we accept (CIDv0/CIDv1, dag-pb or raw, sha2-256 — what Kubo's ``ipfs add`` makes) and
one clear error type for a bad one. Block verification is the security boundary of the content layer:
every byte that arrives by CID passes through :func:`verify_block` before anything else reads it.
"""

from __future__ import annotations

import hashlib

from multiformats import CID

__all__ = [
    "CID",
    "DAG_PB",
    "RAW",
    "InvalidCID",
    "BlockMismatch",
    "parse_cid",
    "cid_str",
    "make_cid",
    "cid_from_digest",
    "verify_block",
]

DAG_PB = "dag-pb"
RAW = "raw"
SUPPORTED_CODECS = frozenset({DAG_PB, RAW})
# sha2-256 is what every Kubo default produces; other hash functions are refused rather than trusted
# blindly (a peer could otherwise name a block by a weak or identity "hash").
SHA2_256 = "sha2-256"


class InvalidCID(ValueError):
    """A string or byte sequence is not a CID p2ptrain accepts."""


class BlockMismatch(ValueError):
    """A block's bytes do not hash to the multihash in its CID."""

    def __init__(self, cid: CID, message: str) -> None:
        super().__init__(f"block {cid_str(cid)}: {message}")
        self.cid = cid


def parse_cid(value: CID | str | bytes) -> CID:
    """Return ``value`` as a :class:`CID`, refusing anything outside dag-pb/raw over sha2-256."""
    if isinstance(value, CID):
        cid = value
    else:
        try:
            cid = CID.decode(value.strip() if isinstance(value, str) else value)
        except Exception as exc:  # multiformats raises a zoo of types; the caller needs one
            shown = value if isinstance(value, str) else value.hex()
            raise InvalidCID(f"not a CID: {shown[:100]!r} ({exc})") from None
    if cid.codec.name not in SUPPORTED_CODECS:
        raise InvalidCID(f"CID {cid} uses codec {cid.codec.name}; only dag-pb and raw are supported")
    if cid.hashfun.name != SHA2_256 or len(cid.raw_digest) != 32:
        raise InvalidCID(f"CID {cid} uses hash {cid.hashfun.name}; only sha2-256 is supported")
    return cid


def cid_str(cid: CID) -> str:
    """The canonical text form: base58btc for CIDv0, base32 for CIDv1 (what Kubo prints)."""
    if cid.version == 0:
        return str(cid)
    return cid.encode("base32")


def cid_from_digest(digest: bytes, codec: str, version: int) -> CID:
    """Build the CID of a block whose sha2-256 ``digest`` is already known (the importer's hot path)."""
    if version == 0 and codec != DAG_PB:
        raise InvalidCID("CIDv0 can only name dag-pb blocks")
    base = "base58btc" if version == 0 else "base32"
    return CID(base, version, codec, b"\x12\x20" + digest)


def make_cid(data: bytes, codec: str = RAW, version: int = 1) -> CID:
    """The CID of ``data`` as a block of ``codec``."""
    return cid_from_digest(hashlib.sha256(data).digest(), codec, version)


def verify_block(cid: CID, data: bytes) -> None:
    """Raise :class:`BlockMismatch` unless ``data`` hashes to ``cid``'s multihash."""
    if cid.hashfun.name != SHA2_256:
        raise BlockMismatch(cid, f"hash function {cid.hashfun.name} is not supported")
    if hashlib.sha256(data).digest() != cid.raw_digest:
        raise BlockMismatch(cid, f"content of {len(data)} bytes does not match the CID's hash")
