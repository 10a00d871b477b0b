"""Red team against the attestation rules (protocol/_attestations.py, Tally): a hostile member, a
hostile elected coordinator or anyone on the topic, driving real signed records and attestations
through Attestations and a RoundBook with an injected clock."""

from dataclasses import replace

import pytest

from p2ptrain.protocol import ATTEST_TIMEOUT_S, Attestations, ForkAnswers, RecordError, Status, sign_record, signing
from p2ptrain.protocol._lineage import attestation_problem, proof
from p2ptrain.protocol._attestations import ANSWER_EVERY_S, BINDING_DEADLINES, MAX_EARLY_RECORDS
from p2ptrain.wire import Attestation, SignedAttestation

from .test_training_attestations import KEYS, PEERS, TASK, attestations_for, new_book, own, signed_record


def test_an_attestation_naming_another_version_is_not_counted():
    """A hostile member signs a matching attestation of the record's id with another version in its
    body. The chain's proof check skips such an attestation, so counting it made a quorum the
    chain then refused: the tally CONFIRMED, Chain.append raising out of the attestation handler,
    and the record never confirmed there (the coordinator never publishing its next one)."""
    book, att = new_book(), Attestations()
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    att.add(own(v1, PEERS[0]))
    good = own(v1, PEERS[1])
    body = Attestation(**{**vars(good.attestation), "version": 7})
    bad = SignedAttestation(attestation=body, signature=signing.sign(body, KEYS[1]))
    with pytest.raises(RecordError, match="another record"):
        att.add(bad)
    assert att.pending
    tally = att.add(own(v1, PEERS[2]))
    assert tally is not None and tally.status is Status.CONFIRMED
    assert attestation_problem(v1.record, proof(v1.record, tally.matching.values())) is None  # as the chain checks


def test_a_sibling_kept_open_is_not_attested_once_the_pending_record_is_confirmed():
    """A hostile elected coordinator publishes v1 and, while v1 is pending, a sibling of the same CIDs
    (other metrics): it is kept open. Once v1 is confirmed here, the sibling can never extend this
    member's chain, but it stayed open and owed, and BINDING_DEADLINES deadlines after v1's
    attestation the binding lapsed: every honest member signed the sibling too, a second verifiable
    v1 for whoever did not count v1's quorum."""
    book, att = new_book(), Attestations()
    me = PEERS[1]
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    twin = sign_record(replace(v1.record, metrics={"loss": 0.25}), KEYS[0])  # same CIDs, another id
    assert att.offer_record(twin, book, PEERS[0], 1.0) is not None and len(att.open) == 1
    att.attesting(v1.record, 1.0)
    att.add(own(v1, me))
    tally = att.add(own(v1, PEERS[0]))
    assert tally is att.tally and tally.status is Status.CONFIRMED
    book.chain.append(v1, tuple(tally.matching.values()))
    later = 1.0 + BINDING_DEADLINES * ATTEST_TIMEOUT_S + 1
    assert att.bound_to(twin.record, later) is None  # (the binding lapsed: only owed() stands in the way)
    assert att.owed(me) == [] and att.open == []


def test_stale_early_attestations_do_not_hold_the_early_slots_for_good():
    """Attestations of a record no longer counted here (the third of three members' attestation after
    the quorum, in overlap mode once the next record was taken up; a fork answer's proof at a member
    that confirmed the record already) were kept as early ones, for good: after MAX_EARLY_RECORDS
    checkpoints every early attestation was dropped, and a member whose peers' attestations beat
    the record to it missed its quorum."""
    book, att = new_book(*range(1, MAX_EARLY_RECORDS + 3)), Attestations()
    parent, straggler = book.chain.initial_cid, None
    for version in range(1, MAX_EARLY_RECORDS + 2):
        record = signed_record(version=version, parent=parent, model_cid=f"Qmmodel{version}")
        att.offer_record(record, book, PEERS[0], version * 100.0)
        if straggler is not None:
            att.add(straggler)  # the last attestation of the record before: settled here already
        first, second, straggler = attestations_for(record, model_cid=f"Qmmodel{version}")
        att.add(first)
        tally = att.add(second)
        assert tally is not None and tally.status is Status.CONFIRMED
        book.chain.append(record, tuple(tally.matching.values()))
        parent = f"Qmmodel{version}"
    record = signed_record(version=MAX_EARLY_RECORDS + 2, parent=parent, model_cid="Qmlast")
    early = attestations_for(record, model_cid="Qmlast")
    att.add(early[1])
    att.add(early[2])
    assert att.dropped_early == 0
    tally = att.offer_record(record, book, PEERS[0], 5000.0)
    assert tally is not None and tally.status is Status.CONFIRMED


