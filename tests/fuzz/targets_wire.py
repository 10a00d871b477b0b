"""Fuzz targets of the wire layer: framed messages, and their JSON payloads signed as a real
sender would sign them (so hostile bodies get past the signature check and reach the schema);
one target per message type of p2ptrain.wire._messages, seeded with a valid message of that type,
so the fuzzer's mutations land in that type's own fields."""

from __future__ import annotations

import json
import struct
import tempfile
import time
from pathlib import Path

from _p2ptrain_fuzzing import FuzzTarget
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.base import UserError, boundedjson, peer_id_of
from p2ptrain.node import NodeConfig
from p2ptrain.wire import (
    Attestation,
    Capabilities,
    CoordinatorBeat,
    DecodeError,
    Goodbye,
    HeadRequest,
    Heartbeat,
    MESSAGES,
    ModelRecord,
    ModelServed,
    RoundFailed,
    RoundPlan,
    SignedAttestation,
    SignedModelRecord,
    SignedVote,
    TaskAnnounce,
    TaskCancel,
    TaskHead,
    TaskResume,
    Vote,
    VoteRequest,
    _codec as codec,
    decode,
    encode,
)
from p2ptrain.wire._limits import WIRE_VERSION


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
    # A newer version's heartbeat: fields this version skips (wire.schema EXTENSIBLE), so the
    # mutations' huge numbers and deep nesting also land in values that are never read.
    _payload("heartbeat", {"addrs": ["/ip4/127.0.0.1/tcp/4001"], "caps": {**_CAPS, "npu_count": 2}, "tasks": [],
                           "future_field": {"nested": [1, 2.5, "x", {"deeper": [True]}]}}),
    # Advertised model builders (issue 30): a bounded list of bounded names.
    _payload("heartbeat", {"addrs": ["/ip4/127.0.0.1/tcp/4001"], "tasks": [],
                           "caps": {**_CAPS, "builders": ["mlp", "torchvision:resnet18", "pkg:" + "x" * 60]}}),
]
FRAMES = [
    encode(Goodbye(reason="x"), KEY, seq=3, ts=_NOW),
    encode(Heartbeat(addrs=("/ip4/127.0.0.1/tcp/1",), caps=Capabilities(**_CAPS)), KEY, seq=4, ts=_NOW),
]

_CID = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"
_SIG = "ab" * 64
_VOTE = SignedVote(vote=Vote(task_cid=_CID, term=3, candidate=_SENDER, voter=_SENDER), signature=_SIG)
# One valid message of every type the wire carries (checked against the registry below).
SAMPLES = [
    Heartbeat(addrs=("/ip4/127.0.0.1/tcp/4001",), caps=Capabilities(**_CAPS), tasks=(_CID,)),
    Goodbye(reason="shutdown"),
    TaskAnnounce(task_cid=_CID, name="digits"),
    RoundPlan(task_cid=_CID, term=1, round=2, attempt=0, step=20, rounds=10, members=(_SENDER,), base_cid=_CID, version=1),
    RoundPlan(task_cid=_CID, term=1, round=2, attempt=0, step=20, rounds=10, members=(_SENDER, _SENDER), base_cid=_CID,
              version=1, stages=(0, 1)),
    RoundFailed(task_cid=_CID, term=1, round=2, attempt=0, step=20, reason="peer gone"),
    SignedModelRecord(
        record=ModelRecord(
            task_cid=_CID, version=2, parent=_CID, round=3, step=30, members=(_SENDER,),
            metrics={"loss": 0.25, "accuracy": 0.9}, model_cid=_CID, optimizer_cid=_CID, term=1, coordinator=_SENDER,
        ),
        signature=_SIG,
    ),
    SignedAttestation(
        attestation=Attestation(task_cid=_CID, version=2, record_id="r" * 64, model_cid=_CID, optimizer_cid=_CID,
                                attester=_SENDER),
        signature=_SIG,
    ),
    VoteRequest(task_cid=_CID, term=3, candidate=_SENDER),
    _VOTE,
    CoordinatorBeat(task_cid=_CID, term=3, coordinator=_SENDER, votes=(_VOTE, _VOTE)),
    TaskHead(
        task_cid=_CID, term=3, version=2, step=30, round=3, total_steps=100, chain_cid=_CID, model_cid=_CID,
        optimizer_cid=_CID, members=(_SENDER,), done=False,
    ),
    TaskCancel(task_cid=_CID, reason="enough"),
    HeadRequest(task_cid=_CID),
    ModelServed(model_cid=_CID, url="http://127.0.0.1:8080"),
    TaskResume(task_cid=_CID),
]
_WIRE_TYPES = set(MESSAGES.names())
assert {type(m).TYPE for m in SAMPLES} == _WIRE_TYPES, "every wire message type needs a fuzz seed here"


def _signed_payload_of(msg: object) -> bytes:
    """The payload our encoder signs for ``msg`` (so the seed is exactly what a peer would send)."""
    return encode(msg, KEY, seq=7, ts=_NOW)[struct.calcsize(">4sBI") : -codec.SIG_LEN]


_CONFIG_DIR = Path(tempfile.mkdtemp(prefix="p2ptrain-fuzz-config-"))


def _parse_config(data: bytes) -> NodeConfig:
    """A node's config.toml (disk input, hand-edited): parsed from a real file, as at start."""
    path = _CONFIG_DIR / "config.toml"
    path.write_bytes(data)
    return NodeConfig.parse(path)


TARGETS = [
    FuzzTarget("wire.frame", lambda data: decode(data, now=_NOW), (DecodeError,), FRAMES),
    FuzzTarget("wire.signed_payload", _decode_signed_payload, (DecodeError,), PAYLOADS),
    FuzzTarget(
        "boundedjson.loads",
        lambda data: boundedjson.loads(data, max_bytes=1 << 20),
        (boundedjson.JSONBoundsError,),
        PAYLOADS,
    ),
    FuzzTarget(
        "node.config",
        _parse_config,
        (UserError,),
        [NodeConfig().to_toml().encode(),
         NodeConfig(bootstrap=["/ip4/127.0.0.1/tcp/1/p2p/" + _SENDER], heartbeat_interval=0.5).to_toml().encode()],
    ),
    *(  # one target per message type, seeded with every sample of that type
        FuzzTarget(f"wire.{kind}", _decode_signed_payload, (DecodeError,),
                   [_signed_payload_of(m) for m in SAMPLES if type(m).TYPE == kind])
        for kind in dict.fromkeys(type(m).TYPE for m in SAMPLES)
    ),
]
