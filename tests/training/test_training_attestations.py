"""Counting attestations of the pending checkpoint record (protocol/_attestations.py), with real
signed records and attestations and an injected clock."""

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import (
    ATTEST_TIMEOUT_S,
    Attestations,
    Chain,
    Fork,
    Misconduct,
    RecordError,
    RoundBook,
    Status,
    attest,
    record_id,
    sign_record,
    signing,
)
from p2ptrain.protocol._attestations import BINDING_DEADLINES, MAX_EARLY_PER_RECORD, MAX_EARLY_RECORDS, MAX_OPEN
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


def status(tally):
    """What a call of Attestations decided: its tally's status (None: nothing counted)."""
    return None if tally is None else tally.status


def attestations_for(signed, model_cid="Qmmodel"):
    """Each member's attestation that its weights hash to ``model_cid``."""
    return [attest(signed.record, model_cid, "Qmoptim", k) for k in KEYS if signing.peer_str(k) in signed.record.members]


def test_a_quorum_confirms():
    book, att = new_book(), Attestations()
    signed = signed_record()
    assert status(att.offer_record(signed, book, PEERS[0], 0.0)) is Status.PENDING and att.pending
    first, second, third = attestations_for(signed)
    assert status(att.add(first)) is Status.PENDING
    assert status(att.add(first)) is Status.PENDING  # one voice per member
    assert status(att.add(second)) is Status.CONFIRMED and not att.pending
    assert status(att.add(third)) is Status.CONFIRMED


def test_a_quorum_of_other_hashes_rejects():
    book, att = new_book(), Attestations()
    signed = signed_record()
    att.offer_record(signed, book, None, 0.0)
    first, second, _ = attestations_for(signed, model_cid="Qmother")
    assert status(att.add(first)) is Status.PENDING
    assert status(att.add(second)) is Status.REJECTED


def test_attestations_that_come_before_their_record_are_counted_when_it_comes():
    book, att = new_book(), Attestations()
    signed = signed_record()
    first, second, _ = attestations_for(signed)
    assert att.add(first) is None and att.add(second) is None  # kept: no record yet
    assert status(att.offer_record(signed, book, PEERS[0], 5.0)) is Status.CONFIRMED


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


def test_a_second_record_while_one_is_pending_is_kept_open_and_never_due():
    """A sibling of the pending record (a member that confirmed it sends it to a coordinator that
    missed its quorum) does not take the pending one's place; it is counted, never attested here."""
    book, att = new_book(), Attestations()
    signed = signed_record()
    att.offer_record(signed, book, PEERS[0], 0.0)
    assert att.offer_record(signed, book, PEERS[0], 1.0) is None  # the same one again: nothing new
    with pytest.raises(RecordError, match="not the coordinator"):  # records come from the coordinator only
        att.offer_record(signed_record(model_cid="Qmother", key=KEYS[1]), book, PEERS[0], 1.0)
    other = signed_record(model_cid="Qmother")
    kept = att.offer_record(other, book, PEERS[0], 1.0)
    assert kept is not None and att.open == [kept] and att.tally.record == signed.record
    assert att.offer_record(other, book, PEERS[0], 1.5) is None
    assert att.owed(PEERS[1]) == [signed.record, other.record]  # (the pending one first)
    first, second, _ = attestations_for(other, model_cid="Qmother")
    assert att.add(first) is kept and status(att.add(second)) is Status.CONFIRMED
    assert att.pending  # the pending record is untouched: the run decides what to do with the other one


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
    assert status(att.expire(100.0 + ATTEST_TIMEOUT_S + 0.1)) is Status.REJECTED and not att.pending
    assert att.expire(200.0) is None  # once
    # The barrier is open: the next record is taken up.
    assert status(att.offer_record(signed_record(model_cid="Qmnext"), book, PEERS[0], 201.0)) is Status.PENDING


def test_whose_attestation_is_due():
    book, att = new_book(), Attestations()
    signed = signed_record()
    assert att.owed(PEERS[1]) == []  # no record
    att.offer_record(signed, book, PEERS[0], 0.0)
    assert att.owed(PEERS[1]) == [signed.record]
    assert att.owed(PEERS[3]) == []  # not a member of the span
    att.add(next(a for a in attestations_for(signed) if a.attestation.attester == PEERS[1]))
    assert att.owed(PEERS[1]) == []  # attested
    att.expire(ATTEST_TIMEOUT_S + 1)
    assert att.owed(PEERS[2]) == [signed.record]  # after its deadline too: a late attestation still counts
    att.clear()
    assert att.owed(PEERS[2]) == [] and not att.pending


