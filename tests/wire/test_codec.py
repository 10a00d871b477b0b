"""The wire decoder: every rejection reason, replays, and a fuzzer that must only ever see DecodeError."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.wire import (
    Capabilities,
    DecodeError,
    Goodbye,
    Heartbeat,
    MAX_MESSAGE_BYTES,
    MESSAGES,
    ReplayGuard,
    _codec as codec,
    decode,
    encode,
    message,
)
from p2ptrain.wire._limits import MAX_CLOCK_SKEW_S, WIRE_VERSION
from p2ptrain.base import peer_id_of

KEY = create_new_key_pair()
OTHER = create_new_key_pair()
CAPS = Capabilities(device="cpu", cpu_count=2, free_ram_bytes=1 << 30, version="0.1.0")


def frame(payload: bytes, key=KEY, version: int = WIRE_VERSION, magic: bytes = codec.MAGIC) -> bytes:
    """A frame around arbitrary payload bytes, signed like the real encoder signs."""
    head = struct.pack(">4sBI", magic, version, len(payload))
    return head + payload + key.private_key.sign(codec._DOMAIN + head + payload)


def envelope(**overrides) -> bytes:
    env = {
        "type": "goodbye",
        "sender": peer_id_of(KEY).to_base58(),
        "seq": 1,
        "ts": time.time(),
        "body": {"reason": "x"},
    }
    env.update(overrides)
    return json.dumps(env, sort_keys=True, separators=(",", ":")).encode()


def reason_of(data: bytes) -> str:
    with pytest.raises(DecodeError) as info:
        decode(data)
    return info.value.reason


def test_round_trip_keeps_sender_seq_and_body():
    hb = Heartbeat(addrs=("/ip4/127.0.0.1/tcp/1",), caps=CAPS, tasks=("t",))
    signed = decode(encode(hb, KEY, seq=42))
    assert signed.msg == hb
    assert signed.seq == 42
    assert signed.sender == peer_id_of(KEY)


def test_our_frame_helper_matches_the_encoder():
    # Guards the helper below: if the framing changes, the rejection tests must change with it.
    assert decode(frame(envelope())).msg == Goodbye(reason="x")


def test_oversized():
    assert reason_of(b"\0" * (MAX_MESSAGE_BYTES + 1)) == "oversized"


def test_encoder_refuses_to_build_an_oversized_message():
    with pytest.raises(ValueError, match="cap"):
        heartbeat = Heartbeat(addrs=tuple("a" * 4000 for _ in range(16)), caps=CAPS,
                              tasks=tuple("b" * 4000 for _ in range(64)))
        encode(heartbeat, KEY, 1)


@pytest.mark.parametrize(
    "data",
    [b"", b"P2TM", b"XXXX" + b"\0" * 100, frame(envelope())[:-1], frame(envelope()) + b"x"],
    ids=["empty", "short", "bad-magic", "truncated", "trailing"],
)
def test_malformed_framing(data):
    assert reason_of(data) == "malformed"


@pytest.mark.parametrize(
    "payload",
    [b"not json", b"[]", b'{"type":"goodbye"}', envelope(seq="1"), envelope(seq=-1), envelope(ts="now"), b'{"a":NaN}'],
    ids=["not-json", "not-object", "missing-fields", "seq-type", "seq-negative", "ts-type", "nan"],
)
def test_malformed_envelope(payload):
    assert reason_of(frame(payload)) == "malformed"


def test_unknown_version():
    assert reason_of(frame(envelope(), version=WIRE_VERSION + 1)) == "unknown-version"


def test_bad_sender():
    assert reason_of(frame(envelope(sender="not-a-peer-id"))) == "bad-sender"


def test_unsigned_or_wrongly_signed():
    good = frame(envelope())
    unsigned = good[: -codec.SIG_LEN] + b"\0" * codec.SIG_LEN
    assert reason_of(unsigned) == "bad-signature"
    # Signed by another key while claiming KEY's peer ID: a forgery.
    assert reason_of(frame(envelope(), key=OTHER)) == "bad-signature"
    # Tampered after signing.
    tampered = bytearray(good)
    tampered[20] ^= 1
    assert reason_of(bytes(tampered)) in {"bad-signature", "malformed"}


def test_unknown_type():
    assert reason_of(frame(envelope(type="launch_missiles"))) == "unknown-type"


def test_stale_or_future_timestamp():
    assert reason_of(frame(envelope(ts=time.time() - MAX_CLOCK_SKEW_S - 10))) == "stale"
    assert reason_of(frame(envelope(ts=time.time() + MAX_CLOCK_SKEW_S + 10))) == "stale"


@pytest.mark.parametrize("ts", [10**400, -(10**400), 2**63, 1e308, -1e308],
                         ids=["huge-int", "huge-neg", "int64+1", "huge-float", "huge-neg-float"])
def test_a_signed_timestamp_too_large_for_a_float_is_malformed_not_an_overflow(ts):
    """Issue 13 found 1: ``abs(now - 10**400)`` raised OverflowError and stopped the node."""
    assert reason_of(frame(envelope(ts=ts))) == "malformed"


@pytest.mark.parametrize("depth", [40, 30_000])  # 30,000 fits the 64 KiB cap
def test_a_signed_payload_nested_deeper_than_the_bound_is_malformed(depth):
    deep = envelope(body={"reason": "x", "n": []}).replace(b"[]", b"[" * depth + b"]" * depth)
    assert reason_of(frame(deep)) == "malformed"


@pytest.mark.parametrize(
    "value",
    [10**400, -(10**400), 2**63, float("inf"), float("nan"), "1.0", True],
    ids=["huge-int", "huge-neg", "int64+1", "inf", "nan", "string", "bool"],
)
def test_schema_float_fields_refuse_what_is_not_a_finite_number_in_range(value):
    """The schema check of a float field (a model record's metrics) must not overflow either."""
    from p2ptrain.wire import SchemaError
    from p2ptrain.wire._schema import _check

    with pytest.raises(SchemaError):
        _check(value, float, "metrics.loss", {})


@pytest.mark.parametrize(
    "body",
    [{"reason": 5}, {"reason": "x" * 300}, {"reason": "x", "extra": 1}, []],
    ids=["type", "too-long", "unknown-field", "not-object"],
)
def test_schema(body):
    assert reason_of(frame(envelope(body=body))) == "schema"


def heartbeat_body(**extra) -> dict:
    from p2ptrain.wire import to_plain

    return {**to_plain(Heartbeat(addrs=("/ip4/127.0.0.1/tcp/1",), caps=CAPS, reachability="public")), **extra}


def test_a_heartbeat_from_a_newer_version_with_added_fields_is_read_without_them():
    """Mixed versions: a newer node's heartbeat with fields this version does not know (in the
    heartbeat and in its capabilities) is read, the fields skipped; so adding a field to heartbeats
    no longer makes older nodes drop every heartbeat of newer ones."""
    from p2ptrain.wire._schema import MAX_UNKNOWN_FIELDS

    body = heartbeat_body(uplink_mbit=100, relay={"slots": 3})
    body["caps"]["npu_count"] = 2
    signed = decode(frame(envelope(type="heartbeat", body=body)))
    assert signed.msg == Heartbeat(addrs=("/ip4/127.0.0.1/tcp/1",), caps=CAPS, reachability="public")
    # Bounded: a few well-named fields, never a crowd or names no version of ours would use.
    many = heartbeat_body(**{f"field_{i}": i for i in range(MAX_UNKNOWN_FIELDS + 1)})
    assert reason_of(frame(envelope(type="heartbeat", body=many))) == "schema"
    assert reason_of(frame(envelope(type="heartbeat", body=heartbeat_body(**{"Not A Field": 1})))) == "schema"
    assert reason_of(frame(envelope(type="heartbeat", body=heartbeat_body(**{"x" * 40: 1})))) == "schema"
    # Known fields are checked as ever, and other types still refuse any unknown field.
    assert reason_of(frame(envelope(type="heartbeat", body=heartbeat_body(addrs="x")))) == "schema"
    assert reason_of(frame(envelope(body={"reason": "x", "extra": 1}))) == "schema"


def test_replay_guard_refuses_a_second_delivery_and_old_numbers():
    guard = ReplayGuard(window=4)
    sender = peer_id_of(KEY)
    assert guard.accept(sender, 10)
    assert not guard.accept(sender, 10)
    for seq in (11, 12, 13, 14):
        assert guard.accept(sender, seq)
    assert not guard.accept(sender, 9)  # below the window's floor: too old to judge, refused
    assert guard.accept(peer_id_of(OTHER), 10)  # windows are per sender


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_only_raise_decode_error(data):
    try:
        decode(data)
    except DecodeError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["heartbeat", "goodbye", "nope", "round_plan"]),
    json_values,
    st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=5)),
)
def test_fuzz_validly_signed_envelopes_only_raise_decode_error(mtype, body, seq):
    """Correct signatures over hostile content: the schema checker is what stands in the way."""
    payload = envelope(type=mtype, body=body, seq=seq)
    try:
        decode(frame(payload))
    except DecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0, max_value=400))
