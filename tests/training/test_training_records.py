"""Model bytes, signed records, attestations and the confirmed chain."""

import dataclasses
import json

import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.protocol import (
    Chain,
    RecordError,
    Status,
    Tally,
    attest,
    entry_from_bytes,
    load_model_bytes,
    model_bytes,
    sign_record,
    signing,
    tensors_bytes,
)
from p2ptrain.models import build_model
from p2ptrain.protocol._lineage import entry_bytes
from p2ptrain.protocol._records import quorum, record_id, verify_record
from p2ptrain.wire import ConfirmedRecord, ModelRecord, SignedAttestation, decode, encode

TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
KEYS = [create_new_key_pair() for _ in range(5)]
PEERS = [signing.peer_str(k) for k in KEYS]


@pytest.fixture
def store(tmp_path):
    return EmbeddedStore(tmp_path / "home")


def test_model_bytes_deterministic_and_cid_stable(store, tmp_path):
    a = build_model("cnn", {}, 3)
    b = build_model("cnn", {}, 3)
    data = model_bytes(a)
    assert data == model_bytes(b) == model_bytes(a)
    other = EmbeddedStore(tmp_path / "other")
    assert store.add_bytes(data) == other.add_bytes(model_bytes(b))
    # Non-contiguous and differently ordered tensors give the same bytes as their contiguous copies.
    t = torch.arange(12.0).reshape(3, 4)
    assert tensors_bytes({"b": t.t(), "a": t}) == tensors_bytes({"a": t.clone(), "b": t.t().contiguous()})


def test_load_back_exactly_and_refuse_mismatch():
    src = build_model("mlp", {"hidden": [16]}, 1)
    dst = build_model("mlp", {"hidden": [16]}, 2)
    load_model_bytes(dst, model_bytes(src))
    assert model_bytes(dst) == model_bytes(src)
    with pytest.raises(RecordError, match=r"tensor 1.weight: \(16, 64\) torch.float32, architecture needs \(32, 64\)"):
        load_model_bytes(build_model("mlp", {"hidden": [32]}, 0), model_bytes(src))
    with pytest.raises(RecordError, match="missing"):
        load_model_bytes(build_model("mlp", {"hidden": [16, 16]}, 0), model_bytes(src))
    with pytest.raises(RecordError, match="not a valid safetensors file"):
        load_model_bytes(dst, b"\x80\x04pickle? no")
    half = tensors_bytes({k: v.half() for k, v in src.state_dict().items()})
    with pytest.raises(RecordError, match="torch.float16"):
        load_model_bytes(dst, half)


def record(version=1, parent="Qmparent", model_cid="Qmmodel", members=tuple(PEERS[:3]), **kw):
    fields = dict(task_cid=TASK, version=version, parent=parent, round=version * 10 - 1, step=version * 10,
                  members=members, metrics={"loss": 0.5, "accuracy": 0.9}, model_cid=model_cid,
                  optimizer_cid="Qmoptim", term=1, coordinator="")
    fields.update(kw)
    return ModelRecord(**fields)


def test_signed_record_verifies_and_tampering_is_caught():
    signed = sign_record(record(), KEYS[0])
    assert signed.record.coordinator == PEERS[0]
    assert verify_record(signed) == signed.record
    for change in [{"model_cid": "Qmevil"}, {"version": 2}, {"metrics": {"loss": 0.1, "accuracy": 0.99}},
                   {"members": tuple(PEERS[:2])}, {"coordinator": PEERS[1]}]:
        forged = dataclasses.replace(signed, record=dataclasses.replace(signed.record, **change))
        with pytest.raises(RecordError):
            verify_record(forged)
    wrong_key = dataclasses.replace(signed, signature=signing.sign(signed.record, KEYS[1]))
    with pytest.raises(RecordError, match="bad signature"):
        verify_record(wrong_key)


def line(signed, attestations=()):
    """One chain line holding ``signed``."""
    return entry_bytes(ConfirmedRecord(signed=signed, attestations=tuple(attestations)))