def test_the_record_after_the_pending_one_is_kept_and_taken_up_once_it_settles():
    """Overlapping checkpoints: the coordinator publishes v2 once v1 is confirmed on its side, which
    can be before this member counted v1's last attestation. v2 is kept (not refused) and taken up
    then, with the attestations that came early; a forged or unrelated v2 does not take its place."""
    book, att = new_book(), Attestations()
    v1 = signed_record()
    assert status(att.offer_record(v1, book, PEERS[0], 0.0)) is Status.PENDING
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
        settled = status(att.add(a))
    assert settled is Status.CONFIRMED
    book.chain.append(v1)
    assert status(att.take_next(book, PEERS[0], 2.0)) is Status.PENDING and att.tally.record == v2.record
    assert att.next is None and att.owed(PEERS[1]) == [v2.record]
    assert status(att.add(early[1])) is Status.CONFIRMED  # the early one counted with this one


def test_the_record_kept_for_after_a_rejected_one_is_refused_when_taken_up():
    book, att = new_book(), Attestations()
    att.offer_record(signed_record(), book, PEERS[0], 0.0)
    att.offer_record(signed_record(version=2, parent="Qmmodel", model_cid="Qmmodel2"), book, PEERS[0], 1.0)
    assert status(att.expire(ATTEST_TIMEOUT_S + 1)) is Status.REJECTED
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
    assert status(att.offer_record(honest, book, PEERS[0], 0.0)) is Status.PENDING
    own = next(a for a in attestations_for(honest) if a.attestation.attester == PEERS[0])
    assert status(att.add(own)) is Status.PENDING
    with pytest.raises(RecordError, match="not a member"):  # a peer outside the plan has no voice
        att.add(attest(honest.record, "Qmmodel", "Qmoptim", KEYS[3]))


def test_a_record_of_a_span_whose_plan_is_unknown_is_not_counted():
    book, att = new_book(2), Attestations()  # this member never saw the plan of v1's span
    with pytest.raises(RecordError, match="no plan of its span"):
        att.offer_record(signed_record(), book, PEERS[0], 0.0)


def own(signed, peer, model_cid="Qmmodel"):
    """``peer``'s attestation of ``signed`` (its weights hash to ``model_cid``)."""
    return attest(signed.record, model_cid, "Qmoptim", KEYS[PEERS.index(peer)])


def test_a_late_quorum_confirms_a_record_the_deadline_rejected_after_its_sibling_was_taken_up():
    """The split of a suite run at load ~4: the coordinator's deadline for v1 passed before the
    other member's attestation came, and it took up its next v1 (a sibling: same version and
    parent) before that attestation came. v1 stays open and the attestation confirms it; the
    sibling, which can no longer extend the chain, is set aside with the record kept after it."""
    book, att = new_book(), Attestations()
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    att.add(own(v1, PEERS[0]))
    assert status(att.expire(ATTEST_TIMEOUT_S + 1)) is Status.REJECTED
    sibling = signed_record(model_cid="Qmnext")
    taken = att.offer_record(sibling, book, PEERS[0], 30.0)
    assert att.tally is taken and att.pending and [t.record for t in att.open] == [v1.record]
    late = att.add(own(v1, PEERS[1]))
    assert late is not None and late.record == v1.record and late.status is Status.CONFIRMED
    book.chain.append(v1, tuple(late.matching.values()))  # (what the run does: it checks it extends the chain)
    assert att.confirmed_late(late, book.chain.version) is taken
    assert att.tally is None and att.next is None and att.open == [] and not att.pending
    # An attestation for the record set aside counts for nothing now: kept as one for a record to come.
    assert att.add(own(sibling, PEERS[1], "Qmnext")) is None


def test_an_attestation_binds_its_attester_to_the_record_while_it_may_be_confirmed_elsewhere():
    book, att = new_book(), Attestations()
    me = PEERS[1]
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    att.attesting(v1.record, 1.0)
    att.add(own(v1, me))
    att.expire(ATTEST_TIMEOUT_S + 1)
    sibling = signed_record(model_cid="Qmnext")
    att.offer_record(sibling, book, PEERS[0], 30.0)
    assert att.owed(me) == [sibling.record]  # owed, but bound:
    assert att.bound_to(sibling.record, 30.0) == (record_id(v1.record), 1.0)
    assert att.bound_to(v1.record, 30.0) is None  # the record itself, again: no conflict
    assert att.bound_to(signed_record(version=2, parent="Qmmodel").record, 30.0) is None  # its child
    lapse = 1.0 + BINDING_DEADLINES * ATTEST_TIMEOUT_S
    assert att.bound_to(sibling.record, lapse) is not None and att.bound_to(sibling.record, lapse + 0.1) is None


