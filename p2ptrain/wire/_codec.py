"""Encode and decode signed wire messages.

Layout (big-endian)::

    b"P2TM" | version:u8 | payload_len:u32 | payload (canonical JSON) | ed25519 signature (64 B)

The payload is ``{"type", "sender", "seq", "ts", "body"}``. The signature covers a domain tag plus
everything before it and is made with the sender's libp2p Ed25519 key; the public key is recovered
from the sender's peer ID (an identity multihash), so no key exchange is needed. This is on top of
gossipsub's own signing: gossipsub authenticates the relay hop's origin, we authenticate the message
itself, which also lets a message be stored or forwarded outside pubsub and still be checked.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from libp2p.crypto.ed25519 import Ed25519PublicKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from p2ptrain.base import boundedjson
from p2ptrain.wire._limits import MAX_CLOCK_SKEW_S, MAX_MESSAGE_BYTES, WIRE_VERSION
from p2ptrain.wire._messages import MESSAGES, MessageRegistry, type_name
from p2ptrain.wire._schema import SchemaError, from_plain, to_plain

MAGIC = b"P2TM"
_HEADER = struct.Struct(">4sBI")
SIG_LEN = 64
_DOMAIN = b"p2ptrain/wire/v1\x00"
# Our deepest message (a coordinator beat: envelope > body > votes > vote) nests 5 levels; 32 is
# boundedjson's default and far below anything that could recurse dangerously.
MAX_PAYLOAD_DEPTH = boundedjson.MAX_DEPTH
# A timestamp outside +-2**53 s cannot be a real clock reading, and keeping it inside the range a
# float holds exactly means ``now - ts`` is always a plain float subtraction.
_TS_BOUND = 2**53

T = TypeVar("T")


class DecodeError(ValueError):
    """A message was rejected; ``reason`` is a short stable tag used for drop counters."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Signed(Generic[T]):
    """A verified message and who sent it."""

    sender: ID
    seq: int
    ts: float
    msg: T


def encode(msg: Any, key_pair: KeyPair, seq: int, ts: float | None = None) -> bytes:
    """Sign and frame ``msg`` (an instance of a registered message type)."""
    payload = boundedjson.canonical(
        {
            "type": type_name(msg),
            "sender": ID.from_pubkey(key_pair.public_key).to_base58(),
            "seq": seq,
            "ts": time.time() if ts is None else ts,
            "body": to_plain(msg),
        }
    )
    head = _HEADER.pack(MAGIC, WIRE_VERSION, len(payload))
    data = head + payload + key_pair.private_key.sign(_DOMAIN + head + payload)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{type_name(msg)} message is {len(data)} B, over the {MAX_MESSAGE_BYTES} B cap")
    return data


_TYPE_KEY = b',"type":"'


def peek_type(data: bytes) -> str | None:
    """The type name of a framed message, read without parsing or verifying it (None if it is not
    where the canonical payload puts it: the last key, ``..."type":"NAME"}``). A cheap look for
    deciding whether a message is worth checking at all (per-sender rates); :func:`decode`
    refuses a message whose type is not found here, so a look cannot be fooled."""
    if len(data) < _HEADER.size + SIG_LEN + 2:
        return None
    end = len(data) - SIG_LEN
    if data[end - 2:end] != b'"}':
        return None
    start = data.rfind(_TYPE_KEY, _HEADER.size, end)
    if start < 0:
        return None
    name = data[start + len(_TYPE_KEY):end - 2]
    if len(name) > 64 or b'"' in name or b"\\" in name:
        return None
    return name.decode("ascii", errors="replace")


def decode(data: bytes, now: float | None = None, types: MessageRegistry = MESSAGES) -> Signed[Any]:
    """Check and verify a framed message; raise :class:`DecodeError` on anything wrong (a type
    ``types`` does not know is ``unknown-type``)."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise DecodeError("oversized", f"{len(data)} B")
    if len(data) < _HEADER.size + SIG_LEN:
        raise DecodeError("malformed", "too short")
    magic, version, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DecodeError("malformed", "bad magic")
    if version != WIRE_VERSION:
        raise DecodeError("unknown-version", str(version))
    if _HEADER.size + length + SIG_LEN != len(data):
        raise DecodeError("malformed", "length mismatch")
    signed_part = data[: _HEADER.size + length]
    payload = signed_part[_HEADER.size :]
    signature = data[_HEADER.size + length :]
    try:
        # Bounded: ints are int64 and floats finite, so no later comparison (the clock-skew check)
        # can overflow; nesting is at most MAX_PAYLOAD_DEPTH, so nothing recurses deeply.
        env = boundedjson.loads(payload, max_depth=MAX_PAYLOAD_DEPTH, what="payload")
    except boundedjson.JSONBoundsError as exc:
        raise DecodeError("malformed", str(exc)) from None
    if type(env) is not dict or set(env) != {"type", "sender", "seq", "ts", "body"}:
        raise DecodeError("malformed", "bad envelope")
    sender_s, seq, ts, mtype = env["sender"], env["seq"], env["ts"], env["type"]
    if type(sender_s) is not str or type(seq) is not int or type(mtype) is not str:
        raise DecodeError("malformed", "bad envelope field types")
    if type(ts) not in (int, float) or not 0 <= seq < 2**63 or not -_TS_BOUND <= ts <= _TS_BOUND:
        raise DecodeError("malformed", "bad envelope field values")
    try:
        sender = ID.from_base58(sender_s)
        public_key = sender.extract_public_key()
    except Exception:
        raise DecodeError("bad-sender", sender_s[:64]) from None
    if not isinstance(public_key, Ed25519PublicKey):
        raise DecodeError("bad-sender", "sender ID does not embed an Ed25519 key")
    try:
        valid = public_key.verify(_DOMAIN + signed_part, signature)
    except Exception:
        valid = False
    if not valid:
        raise DecodeError("bad-signature", sender_s)
    cls = types.get(mtype)
    if cls is None:
        raise DecodeError("unknown-type", mtype[:64])
    if peek_type(data) != mtype:  # every encoder writes the payload canonically, type last
        raise DecodeError("malformed", "the type is not the payload's last key")
    now = time.time() if now is None else now
    if abs(now - ts) > MAX_CLOCK_SKEW_S:
        raise DecodeError("stale", f"timestamp {ts:.0f} is {now - ts:+.0f} s off")
    try:
        msg: Any = from_plain(cls, env["body"], mtype)
    except SchemaError as exc:
        raise DecodeError("schema", str(exc)) from None
    return Signed(sender=sender, seq=seq, ts=float(ts), msg=msg)
