"""Fuzz targets of the wire layer: framed messages, and their JSON payloads signed as a real
sender would sign them (so hostile bodies get past the signature check and reach the schema)."""

from __future__ import annotations

import json
import struct
import time

from _p2ptrain_fuzzing import FuzzTarget
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain import boundedjson
from p2ptrain.identity import peer_id_of
from p2ptrain.wire import DecodeError, decode, encode
from p2ptrain.wire import codec
from p2ptrain.wire.limits import WIRE_VERSION
from p2ptrain.wire.messages import Capabilities, Goodbye, Heartbeat


KEY = create_new_key_pair()
_SENDER = peer_id_of(KEY).to_base58()
_NOW = time.time()


def _payload(mtype: str, body: dict, seq: int = 1) -> bytes:
    env = {"type": mtype, "sender": _SENDER, "seq": seq, "ts": _NOW, "body": body}
    return json.dumps(env, sort_keys=True, separators=(",", ":")).encode()


def _signed_frame(payload: bytes) -> bytes:
    head = struct.pack(">4sBI", codec.MAGIC, WIRE_VERSION, len(payload))
    return head + payload + KEY.private_key.sign(codec._DOMAIN + head + payload)


def _decode_signed_payload(payload: bytes) -> object:
    return decode(_signed_frame(payload), now=_NOW)


_CAPS = {"device": "cpu", "cpu_count": 2, "free_ram_bytes": 1 << 30, "version": "0.1.0"}
PAYLOADS = [
    _payload("goodbye", {"reason": "shutdown"}),
    _payload("heartbeat", {"addrs": ["/ip4/127.0.0.1/tcp/4001"], "caps": _CAPS, "tasks": []}),
]
FRAMES = [
    encode(Goodbye(reason="x"), KEY, seq=3, ts=_NOW),
    encode(Heartbeat(addrs=("/ip4/127.0.0.1/tcp/1",), caps=Capabilities(**_CAPS)), KEY, seq=4, ts=_NOW),
]

TARGETS = [
    FuzzTarget("wire.frame", lambda data: decode(data, now=_NOW), (DecodeError,), FRAMES),
    FuzzTarget("wire.signed_payload", _decode_signed_payload, (DecodeError,), PAYLOADS),
    FuzzTarget(
        "boundedjson.loads",
        lambda data: boundedjson.loads(data, max_bytes=1 << 20),
        (boundedjson.JSONBoundsError,),
        PAYLOADS,
    ),
]