def test_record_bytes_round_trip_and_travel_on_the_wire():
    signed = sign_record(record(), KEYS[0])
    att = attest(signed.record, "Qmmodel", "Qmoptim", KEYS[1])
    data = line(signed, [att])
    assert entry_from_bytes(data) == ConfirmedRecord(signed=signed, attestations=(att,))
    tampered = data.replace(b'"accuracy":0.9', b'"accuracy":1.0')
    assert tampered != data
    with pytest.raises(RecordError, match="bad signature"):
        entry_from_bytes(tampered)
    with pytest.raises(RecordError, match="not a chain line"):
        entry_from_bytes(json.dumps({"signed": {}}).encode())
    # The same signed record inside a wire envelope (signed by someone else, who relays it).
    got = decode(encode(signed, KEYS[4], seq=1)).msg
    assert got == signed and verify_record(got)


def test_tally_confirms_at_a_quorum_of_members():
    signed = sign_record(record(members=tuple(PEERS[:4])), KEYS[0])
    tally = Tally(signed, signed.record.members)
    assert quorum(4) == 3
    assert tally.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[0])) is Status.PENDING
    assert tally.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[0])) is Status.PENDING  # repeat
    assert tally.add(attest(signed.record, "Qmother", "Qmoptim", KEYS[1])) is Status.PENDING
    assert tally.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[2])) is Status.PENDING
    with pytest.raises(RecordError, match="not a member"):
        tally.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[4]))
    assert tally.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[3])) is Status.CONFIRMED
    assert set(tally.matching) == set(PEERS[:1] + PEERS[2:4]) and tally.differing == {PEERS[1]: "Qmother"}


def test_tally_rejects_a_record_nobody_reproduces(caplog):
    signed = sign_record(record(), KEYS[0])
    tally = Tally(signed, signed.record.members)
    tally.add(attest(signed.record, "QmA", "Qmoptim", KEYS[1]))
    assert tally.status is Status.PENDING
    assert tally.add(attest(signed.record, "QmB", "Qmoptim", KEYS[2])) is Status.REJECTED
    assert "rejected" in caplog.text and "0 of 3 members reproduced it" in caplog.text
    # Same model, other optimizer state: not a reproduction either.
    tally2 = Tally(sign_record(record(), KEYS[0]), record().members)
    tally2.add(attest(tally2.record, "Qmmodel", "Qmdiff", KEYS[1]))
    assert tally2.expire() is Status.REJECTED


def test_a_record_its_deadline_rejected_is_confirmed_by_a_quorum_that_comes_later(caplog):
    """The coordinator's deadline passed before the other member's attestation came; that member,
    counting both in time, held v1 confirmed, and refused every later v1 as a fork while the
    coordinator held it rejected (a suite run at load ~4). The quorum is the confirmation."""
    signed = sign_record(record(members=tuple(PEERS[:2])), KEYS[0])
    late = Tally(signed, signed.record.members)
    assert late.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[0])) is Status.PENDING
    assert late.expire() is Status.REJECTED
    caplog.set_level("INFO")
    assert late.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[1])) is Status.CONFIRMED
    assert "confirmed after its attestation deadline" in caplog.text
    # A late attestation of another model does not: the record stays rejected (no quorum can come).
    other = Tally(signed, signed.record.members)
    other.add(attest(signed.record, "Qmmodel", "Qmoptim", KEYS[0]))
    assert other.expire() is Status.REJECTED
    assert other.add(attest(signed.record, "Qmelse", "Qmoptim", KEYS[1])) is Status.REJECTED
    # Rejected by the attestations themselves (a quorum can no longer reproduce it): never confirmed.
    three = sign_record(record(), KEYS[0])
    refused = Tally(three, three.record.members)
    refused.add(attest(three.record, "QmA", "Qmoptim", KEYS[1]))
    assert refused.add(attest(three.record, "QmB", "Qmoptim", KEYS[2])) is Status.REJECTED
    assert refused.add(attest(three.record, "Qmmodel", "Qmoptim", KEYS[0])) is Status.REJECTED