def test_fuzz_mutated_valid_messages_never_verify(patch, offset):
    good = bytearray(encode(Goodbye(reason="hello"), KEY, seq=1))
    offset %= len(good)
    mutated = bytes(good[:offset] + patch + good[offset + len(patch):])
    if mutated == bytes(good):
        return
    with pytest.raises(DecodeError):
        decode(mutated)


def test_replay_guard_memory_is_bounded_however_many_identities_write():
    """Throwaway identities (issue 13, found 7) must not grow the guard without end."""
    guard = ReplayGuard(window=8, max_entries=64)
    active = peer_id_of(KEY)
    for i in range(1000):
        assert guard.accept(active, 10_000 + i)  # an honest, recently heard sender
        assert guard.accept(peer_id_of(create_new_key_pair()), 1)
    assert guard.entries <= 64 and len(guard) <= 64
    assert guard.evicted > 900
    assert not guard.accept(active, 10_999), "the recently heard sender's window was kept"


def test_a_heartbeat_address_longer_than_the_bound_is_a_schema_error():
    hb = {"addrs": ["/ip4/127.0.0.1/tcp/1/" + "x" * 300],
          "caps": {"device": "cpu", "cpu_count": 1, "free_ram_bytes": 1, "version": "0"}}
    assert reason_of(frame(envelope(type="heartbeat", body=hb))) == "schema"


