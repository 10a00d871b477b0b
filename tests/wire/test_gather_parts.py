"""The parts members put in a ``Collective.gather``, byte for byte: a pipelined step summary's
driver entry and a replica's signed stage statement. Peers running older code read exactly these
bytes, and a statement's signature covers its class name and canonical JSON, so a change here is a
new protocol version, not a refactor. Pinned before both formats moved into ``wire/`` (issue 28)."""

from __future__ import annotations

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain import protocol
from p2ptrain.protocol import sign_statement
from p2ptrain.wire import (MAX_SUMMARY_ENTRY_BYTES, MAX_TIMED_ENTRY_BYTES, read_statement, read_summary_entry, RoundPlan,
                           statement_bytes, StatementError, summary_entry_bytes)

KEY = create_new_key_pair(b"s" * 32)
SIGNATURE = (
    "246a06d660e022bade53e49ea819528069cad4bd71b2ad56770ccca6b48ef809"
    "291e1c6dafea06fc806ca4f42e4c342f9b31cb71d37af2939b4441a5abfcd50f"
)
STATEMENT = (
    b'{"signature":"' + SIGNATURE.encode() + b'","statement":{"model_cid":"bafymodel","optimizer_cid":"bafyopt",'
    b'"replica":"12D3KooWSxpeJpcAebtV9emdNM7bUNATFhTx2JirESHYLkxhVvHC","stage":1,"step":30,"task_cid":"bafytask"}}'
)


def test_step_summary_entry_bytes() -> None:
    # float64 little-endian loss share, one failure byte, then a u16 little-endian per accused replica
    raw = summary_entry_bytes(0.25, True, (1, 3))
    assert raw == bytes.fromhex("000000000000d03f" "01" "0100" "0300")
    assert read_summary_entry(raw) == (0.25, True, (1, 3), ())
    assert MAX_SUMMARY_ENTRY_BYTES == 9 + 16 * 2
    with pytest.raises(ValueError):
        read_summary_entry(raw + b"\x00")


def test_timed_step_summary_entry_bytes() -> None:
    """``balance = "measured"``'s entry: the stage count (u8) and a u32 per stage between the flag and
    the accused, an even length, so every entry of the first kind (odd) reads as it did."""
    raw = summary_entry_bytes(0.25, True, (1, 3), (0, 1500, 70000))
    assert raw == bytes.fromhex("000000000000d03f" "01" "03" "00000000" "dc050000" "70110100" "0100" "0300")
    assert read_summary_entry(raw) == (0.25, True, (1, 3), (0, 1500, 70000))
    assert MAX_TIMED_ENTRY_BYTES == 9 + 1 + 64 * 4 + 16 * 2
    cid = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
    plan = RoundPlan(task_cid=cid, term=1, round=3, attempt=0, step=3, rounds=1, base_cid=cid, version=1,
                     members=tuple(str(i) * 52 for i in range(4)), stages=(0, 1, 2, 1))
    assert read_summary_entry(raw, plan).micros == (0, 1500, 70000)
    for bad in [summary_entry_bytes(0.25, True, (1, 3), (0, 1500)),  # another stage count than the plan's
                raw[:-1], raw[:12],  # cut short
                summary_entry_bytes(0.25, True, (), (5,)),  # one stage is no pipeline
                raw[:9] + bytes([65]) + raw[10:]]:  # more stages than a pipeline has
        with pytest.raises(ValueError):
            read_summary_entry(bad, plan)


def test_stage_statement_bytes() -> None:
    signed = sign_statement("bafytask", 30, 1, ("bafymodel", "bafyopt"), KEY)
    assert signed.signature == SIGNATURE  # Ed25519 is deterministic; the domain tag names the class
    assert statement_bytes(signed) == STATEMENT
    assert read_statement(STATEMENT) == signed
    with pytest.raises(StatementError):
        read_statement(STATEMENT[:-1])


def test_protocol_still_exports_the_statement_format() -> None:
    # where the names were first exported: the same objects as wire's
    assert protocol.statement_bytes is statement_bytes and protocol.read_statement is read_statement
    assert protocol.StatementError is StatementError
