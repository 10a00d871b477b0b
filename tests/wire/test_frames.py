"""The collective's frames byte for byte: peers running older code read exactly these bytes.

Pinned before the frame formats moved from ``collective/`` into ``wire/``; if one of these changes,
the change is a new protocol version, not a refactor.
"""

from __future__ import annotations

import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from p2ptrain.wire import (
    DTYPES,
    PROTOCOL,
    Header,
    Kind,
    Phase,
    abort_frame,
    busy_frame,
    hello_frame,
    is_busy,
    parse_abort,
    parse_header,
    ready_frame,
    round_digest,
)
from p2ptrain.wire._frames import FrameError

PEER = ID.from_pubkey(create_new_key_pair(b"\x01" * 32).public_key)
DIGEST = "ee104a6e86de1f0278e0a7317040de9e0ef637a652c2f49052cad4bcec3bfce5"
ZERO_HEADER_TAIL = "000000000000000000000000"  # phase, step, seg, count, dtype of a control frame


def test_protocol_id() -> None:
    assert PROTOCOL == "/p2ptrain/collective/1.0.0"


def test_round_digest_bytes() -> None:
    assert round_digest(7, [PEER], "dense n=10 float32 mean").hex() == DIGEST


def test_control_frame_bytes() -> None:
    hello = "504301010000000000000007" + ZERO_HEADER_TAIL + DIGEST
    assert (Header(Kind.HELLO, 7).pack() + bytes.fromhex(DIGEST)).hex() == hello
    assert hello_frame(7, bytes.fromhex(DIGEST)).hex() == hello
    ready = "504301020000000000000007" + ZERO_HEADER_TAIL
    assert Header(Kind.READY, 7).pack().hex() == ready_frame(7).hex() == ready
    busy = "504301050000000000000007" + ZERO_HEADER_TAIL
    assert Header(Kind.BUSY, 7).pack().hex() == busy_frame(7).hex() == busy


def test_is_busy_only_for_a_busy_answer_to_this_round() -> None:
    assert is_busy(busy_frame(7), 7)
    assert not is_busy(busy_frame(8), 7)
    assert not is_busy(ready_frame(7), 7)
    assert not is_busy(b"PC", 7)  # malformed: for the caller to refuse


def test_abort_frame_bytes_and_parse() -> None:
    frame = abort_frame(7, PEER, "stalled past the hop deadline")
    assert frame.hex() == (
        "504301040000000000000007000000000000000000002600"
        "0024080112208a88e3dd7409f195fd52db2d3cba5d72ca6709bf1d94121bf3748801b40f6f5c"
        + "stalled past the hop deadline".encode().hex()
    )
    assert parse_abort(frame, parse_header(frame)) == (PEER, "stalled past the hop deadline")


def test_data_header_bytes() -> None:
    header = Header(Kind.DATA, 2**40 + 3, Phase.REDUCE, 5, 9, 1000, DTYPES[torch.bfloat16])
    assert header.pack().hex() == "50430103000001000000000302000500000009000003e803"
    assert parse_header(header.pack() + b"payload") == header


@pytest.mark.parametrize(
    "frame",
    [b"", b"PC", bytes.fromhex("514301020000000000000007" + ZERO_HEADER_TAIL),  # magic
     bytes.fromhex("504302020000000000000007" + ZERO_HEADER_TAIL),  # version
     bytes.fromhex("504301090000000000000007" + ZERO_HEADER_TAIL)],  # kind
)
def test_not_a_frame_is_refused(frame: bytes) -> None:
    with pytest.raises(FrameError):
        parse_header(frame)