def test_a_decoder_knows_only_the_types_it_is_handed() -> None:
    """A test's (or an extension's) own type lives in a registry of its own; the package's is untouched."""
    ours = MESSAGES.copy()

    @message("test.codec.extra", into=ours)
    @dataclass(frozen=True)
    class Extra:
        n: int

    data = encode(Extra(n=3), KEY, seq=1)
    assert decode(data, types=ours).msg == Extra(n=3)
    with pytest.raises(DecodeError) as refused:
        decode(data)  # the package's registry: MESSAGES
    assert refused.value.reason == "unknown-type"
    assert "test.codec.extra" not in MESSAGES.names() and MESSAGES.get("heartbeat") is Heartbeat
    assert decode(encode(Goodbye(reason="x"), KEY, seq=2), types=ours).msg == Goodbye(reason="x")
    with pytest.raises(ValueError, match="registered twice"):
        message("heartbeat", into=ours)(Extra)


def test_peek_type_reads_the_type_of_what_the_encoder_writes_without_verifying_it():
    for msg in (Goodbye(reason='a "quoted" type":"x" reason'), Heartbeat(addrs=(), caps=CAPS)):
        data = encode(msg, KEY, seq=1)
        assert codec.peek_type(data) == type(msg).TYPE
        assert codec.peek_type(data[:-1] + bytes([data[-1] ^ 1])) == type(msg).TYPE  # no signature check
    assert codec.peek_type(b"") is None and codec.peek_type(b"P2TM" + b"\0" * 80) is None


def test_a_payload_whose_type_is_not_its_last_key_is_malformed():
    """Per-sender rates look at a message's type before verifying it (mesh.router.admit): a sender
    must not be able to show one type to that look and another to the decoder."""
    env = json.loads(envelope())
    disguised = json.dumps({"type": env.pop("type"), **env}, separators=(",", ":")).encode()
    assert reason_of(frame(disguised)) == "malformed"
    # A duplicated "type": the decoder takes the last one, as the look does: both say heartbeat.
    shown = json.dumps({**env, "type": "goodbye"}, separators=(",", ":"))[:-1] + ',"type":"heartbeat"}'
    assert codec.peek_type(frame(shown.encode())) == "heartbeat"
    assert reason_of(frame(shown.encode())) == "schema"  # a goodbye's body is not a heartbeat's