def test_a_record_a_quorum_computed_otherwise_is_outvoted_and_one_without_such_a_quorum_is_not():
    signed = sign_record(record(members=tuple(PEERS[:5])), KEYS[0])
    tally = Tally(signed, signed.record.members)
    tally.add(attest(signed.record, "QmA", "Qmoptim", KEYS[1]))
    tally.add(attest(signed.record, "QmB", "Qmoptim", KEYS[2]))
    assert tally.add(attest(signed.record, "QmA", "Qmoptim", KEYS[3])) is Status.REJECTED
    assert tally.outvoted() is None  # rejected (3 of 5 differ), but no quorum agrees on another model
    tally.add(attest(signed.record, "QmA", "Qmoptim", KEYS[4]))  # late: still counted
    assert tally.outvoted() == "QmA"  # 3 of 5 signed that they computed QmA, not the record's model
    confirmed = Tally(signed, signed.record.members)
    for key in KEYS[:3]:
        confirmed.add(attest(signed.record, "Qmmodel", "Qmoptim", key))
    assert confirmed.status is Status.CONFIRMED and confirmed.outvoted() is None


def test_tally_refuses_forged_or_foreign_attestations():
    signed = sign_record(record(), KEYS[0])
    tally = Tally(signed, signed.record.members)
    att = attest(signed.record, "Qmmodel", "Qmoptim", KEYS[1])
    forged = SignedAttestation(dataclasses.replace(att.attestation, attester=PEERS[2]), att.signature)
    with pytest.raises(RecordError, match="bad signature"):
        tally.add(forged)
    other = attest(record(version=2), "Qmmodel", "Qmoptim", KEYS[1])
    with pytest.raises(RecordError, match="another record"):
        tally.add(other)
    assert not tally.matching


def test_chain_refuses_fork_and_gap():
    chain = Chain(TASK, "Qminit")
    r1 = sign_record(record(1, parent="Qminit", model_cid="Qm1"), KEYS[0])
    chain.append(r1)
    assert chain.head_cid == "Qm1" and chain.version == 1
    with pytest.raises(RecordError, match="gap: model record v3 after v1"):
        chain.append(sign_record(record(3, parent="Qm1", model_cid="Qm3"), KEYS[0]))
    with pytest.raises(RecordError, match="fork: model record v2: its parent Qminit"):
        chain.append(sign_record(record(2, parent="Qminit", model_cid="Qm2"), KEYS[0]))
    with pytest.raises(RecordError, match="fork: a different model record v1"):
        chain.append(sign_record(record(1, parent="Qminit", model_cid="Qm1b"), KEYS[1]))
    with pytest.raises(RecordError, match="already in the chain"):
        chain.append(r1)
    with pytest.raises(RecordError, match="belongs to task"):
        chain.append(sign_record(record(2, parent="Qm1", task_cid="Qmother"), KEYS[0]))
    r2 = sign_record(record(2, parent="Qm1", model_cid="Qm2"), KEYS[1])  # a later term's coordinator
    chain.append(r2)
    again = Chain.from_bytes(TASK, "Qminit", chain.to_bytes())
    assert again.records == [r1, r2] and again.head_cid == "Qm2"
    with pytest.raises(RecordError, match="bad signature"):
        Chain.from_bytes(TASK, "Qminit", chain.to_bytes().replace(b"Qm2", b"Qm9"))
    with pytest.raises(RecordError, match="gap"):
        Chain.from_bytes(TASK, "Qminit", line(r2))
    with pytest.raises(RecordError, match="versions start at 1"):
        Chain(TASK, "Qminit").append(sign_record(record(0, parent="Qminit"), KEYS[0]))


def test_record_id_names_the_exact_record():
    a = record()
    assert record_id(a) == record_id(dataclasses.replace(a))
    assert record_id(a) != record_id(dataclasses.replace(a, step=a.step + 1))


def _model_with_card(card_text: str) -> bytes:
    return tensors_bytes(build_model("mlp", {"hidden": [4]}, 0).state_dict(), metadata={"p2ptrain.model": card_text})


