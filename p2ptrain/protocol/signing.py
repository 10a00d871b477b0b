"""Detached Ed25519 signatures over canonical bytes of schema dataclasses.

The wire envelope is signed too, but its timestamp goes stale after minutes; a model record or a
vote must still verify when it is read back from disk or fetched by CID much later. So such bodies
carry their own signature, made with the signer's libp2p key over a domain tag (one per body type,
so a signature on a vote can never pass for one on a record) plus the body's canonical JSON. The
signer's public key is recovered from its peer ID, as in the wire codec.
"""

from __future__ import annotations

import hashlib
from typing import Any

from libp2p.crypto.ed25519 import Ed25519PublicKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from p2ptrain.base import boundedjson
from p2ptrain.wire import to_plain

SIGNATURE_HEX_LEN = 128


class SignatureError(ValueError):
    """A detached signature does not verify, or its signer is not a usable Ed25519 peer ID."""


def canonical_bytes(body: Any) -> bytes:
    """Canonical JSON of a schema dataclass: sorted keys, no spaces, no NaN."""
    return boundedjson.canonical(to_plain(body))


def body_id(body: Any) -> str:
    """A stable identifier of a body: sha256 hex of its canonical bytes."""
    return hashlib.sha256(canonical_bytes(body)).hexdigest()


def _signed_bytes(body: Any) -> bytes:
    return b"p2ptrain/" + type(body).__name__.encode() + b"/v1\x00" + canonical_bytes(body)


def peer_str(key_pair: KeyPair) -> str:
    """The base58 peer ID of a key pair, the form used in every signed body."""
    return ID.from_pubkey(key_pair.public_key).to_base58()


def sign(body: Any, key_pair: KeyPair) -> str:
    """Hex Ed25519 signature of ``body`` by ``key_pair``."""
    return key_pair.private_key.sign(_signed_bytes(body)).hex()


def verify(body: Any, signer: str, signature: str) -> None:
    """Raise :class:`SignatureError` unless ``signature`` is ``signer``'s signature of ``body``."""
    try:
        public_key = ID.from_base58(signer).extract_public_key()
    except Exception:
        raise SignatureError(f"signer {signer[:64]!r} is not a peer ID with an embedded key") from None
    if not isinstance(public_key, Ed25519PublicKey):
        raise SignatureError(f"signer {signer[:16]} does not use an Ed25519 key")
    if len(signature) != SIGNATURE_HEX_LEN:
        raise SignatureError(f"signature of {signer[:16]} has the wrong length")
    try:
        ok = public_key.verify(_signed_bytes(body), bytes.fromhex(signature))
    except Exception:
        ok = False
    if not ok:
        raise SignatureError(f"bad signature by {signer[:16]} on {type(body).__name__}")