def test_advertised_builders_are_bounded_in_count_and_name_length_and_optional():
    """Capabilities.builders (issue 30): a peer lists the model builders it has, at most MAX_BUILDERS
    names of MAX_BUILDER_NAME_LEN characters; a heartbeat without the field (an older peer) still
    decodes, as advertising none."""
    from p2ptrain.wire import MAX_BUILDER_NAME_LEN, MAX_BUILDERS

    def with_builders(names: list[str]) -> bytes:
        body = heartbeat_body()
        body["caps"]["builders"] = names
        return frame(envelope(type="heartbeat", body=body))

    full = [f"pkg:model_{i}".ljust(MAX_BUILDER_NAME_LEN, "x") for i in range(MAX_BUILDERS)]
    assert decode(with_builders(full)).msg.caps.builders == tuple(full)
    assert reason_of(with_builders([*full, "pkg:one_more"])) == "schema"
    assert reason_of(with_builders(["pkg:" + "x" * MAX_BUILDER_NAME_LEN])) == "schema"
    assert reason_of(with_builders([5])) == "schema"  # type: ignore[list-item]
    older = heartbeat_body()
    del older["caps"]["builders"]
    assert decode(frame(envelope(type="heartbeat", body=older))).msg.caps.builders == ()


def test_capabilities_arithmetic_is_optional_and_bounded():
    """``Capabilities.arithmetic`` came with a default: an older peer's heartbeat (without it)
    decodes as advertising none, a newer one's round-trips, and a long one is refused."""
    from dataclasses import replace

    body = heartbeat_body()
    del body["caps"]["arithmetic"]
    assert decode(frame(envelope(type="heartbeat", body=body))).msg.caps.arithmetic is None
    named = Heartbeat(addrs=(), caps=replace(CAPS, arithmetic="torch 2.13.0 on the CPU with AVX2 kernels"))
    assert decode(encode(named, KEY, seq=1)).msg == named
    long = heartbeat_body()
    long["caps"]["arithmetic"] = "x" * 129
    assert reason_of(frame(envelope(type="heartbeat", body=long))) == "schema"


@pytest.mark.parametrize("field", ["arithmetic", "gpu_name", "version", "device"])
def test_advertised_capability_strings_must_be_printable(field: str):
    """A peer's advertised strings are shown as they are: logged at WARNING when the run leaves the
    peer out for its arithmetic (run/_run_state.py note_left_out), printed by ``task status``
    ("left out" lines) and ``node peers`` (its GPU). Before, a newline or a terminal escape in them
    decoded: one heartbeat-only identity could forge whole log lines ("coordinator ... broke the
    run's rules") in every member's log, or rewrite the user's terminal. Printable text only now;
    the honest strings (a torch release and kernel set, a GPU's name) still decode."""
    def with_caps(value: str) -> bytes:
        body = heartbeat_body()
        body["caps"][field] = value
        return frame(envelope(type="heartbeat", body=body))

    honest = {"arithmetic": "torch 2.11.0 on the CPU with AVX2 kernels", "gpu_name": "NVIDIA H100 80GB HBM3",
              "version": "0.1.0", "device": "cuda"}[field]
    assert getattr(decode(with_caps(honest)).msg.caps, field) == honest
    for hostile in ("torch\n2026-11-26 WARNING coordinator 12D3 broke the run's rules", "cpu\x1b[2J", "x\r", "a\x00"):
        assert reason_of(with_caps(hostile)) == "schema"


def test_a_goodbye_reason_must_be_printable():
    """A goodbye's reason is logged as it is ("peer X left (reason)", mesh/_membership.py): a newline
    in it forged a log line of the peer's choosing in every node that heard it."""
    assert decode(frame(envelope(body={"reason": "shutdown"}))).msg == Goodbye(reason="shutdown")
    assert reason_of(frame(envelope(body={"reason": "shutdown)\n2026-11-26 WARNING forged"}))) == "schema"


def test_an_announced_task_name_must_be_printable():
    """``task list`` prints the names announced on the tasks topic: a newline or a terminal escape
    in one rewrote the lister's terminal or forged a line."""
    cid = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
    assert decode(frame(envelope(type="task_announce", body={"task_cid": cid, "name": "digits"}))).msg.name == "digits"
    for hostile in ("digits\n2026-11-26 WARNING forged", "d\x1b[2J"):
        assert reason_of(frame(envelope(type="task_announce", body={"task_cid": cid, "name": hostile}))) == "schema"
