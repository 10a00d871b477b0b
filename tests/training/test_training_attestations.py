"""Counting attestations of the pending checkpoint record (protocol/_attestations.py), with real
signed records and attestations and an injected clock."""

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import (
    ATTEST_TIMEOUT_S,
    Attestations,
    Chain,
    Misconduct,
    RecordError,
    RoundBook,
    Status,
    attest,
    sign_record,
    signing,
)
from p2ptrain.protocol._attestations import MAX_EARLY_PER_RECORD, MAX_EARLY_RECORDS
from p2ptrain.task import load_task
from p2ptrain.wire import Attestation, ModelRecord, RoundPlan, SignedAttestation

TASK = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
INITIAL = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
KEYS = [create_new_key_pair() for _ in range(4)]
PEERS = [signing.peer_str(k) for k in KEYS]
COORDINATOR = KEYS[0]


FIRST_THREE = tuple(sorted(PEERS[:3]))


TASK_SPEC = load_task(f"""name = "t"
[model]
name = "mlp"
kwargs = {{ hidden = [4] }}
[dataset]
manifest = "{TASK}"
[optimizer]
name = "sgd"
lr = 0.1
[training]
batch_size = 4
total_steps = 1000
""")


def span(version: int, members=FIRST_THREE) -> RoundPlan:
    """The plan of the span that record ``version`` ends (ten rounds, as signed_record's)."""
    return RoundPlan(task_cid=TASK, term=1, round=version * 10 - 10, attempt=0, step=version * 10 - 10, rounds=10,
                     members=members, base_cid=INITIAL, version=version - 1)


def new_book(*versions: int) -> RoundBook:
    """A member's book with the plans of the spans ending at records ``versions`` (default v1, v2)."""
    book = RoundBook(TASK_SPEC, TASK, Chain(TASK, INITIAL), 1000)
    for version in versions or (1, 2):
        plan = span(version)
        book.span_plans[plan.step + plan.rounds] = plan
    return book


def signed_record(version=1, parent=INITIAL, model_cid="Qmmodel", members=FIRST_THREE, key=COORDINATOR):
    record = ModelRecord(task_cid=TASK, version=version, parent=parent, round=version * 10 - 1, step=version * 10,
                         members=members, metrics={"loss": 0.5}, model_cid=model_cid, optimizer_cid="Qmoptim",
                         term=1, coordinator="")
    return sign_record(record, key)


def attestations_for(signed, model_cid="Qmmodel"):
    """Each member's attestation that its weights hash to ``model_cid``."""
    return [attest(signed.record, model_cid, "Qmoptim", k) for k in KEYS if signing.peer_str(k) in signed.record.members]


def test_a_quorum_confirms():
    book, att = new_book(), Attestations()
    signed = signed_record()
    assert att.offer_record(signed, book, PEERS[0], 0.0) is Status.PENDING and att.pending
    first, second, third = attestations_for(signed)
    assert att.add(first) is Status.PENDING
    assert att.add(first) is Status.PENDING  # one voice per member
    assert att.add(second) is Status.CONFIRMED and not att.pending
    assert att.add(third) is Status.CONFIRMED


def test_a_quorum_of_other_hashes_rejects():
    book, att = new_book(), Attestations()
    signed = signed_record()
    att.offer_record(signed, book, None, 0.0)
    first, second, _ = attestations_for(signed, model_cid="Qmother")
    assert att.add(first) is Status.PENDING
    assert att.add(second) is Status.REJECTED


def test_attestations_that_come_before_their_record_are_counted_when_it_comes():
    book, att = new_book(), Attestations()
    signed = signed_record()
    first, second, _ = attestations_for(signed)
    assert att.add(first) is None and att.add(second) is None  # kept: no record yet
    assert att.offer_record(signed, book, PEERS[0], 5.0) is Status.CONFIRMED


def test_the_early_buffer_is_bounded():
    att = Attestations()
    key = KEYS[1]

    def forged(record_id):
        body = Attestation(task_cid=TASK, version=1, record_id=record_id, model_cid="Qm", optimizer_cid="Qm",
                           attester=PEERS[1])
        return SignedAttestation(attestation=body, signature=signing.sign(body, key))

    for i in range(MAX_EARLY_RECORDS + 20):  # attestations for records that never come
        assert att.add(forged(f"{i:064x}")) is None
    assert len(att._early) == MAX_EARLY_RECORDS  # no key for the ones over the bound either
    one = forged("0" * 64)
    for _ in range(MAX_EARLY_PER_RECORD + 5):
        att.add(one)
    assert max(len(kept) for kept in att._early.values()) == MAX_EARLY_PER_RECORD
    assert att.dropped_early == 20 + MAX_EARLY_PER_RECORD + 5 - (MAX_EARLY_PER_RECORD - 1)


def test_a_second_record_is_refused_while_one_is_pending():
    book, att = new_book(), Attestations()
    signed = signed_record()
    att.offer_record(signed, book, PEERS[0], 0.0)
    assert att.offer_record(signed, book, PEERS[0], 1.0) is None  # the same one again: nothing new
    other = signed_record(model_cid="Qmother")
    with pytest.raises(RecordError, match="second model record v1 while v1 is pending"):
        att.offer_record(other, book, PEERS[0], 1.0)
    assert att.tally.record == signed.record