def test_a_record_its_members_ruled_out_binds_nobody():
    """A quorum of v1's members attested another model: v1 can never be confirmed, so its attester is
    free at once (not after BINDING_DEADLINES deadlines) to attest the coordinator's next v1."""
    book, att = new_book(), Attestations()
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    att.attesting(v1.record, 1.0)
    att.add(own(v1, PEERS[1]))
    assert status(att.add(own(v1, PEERS[0], "Qmother"))) is Status.PENDING
    assert status(att.add(own(v1, PEERS[2], "Qmother"))) is Status.REJECTED
    sibling = signed_record(model_cid="Qmnext")
    att.offer_record(sibling, book, PEERS[0], 5.0)
    assert att.open == [] and att.bound_to(sibling.record, 5.0) is None


def test_open_records_are_bounded_and_dropped_once_the_chain_passes_them():
    book, att = new_book(), Attestations()
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    for i in range(MAX_OPEN + 3):  # siblings sent by anyone elected: the oldest go first
        att.offer_record(signed_record(model_cid=f"Qm{i}"), book, PEERS[0], 1.0)
    assert [t.record.model_cid for t in att.open] == [f"Qm{i}" for i in range(3, MAX_OPEN + 3)]
    first, second, _ = attestations_for(v1)
    att.add(first)
    assert status(att.add(second)) is Status.CONFIRMED
    book.chain.append(v1)
    att.offer_record(signed_record(version=2, parent="Qmmodel", model_cid="Qmmodel2"), book, PEERS[0], 2.0)
    assert att.open == []


def test_a_sibling_of_a_confirmed_record_is_a_fork_and_the_record_itself_is_held():
    book = new_book()
    v1 = signed_record()
    book.chain.append(v1)
    assert book.chain.holds(v1.record) and not book.chain.holds(signed_record(model_cid="Qmnext").record)
    with pytest.raises(Fork, match="fork"):
        book.chain.check(signed_record(model_cid="Qmnext"))
    with pytest.raises(RecordError, match="already in the chain") as raised:
        book.chain.check(v1)
    assert not isinstance(raised.value, Fork)


def test_a_record_the_deadline_rejected_and_its_members_then_ruled_out_binds_nobody():
    """The other member's differing attestation came after the deadline: the record is ruled out
    for good now, and binds its attester no longer (a two-member run whose last round failed at one
    member waited out the binding for each retried record before)."""
    book, att = new_book(), Attestations()
    v1 = signed_record()
    att.offer_record(v1, book, PEERS[0], 0.0)
    att.attesting(v1.record, 1.0)
    att.add(own(v1, PEERS[0]))
    tally = att.expire(ATTEST_TIMEOUT_S + 1)
    assert tally.expired
    sibling = signed_record(model_cid="Qmnext")
    att.add(own(v1, PEERS[1], "Qmother"))
    assert tally.expired  # one other CID: a quorum (2 of 3) could still match
    att.offer_record(sibling, book, PEERS[0], 30.0)
    assert att.open == [tally] and att.bound_to(sibling.record, 30.0) is not None
    att.add(own(v1, PEERS[2], "Qmother"))
    assert tally.status is Status.REJECTED and not tally.expired
    assert att.open == [] and att.bound_to(sibling.record, 30.0) is None


def test_a_record_not_from_the_coordinator_is_taken_only_as_a_proof_confirmed_by_what_came_before_it():
    """A coordinator elected after v1's quorum (its own messages of v1 lost) refused v1 from the
    members that confirmed it, as "not the coordinator", and the run stayed split. A member's fork
    answer sends the attestations first: v1, signed by the earlier coordinator, is then taken as a
    proof (kept open, confirmed, never owed), and only then."""
    book, att = new_book(), Attestations()
    v1 = signed_record(key=KEYS[1])  # the earlier coordinator's
    with pytest.raises(RecordError, match="not the coordinator"):
        att.offer_record(v1, book, PEERS[0], 0.0)  # no attestations came: refused as before
    mine = signed_record(model_cid="Qmnext")  # the new coordinator's own v1, pending here
    att.offer_record(mine, book, PEERS[0], 1.0)
    first, second, _ = attestations_for(v1)
    assert att.add(first) is None and att.add(second) is None  # kept: their record is not here
    proof = att.offer_record(v1, book, PEERS[0], 2.0)
    assert proof is not None and proof.status is Status.CONFIRMED and proof in att.open
    assert att.owed(PEERS[2]) == [mine.record]  # never owed
    book.chain.append(v1, tuple(proof.matching.values()))
    assert att.confirmed_late(proof, 1) is not None and att.tally is None