def test_attestations_of_records_far_ahead_do_not_keep_out_the_next_records():
    """Anyone on the topic signs attestations of MAX_EARLY_RECORDS made-up records of far versions:
    kept until their record came (never), they held every early slot for good."""
    book, att = new_book(), Attestations()
    outsider = KEYS[3]
    for i in range(MAX_EARLY_RECORDS):
        body = Attestation(task_cid=TASK, version=10**6 + i, record_id=f"{i:064x}", model_cid="Qm",
                           optimizer_cid="Qm", attester=PEERS[3])
        att.add(SignedAttestation(attestation=body, signature=signing.sign(body, outsider)))
    v1 = signed_record()
    first, second, _ = attestations_for(v1)
    assert att.add(first) is None and att.add(second) is None
    tally = att.offer_record(v1, book, PEERS[0], 0.0)
    assert tally is not None and tally.status is Status.CONFIRMED


def test_a_fork_is_answered_for_the_coordinators_own_publication_once_per_period_in_all():
    """The answer to a fork is a quorum's worth of messages from each member that confirmed the
    record. Anyone could send the coordinator's signed sibling again (the record's sender was not
    looked at: the mesh refuses a replayed message, not the same record in a message of one's own),
    and an elected coordinator cycling siblings of more versions than were remembered (8) got an
    answer for every one of its messages."""
    book = new_book(*range(1, 12))
    parent = book.chain.initial_cid
    for version in range(1, 11):
        record = signed_record(version=version, parent=parent, model_cid=f"Qmmodel{version}")
        book.chain.append(record)
        parent = f"Qmmodel{version}"
    records = [r.record for r in book.chain.records]
    siblings = [signed_record(version=r.version, parent=r.parent, model_cid="Qmsibling") for r in records]
    answers, coordinator = ForkAnswers(), PEERS[0]
    assert answers.due(book.chain, siblings[0], PEERS[3], coordinator, 0.0) is None  # someone else sent it again
    assert answers.due(book.chain, siblings[0], coordinator, PEERS[1], 0.0) is None  # not the coordinator's
    assert answers.due(book.chain, siblings[0], coordinator, coordinator, 0.0) == 1
    assert [answers.due(book.chain, s, coordinator, coordinator, 1.0) for s in siblings] == [None] * 10
    assert answers.due(book.chain, siblings[9], coordinator, coordinator, ANSWER_EVERY_S + 0.1) == 10
    stranger = signed_record(version=3, parent="Qmelsewhere", model_cid="Qmsibling")
    assert answers.due(book.chain, stranger, coordinator, coordinator, 100.0) is None  # parted earlier
    assert answers.due(book.chain, signed_record(version=11, parent=parent), coordinator, coordinator, 100.0) is None


def test_between_terms_no_record_is_kept_open_beside_the_pending_one():
    """A member between terms (its coordinator fell silent or was caught breaking the rules) knows no
    coordinator to take records from. A peer elected in an earlier term (the one just given up)
    signed a sibling of the pending record: it was kept open, owed, attested by every member whose
    state it names, and its late quorum set the pending record aside, while members that already
    followed the next coordinator refused it."""
    book, att = new_book(), Attestations()
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    earlier = signed_record(model_cid="Qmother", key=KEYS[1])
    with pytest.raises(RecordError, match="no coordinator"):
        att.offer_record(earlier, book, None, 1.0)
    assert att.open == [] and att.owed(PEERS[2]) == [v1.record]


def test_only_signed_attestations_of_planned_members_are_kept_early():
    """Anyone on the topic (a key of its own, or a member's name and no valid signature) signs
    attestations of made-up records of the next version, as many as there are slots, again at each
    checkpoint: no early attestation of the span's members was kept."""
    book, att = new_book(), Attestations()
    outsider = KEYS[3]
    for i in range(MAX_EARLY_RECORDS):
        body = Attestation(task_cid=TASK, version=1, record_id=f"{i:064x}", model_cid="Qm", optimizer_cid="Qm",
                           attester=PEERS[3])
        att.add(SignedAttestation(attestation=body, signature=signing.sign(body, outsider)), book)
        forged = Attestation(**{**vars(body), "attester": PEERS[1], "record_id": f"{i + 100:064x}"})
        with pytest.raises(RecordError):
            att.add(SignedAttestation(attestation=forged, signature=signing.sign(forged, outsider)), book)
    assert att.dropped_early == MAX_EARLY_RECORDS and att._early == {}
    v1 = signed_record()
    first, second, _ = attestations_for(v1)
    assert att.add(first, book) is None and att.add(second, book) is None
    tally = att.offer_record(v1, book, PEERS[0], 0.0)
    assert tally is not None and tally.status is Status.CONFIRMED
    book.chain.append(v1, tuple(tally.matching.values()))
    dropped = att.dropped_early
    assert att.add(own(signed_record(model_cid="Qmother"), PEERS[1]), book) is None
    assert att.dropped_early == dropped + 1 and att._early == {}  # of a settled version: not kept