@pytest.mark.parametrize(
    "data,why",
    [
        (b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"[" * 16, "not valid"),
        (len(b"[" * 100_000).to_bytes(8, "little") + b"[" * 100_000, "nested"),  # was RecursionError
        (_model_with_card("[" * 50_000), "nested"),  # was RecursionError
        (_model_with_card('{"name":"mlp","kwargs":{"in_features":1' + "0" * 400 + "}}"), "integer"),
        (_model_with_card('{"name":"mlp"}'), "name and kwargs"),
    ],
)
def test_a_hostile_model_file_header_is_a_record_error(data, why):
    from p2ptrain.protocol import read_model_card

    with pytest.raises(RecordError, match=why):
        read_model_card(data)


def test_huge_numbers_and_deep_nesting_in_a_stored_record_are_record_errors():
    data = line(sign_record(record(), KEYS[0]))
    assert b'"accuracy":0.9' in data
    with pytest.raises(RecordError, match="integer"):  # a float overflow in the schema check before
        entry_from_bytes(data.replace(b'"accuracy":0.9', b'"accuracy":1' + b"0" * 400))
    with pytest.raises(RecordError, match="nested"):
        entry_from_bytes(data.replace(b'"accuracy":0.9', b'"accuracy":' + b"[" * 5000 + b"]" * 5000))
    with pytest.raises(RecordError):
        entry_from_bytes(b"[" * 60_000)


def test_reading_tensors_checks_the_header_first():
    from p2ptrain.protocol import read_tensors

    good = tensors_bytes({"a": torch.zeros(2)})
    assert read_tensors(good)["a"].shape == (2,)
    bad = good[:8] + good[8:].replace(b"[0,8]", b"[0,9]")  # a range one byte past the data
    with pytest.raises(RecordError, match="outside"):
        read_tensors(bad)


def test_a_chain_extends_another_only_with_the_same_records_as_a_prefix():
    r1 = sign_record(record(1, parent="Qminit", model_cid="Qm1"), KEYS[0])
    r2 = sign_record(record(2, parent="Qm1", model_cid="Qm2"), KEYS[0])
    r3 = sign_record(record(3, parent="Qm2", model_cid="Qm3"), KEYS[1])
    ours, longer, shorter = Chain(TASK, "Qminit"), Chain(TASK, "Qminit"), Chain(TASK, "Qminit")
    for r in (r1, r2):
        ours.append(r)
    for r in (r1, r2, r3):
        longer.append(r)
    shorter.append(r1)
    assert ours.extension(longer) == [r3]
    assert ours.extension(shorter) == [] and ours.extension(ours) == []
    assert Chain(TASK, "Qminit").extension(longer) == [r1, r2, r3]  # a fresh joiner's empty chain
    # A fork at a version we confirmed: another record v2 (signed by anyone, parent links intact).
    forked = Chain(TASK, "Qminit")
    forked.append(r1)
    forked.append(sign_record(record(2, parent="Qm1", model_cid="Qm2evil"), KEYS[4]))
    forked.append(sign_record(record(3, parent="Qm2evil", model_cid="Qm3evil"), KEYS[4]))
    with pytest.raises(RecordError, match="fork: a different model record v2"):
        ours.extension(forked)
    with pytest.raises(RecordError, match="fork: the chain starts from another"):
        ours.extension(Chain(TASK, "Qmotherinit"))


def test_chain_bytes_and_records_are_bounded(monkeypatch):
    import p2ptrain.protocol._lineage as lineage

    with pytest.raises(RecordError, match="over the 67108864 B limit"):
        Chain.from_bytes(TASK, "Qminit", b"\n" * (lineage.MAX_CHAIN_BYTES + 1))
    chain = Chain(TASK, "Qminit")
    parent = "Qminit"
    for v in (1, 2, 3):
        chain.append(sign_record(record(v, parent=parent, model_cid=f"Qm{v}"), KEYS[0]))
        parent = f"Qm{v}"
    monkeypatch.setattr(lineage, "MAX_CHAIN_RECORDS", 2)
    with pytest.raises(RecordError, match="3 records is over the 2 record limit"):
        Chain.from_bytes(TASK, "Qminit", chain.to_bytes())
