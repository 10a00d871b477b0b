"""A node's persistent Ed25519 identity.

The private key lives in ``<home>/identity.key`` (libp2p's protobuf key encoding, mode 0600), so a
restarted node keeps its peer ID. Two processes that race to create the identity of a new home must
end with one key: the file is written under a temporary name and then hard-linked into place, which
fails for the loser of the race, who then reads the winner's key.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from p2ptrain.base._errors import UserError

KEY_FILE = "identity.key"


def _write_new_key(path: Path, data: bytes) -> bool:
    """Write ``data`` as ``path`` unless it exists; return False if another process won the race."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def load_or_create_identity(home: Path) -> KeyPair:
    """Return the home's key pair, creating home and key on first use."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / KEY_FILE
    if not path.exists():
        _write_new_key(path, create_new_key_pair().private_key.serialize())
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise UserError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}")
    try:
        private = deserialize_private_key(path.read_bytes())
    except Exception as exc:  # the file is ours to read; anything wrong with it is a user problem
        raise UserError(f"{path} is not a valid libp2p private key: {exc}") from exc
    if private.get_type() != KeyType.Ed25519 or not isinstance(private, Ed25519PrivateKey):
        raise UserError(f"{path} holds a {private.get_type().name} key; p2ptrain uses Ed25519 only")
    return KeyPair(private, private.get_public_key())


def peer_id_of(key_pair: KeyPair) -> ID:
    """The libp2p peer ID of a key pair (an identity multihash of the Ed25519 public key)."""
    return ID.from_pubkey(key_pair.public_key)
