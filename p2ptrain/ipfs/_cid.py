"""CIDs: parse what users and peers hand us, print them the way Kubo does, and check blocks against them.

A thin layer over the ``multiformats`` package. It exists so the rest of p2ptrain has one place that
decides which CIDs we accept (CIDv0/CIDv1, dag-pb or raw, sha2-256 — what Kubo's ``ipfs add`` makes) and
one clear error type for a bad one. Block verification is the security boundary of the content layer:
every byte that arrives by CID passes through :func:`verify_block` before anything else reads it.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from multiformats import CID, multibase, multicodec, multihash
from multiformats.multibase import raw as raw_bases

from p2ptrain.base import UserError

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


# multiformats checks every constructor argument with typing_validation (~180 µs per CID, more than
# hashing a 256 KiB block). Where the bytes have been checked here against the only layouts we accept,
# CIDs are built through its interning constructor instead, as its own ``CID.decode`` does.
_BASE58 = multibase.get("base58btc")
# multiformats builds most of its base codecs (base32 among them: every CIDv1 we print) on first use,
# and two threads that first use one together race: the second registration raises, and a valid CID
# is refused as "not a valid CID" (a node refused a task so when two arrived 13 ms apart). Build them
# all now, once, under the import lock (~1 ms).
for _base in multibase.table():
    if raw_bases.exists(_base.name):
        raw_bases.get(_base.name)

_BASE32 = multibase.get("base32")
_CODECS = {DAG_PB: multicodec.get(DAG_PB), RAW: multicodec.get(RAW)}
_CODEC_BY_PREFIX = {b"\x01\x70": _CODECS[DAG_PB], b"\x01\x55": _CODECS[RAW]}
_SHA2_256 = multihash.get(SHA2_256)
_MH_PREFIX = b"\x12\x20"


def _fast_cid(version: int, codec_name: str, multihash_bytes: bytes) -> CID:
    base = _BASE58 if version == 0 else _BASE32
    return CID._new_instance(CID, base, version, _CODECS[codec_name], _SHA2_256, multihash_bytes)


# The length of a CID as p2ptrain prints one (cid_str) for a sha2-256 digest: CIDv0 in base58btc
# (Qm...), CIDv1 in base32 (bafy... for dag-pb, bafk... for raw).
CIDV0_CHARS = 46
CIDV1_CHARS = 59
# The characters of each (a CID's first character names its base: Q for CIDv0's base58btc, b for base32).
_ALPHABETS = {
    "Q": ("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz", "base58: no 0, O, I or l"),
    "b": ("abcdefghijklmnopqrstuvwxyz234567", "base32: a to z, 2 to 7"),
}


class InvalidCID(ValueError):
    """A string or byte sequence is not a CID p2ptrain accepts."""


class BlockMismatch(ValueError):
    """A block's bytes do not hash to the multihash in its CID."""

    def __init__(self, cid: CID, message: str) -> None:
        super().__init__(f"block {cid_str(cid)}: {message}")
        self.cid = cid


def requested_cid(text: object) -> str:
    """A CID named in a control request (``task join``, ``ipfs cat``, ``model predict``...), as
    text: refused in one line (:class:`~p2ptrain.base.UserError`, its first 64 characters quoted,
    whatever the request held) unless it parses as a CID we support."""
    cid = str(text)
    try:
        parse_cid(cid)
    except InvalidCID:
        raise UserError(f"{cid[:64]!r} is not a CID") from None
    return cid


def parse_cid(value: CID | str | bytes) -> CID:
    """Return ``value`` as a :class:`CID`, refusing anything outside dag-pb/raw over sha2-256."""
    if isinstance(value, CID):
        cid = value
    elif isinstance(value, bytes) and len(value) == 34 and value.startswith(_MH_PREFIX):
        return _fast_cid(0, DAG_PB, value)
    elif isinstance(value, bytes) and len(value) == 36 and value[2:4] == _MH_PREFIX and (
        codec := _CODEC_BY_PREFIX.get(value[:2])
    ):
        return _fast_cid(1, codec.name, value[2:])
    elif isinstance(value, str):
        cid = _decode_str(value.strip())
    else:
        try:
            cid = CID.decode(value)
        except Exception as exc:  # multiformats raises a zoo of types; the caller needs one
            raise InvalidCID(f"not a CID: {bytes(value[:50]).hex()!r} ({exc})") from None
    if cid.codec.name not in SUPPORTED_CODECS:
        raise InvalidCID(f"CID {cid} uses codec {cid.codec.name}; only dag-pb and raw are supported")
    if cid.hashfun.name != SHA2_256 or len(cid.digest) != 34:
        raise InvalidCID(f"CID {cid} uses hash {cid.hashfun.name}; only sha2-256 is supported")
    return cid


@lru_cache(maxsize=4096)
def _decode_str(text: str) -> CID:
    """Text CIDs repeat (manifests, pins, shard lists) and multiformats decodes one in ~250 µs."""
    try:
        return CID.decode(text)
    except Exception:  # multiformats raises a zoo of types; the caller needs one
        raise InvalidCID(not_a_cid(text)) from None


def not_a_cid(text: str) -> str:
    """Why ``text`` is refused as a CID, in words for whoever typed or copied it: what a CID looks
    like, and how this one differs. The decoder's own reason ("Pad bits must be zero", "CIDv13 is
    currently not supported") says nothing to a user whose copy lost or gained a character."""
    length = len(text)
    alphabet, letters = _ALPHABETS.get(text[:1], ("", ""))
    stray = next((c for c in text if c not in alphabet), None) if alphabet else None
    if stray is not None:  # a placeholder left in a task file, a character misread when copied by hand
        how = f"{stray!r} is no character of one ({letters})"
    elif length not in (CIDV0_CHARS, CIDV1_CHARS):
        how = f"this one has {length} character{'s' if length != 1 else ''}"
    else:
        how = "a character is mistyped"
    return (f"{text[:100]!r} is not a valid CID: expected Qm... ({CIDV0_CHARS} characters) or b... "
            f"({CIDV1_CHARS}, base32), as p2ptrain prints them; {how}")


@lru_cache(maxsize=4096)
def cid_str(cid: CID) -> str:
    """The canonical text form: base58btc for CIDv0, base32 for CIDv1 (what Kubo prints); cached."""
    if cid.version == 0:
        return str(cid)
    return cid.encode("base32")


def cid_from_digest(digest: bytes, codec: str, version: int) -> CID:
    """Build the CID of a block whose sha2-256 ``digest`` is already known (the importer's hot path)."""
    if version == 0 and codec != DAG_PB:
        raise InvalidCID("CIDv0 can only name dag-pb blocks")
    if codec not in _CODECS or version not in (0, 1) or len(digest) != 32:
        raise InvalidCID(f"cannot name a {codec} block with CIDv{version} and a {len(digest)}-byte digest")
    return _fast_cid(version, codec, _MH_PREFIX + digest)


def make_cid(data: bytes, codec: str = RAW, version: int = 1) -> CID:
    """The CID of ``data`` as a block of ``codec``."""
    return cid_from_digest(hashlib.sha256(data).digest(), codec, version)


def verify_block(cid: CID, data: bytes) -> None:
    """Raise :class:`BlockMismatch` unless ``data`` hashes to ``cid``'s multihash."""
    if cid.hashfun.name != SHA2_256:
        raise BlockMismatch(cid, f"hash function {cid.hashfun.name} is not supported")
    if _MH_PREFIX + hashlib.sha256(data).digest() != cid.digest:
        raise BlockMismatch(cid, f"content of {len(data)} bytes does not match the CID's hash")