def test_a_record_not_from_the_coordinator_or_off_the_chain_is_refused():
    book, att = new_book(), Attestations()
    with pytest.raises(RecordError, match="not the coordinator"):
        att.offer_record(signed_record(key=KEYS[1]), book, PEERS[0], 0.0)
    with pytest.raises(RecordError, match="fork"):
        att.offer_record(signed_record(parent="Qmelsewhere"), book, PEERS[0], 0.0)
    with pytest.raises(RecordError, match="gap"):
        att.offer_record(signed_record(version=2), book, PEERS[0], 0.0)
    assert att.tally is None


def test_a_record_short_of_a_quorum_by_the_deadline_is_rejected():
    book, att = new_book(), Attestations()
    signed = signed_record()
    att.offer_record(signed, book, PEERS[0], 100.0)
    att.add(attestations_for(signed)[0])
    assert att.expire(100.0 + ATTEST_TIMEOUT_S) is None  # not yet
    assert att.expire(100.0 + ATTEST_TIMEOUT_S + 0.1) is Status.REJECTED and not att.pending
    assert att.expire(200.0) is None  # once
    # The barrier is open: the next record is taken up.
    assert att.offer_record(signed_record(model_cid="Qmnext"), book, PEERS[0], 201.0) is Status.PENDING


def test_whose_attestation_is_due():
    book, att = new_book(), Attestations()
    signed = signed_record()
    assert att.due(PEERS[1]) is None  # no record
    att.offer_record(signed, book, PEERS[0], 0.0)
    assert att.due(PEERS[1]) == signed.record
    assert att.due(PEERS[3]) is None  # not a member of the span
    att.add(next(a for a in attestations_for(signed) if a.attestation.attester == PEERS[1]))
    assert att.due(PEERS[1]) is None  # attested
    att.clear()
    assert att.due(PEERS[2]) is None and not att.pending


def test_the_record_after_the_pending_one_is_kept_and_taken_up_once_it_settles():
    """Overlapping checkpoints: the coordinator publishes v2 once v1 is confirmed on its side, which
    can be before this member counted v1's last attestation. v2 is kept (not refused) and taken up
    then, with the attestations that came early; a forged or unrelated v2 does not take its place."""
    book, att = new_book(), Attestations()
    v1 = signed_record()
    assert att.offer_record(v1, book, PEERS[0], 0.0) is Status.PENDING
    v2 = signed_record(version=2, parent="Qmmodel", model_cid="Qmmodel2")
    early = attestations_for(v2, model_cid="Qmmodel2")
    assert att.add(early[0]) is None  # before its record: kept
    assert att.offer_record(v2, book, PEERS[0], 1.0) is None and att.next == v2
    with pytest.raises(RecordError):  # signed by another key: refused, the kept one stays
        att.offer_record(signed_record(version=2, parent="Qmmodel", key=KEYS[1]), book, PEERS[0], 1.5)
    with pytest.raises(RecordError, match="gap"):  # not v1's child: checked against the chain
        att.offer_record(signed_record(version=2, parent="Qmelse"), book, PEERS[0], 1.5)
    assert att.next == v2
    for a in attestations_for(v1)[:2]:
        status = att.add(a)
    assert status is Status.CONFIRMED
    book.chain.append(v1)
    assert att.take_next(book, PEERS[0], 2.0) is Status.PENDING and att.tally.record == v2.record
    assert att.next is None and att.due(PEERS[1]) == v2.record
    assert att.add(early[1]) is Status.CONFIRMED  # the early one counted with this one


def test_the_record_kept_for_after_a_rejected_one_is_refused_when_taken_up():
    book, att = new_book(), Attestations()
    att.offer_record(signed_record(), book, PEERS[0], 0.0)
    att.offer_record(signed_record(version=2, parent="Qmmodel", model_cid="Qmmodel2"), book, PEERS[0], 1.0)
    assert att.expire(ATTEST_TIMEOUT_S + 1) is Status.REJECTED
    with pytest.raises(RecordError, match="gap"):  # its parent never joined the chain
        att.take_next(book, PEERS[0], ATTEST_TIMEOUT_S + 1)
    assert att.next is None and not att.pending


def test_the_quorum_counts_the_plans_members_and_a_record_naming_others_is_misconduct():
    """The attack of issue 27: an elected coordinator signs a record naming only itself, so that its
    own attestation is a quorum of the record's one member. The plan of the span (which every member
    of the span holds) is what counts: the record is refused as evidence against its signer."""
    book, att = new_book(), Attestations()
    alone = signed_record(members=(PEERS[0],))
    with pytest.raises(Misconduct, match="not the 3 its span's plan"):
        att.offer_record(alone, book, PEERS[0], 0.0)
    assert att.tally is None
    # The honest record of the same span: its one attestation by the coordinator is not a quorum of 3.
    honest = signed_record()
    assert att.offer_record(honest, book, PEERS[0], 0.0) is Status.PENDING
    own = next(a for a in attestations_for(honest) if a.attestation.attester == PEERS[0])
    assert att.add(own) is Status.PENDING
    with pytest.raises(RecordError, match="not a member"):  # a peer outside the plan has no voice
        att.add(attest(honest.record, "Qmmodel", "Qmoptim", KEYS[3]))


def test_a_record_of_a_span_whose_plan_is_unknown_is_not_counted():
    book, att = new_book(2), Attestations()  # this member never saw the plan of v1's span
    with pytest.raises(RecordError, match="no plan of its span"):
        att.offer_record(signed_record(), book, PEERS[0], 0.0)
