"""The participation ledger (protocol/_participation.py), driven with an injected clock: a peer that
only advertises a task stops counting after its chance; one that votes or trains keeps counting; a
struck peer gets another chance later, and any evidence brings it back at once."""

from __future__ import annotations

from p2ptrain.protocol import Participation
from p2ptrain.protocol._plans import joiner_room, plan_members
from p2ptrain.protocol._records import quorum

HONEST, OTHER, SYBIL, LATE = "honest", "other", "sybil", "late"


def test_newcomers_count_until_they_miss_a_vote_they_were_asked_for() -> None:
    ledger = Participation(grace_s=30.0, answer_s=3.0)
    assert ledger.counted(0.0, {HONEST, OTHER, SYBIL}) == {HONEST, OTHER, SYBIL}
    ledger.note_asked(1.0, HONEST)  # HONEST stands: every peer without a coordinator votes now
    ledger.note_vote(1.1, OTHER)
    assert ledger.counted(3.9, {HONEST, OTHER, SYBIL}) == {HONEST, OTHER, SYBIL}  # not yet answer_s
    # The candidate is not blamed for its own request; a peer first seen after it was not asked.
    assert ledger.counted(4.0, {HONEST, OTHER, SYBIL, LATE}) == {HONEST, OTHER, LATE}
    assert ledger.struck(4.0) == {SYBIL}


def test_a_planned_peer_that_misses_its_round_is_struck_with_a_growing_backoff_and_tried_again() -> None:
    ledger = Participation(grace_s=30.0, answer_s=3.0, max_backoff_s=200.0)
    peers = {HONEST, SYBIL}
    ledger.note_missed(10.0, SYBIL)
    assert ledger.counted(10.0, peers) == {HONEST}
    ledger.note_missed(20.0, SYBIL)  # the same failure seen again: one strike
    assert ledger.counted(69.9, peers) == {HONEST}
    assert ledger.counted(70.0, peers) == peers  # its next chance (60 s after the first strike)
    ledger.note_missed(80.0, SYBIL)
    assert ledger.counted(199.9, peers) == {HONEST}  # 120 s
    assert ledger.counted(200.0, peers) == peers
    ledger.note_missed(200.0, SYBIL)
    assert ledger.counted(399.9, peers) == {HONEST}  # 240 s, capped at 200
    assert ledger.counted(400.0, peers) == peers


def test_a_member_that_trains_or_votes_is_not_struck_for_one_failed_round_and_evidence_clears_strikes() -> None:
    ledger = Participation(grace_s=30.0, answer_s=3.0)
    peers = {HONEST, OTHER, SYBIL}
    ledger.note_round(5.0, (HONEST, SYBIL))
    ledger.note_missed(20.0, HONEST)  # a round failed on it 15 s after it trained with us
    ledger.note_vote(21.0, OTHER)
    ledger.note_missed(22.0, OTHER)  # its first round, blamed on it for a neighbour's absence
    assert ledger.counted(22.0, peers) == peers
    ledger.note_round(35.0, (HONEST, OTHER))
    ledger.note_missed(40.0, SYBIL)  # trained once, rounds ago: that does not keep it counted
    assert ledger.counted(40.0, peers) == {HONEST, OTHER}
    ledger.note_vote(41.0, SYBIL)  # a slow but honest peer that votes is back at once
    assert ledger.counted(41.0, peers) == peers
    ledger.note_round(300.0, (HONEST, OTHER))  # rounds of minutes (local SGD): the last one still counts
    ledger.note_missed(500.0, OTHER)
    assert OTHER in ledger.counted(500.0, peers)


def test_the_ledger_stays_bounded_and_forgets_peers_that_stopped_advertising() -> None:
    ledger = Participation()
    for i in range(5000):
        ledger.counted(float(i), {f"p{i}"})
    assert len(ledger._peers) <= 4096
    ledger.counted(10_000.0, set())
    assert not ledger._peers


def test_a_span_admits_fewer_joiners_than_its_kept_members_so_a_retry_without_them_keeps_a_quorum(digits_task) -> None:
    task = digits_task("QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o", **{"peers.min": "1", "peers.max": "16"})
    previous = ("a", "b", "c")
    live = {*previous, *(f"s{i}" for i in range(8))}
    members = plan_members(task, "cid", previous, live, admit_joiners=True)
    assert members is not None and len(members) == 3 + joiner_room(3) == 5
    assert len(previous) >= quorum(len(members))
    assert joiner_room(1) == 1  # a lone member may still grow
    first = plan_members(task, "cid", (), live, admit_joiners=True)
    assert first is not None and len(first) == len(live)  # the first span: no previous members to keep


def test_a_run_short_of_its_minimum_tries_the_struck_peers_whose_backoff_ends_first() -> None:
    ledger = Participation(grace_s=30.0, answer_s=3.0)
    peers = {HONEST, LATE, SYBIL}
    ledger.note_missed(10.0, LATE)  # a newcomer whose first round failed (a slow start)
    ledger.note_missed(12.0, SYBIL)
    assert ledger.counted(20.0, peers) == {HONEST}
    # The run needs two others (peers.min 3): waiting out 60 s of backoff gains nothing.
    assert ledger.counted(20.0, peers, needed=2) == {HONEST, LATE}  # only the shortfall, soonest first
    assert ledger.counted(20.0, peers, needed=3) == peers
    assert ledger.counted(20.0, peers, needed=1) == {HONEST}  # enough count: the struck stay out
    ledger.note_missed(25.0, LATE)  # failing again while struck: no second strike, no longer backoff
    assert ledger.counted(70.0, peers) == {HONEST, LATE}
    ledger.note_round(71.0, (HONEST, LATE))
    assert ledger.struck(71.0) == {SYBIL}

    # One that took part before (struck later than the newcomers) is tried before them.
    ledger = Participation(grace_s=30.0, answer_s=3.0)
    ledger.note_round(1.0, (HONEST, OTHER))
    ledger.note_round(2.0, (HONEST,))
    ledger.note_missed(10.0, LATE)
    ledger.note_missed(40.0, OTHER)
    assert ledger.struck(40.0) == {LATE, OTHER}
    assert ledger.counted(40.0, {HONEST, LATE, OTHER}, needed=2) == {HONEST, OTHER}
