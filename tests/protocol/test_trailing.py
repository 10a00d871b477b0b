"""A member left behind at a run's end (protocol/_trailing.py), pure: when it asks for the run's head,
whose head it tries while no coordinator is known, and which records it takes from it."""

from __future__ import annotations

from dataclasses import replace

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import (HeadAsking, HeadOffers, MAX_CHAIN_BYTES, signing, witness_problem, witnessable,
                               witnessed_chain_limits)
from p2ptrain.protocol._lineage import MAX_ENTRY_BYTES
from p2ptrain.protocol._trailing import ANSWER_WAIT_S, ASK_EVERY_S, ASK_MAX_EVERY_S, QUIET_S, RETRY_SENDER_S
from p2ptrain.testing import attestations_for, proven_chain, proven_record
from p2ptrain.wire import ModelRecord, TaskHead

TASK = "bafkreigh2akiscaildcqabsyg3dfr6chu3fgpregiymsck7e7aqa4s52zy"
INITIAL = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"
MODELS = [f"bafkreie{c * 51}" for c in "abc"]


def _head(version: int) -> TaskHead:
    return TaskHead(task_cid=TASK, term=1, version=version, step=10 * version, round=10 * version - 1,
                    total_steps=30, chain_cid=INITIAL, model_cid=INITIAL, optimizer_cid=INITIAL, members=(),
                    done=version == 3)


def _asks(asking: HeadAsking, times: list[float], *, version: int, known: bool = False) -> list[float]:
    return [t for t in times if asking.due(t, version=version, coordinator_known=known)]


def test_a_member_that_knows_of_a_later_version_asks_as_soon_as_no_coordinator_is_known_then_backs_off() -> None:
    asking = HeadAsking()
    asking.note_later(3)  # the coordinator's record v3 came while it held v1 (a gap)
    # Not while the coordinator is known: its own heads come every 2 s.
    assert _asks(asking, [0.0, 1.0, 5.0], version=1, known=True) == []
    assert _asks(asking, [6.0, 7.0, 8.0, 9.5, 10.0, 11.9, 12.0], version=1) == [6.0, 8.0, 12.0]
    # Heads heard within ANSWER_WAIT_S of a request may answer it; none later.
    assert asking.awaiting(12.0 + ANSWER_WAIT_S) and not asking.awaiting(12.1 + ANSWER_WAIT_S)
    # Holding the later version: nothing more to ask for, until no coordinator was heard for QUIET_S.
    assert _asks(asking, [13.0, 15.0], version=3) == []


def test_a_member_that_knows_of_none_asks_after_quiet_s_with_no_coordinator_then_backs_off() -> None:
    asking = HeadAsking()
    times = [float(t) for t in range(0, 200)]
    asked = _asks(asking, times, version=2)
    assert asked[0] == QUIET_S
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps[:5] == [ASK_EVERY_S, 2 * ASK_EVERY_S, 4 * ASK_EVERY_S, 8 * ASK_EVERY_S, ASK_MAX_EVERY_S]
    assert max(gaps) == ASK_MAX_EVERY_S
    # A coordinator heard again starts it over: QUIET_S of silence first, then every ASK_EVERY_S.
    assert not asking.due(300.0, version=2, coordinator_known=True)
    assert _asks(asking, [301.0, 305.0, 310.0, 311.0, 312.0, 313.0], version=2) == [311.0, 313.0]


def test_only_heads_of_the_runs_members_naming_a_later_version_are_tried_and_a_failed_sender_waits() -> None:
    offers = HeadOffers()
    roster = {"a", "b"}
    # Only answers to this member's own request: a head heard at any other time is not tried.
    assert "did not ask" in (offers.offer(0.0, "a", _head(3), version=2, most=2, roster=roster, asked=False) or "")
    assert offers.take(2) is None
    # A stranger's head of a later version is refused unread, as before (no fetch, no desync).
    problem = offers.offer(0.0, "stranger", _head(10**9), version=2, most=2, roster=roster, asked=True)
    assert problem is not None and "not a member of the run" in problem
    assert offers.take(2) is None
    assert offers.offer(0.0, "a", _head(2), version=2, most=2, roster=roster, asked=True) is not None  # nothing new
    assert offers.offer(0.0, "a", _head(3), version=2, most=2, roster=roster, asked=True) is None
    assert offers.offer(0.0, "b", _head(3), version=2, most=2, roster=roster, asked=True) is None
    assert offers.take(2) == ("b", _head(3))  # the latest version offered first, of equal ones the last
    offers.failed(1.0, "b")
    assert "could not be loaded" in (offers.offer(2.0, "b", _head(3), version=2, most=2, roster=roster, asked=True) or "")
    assert offers.take(2) == ("a", _head(3))  # the other answer is still there to try, without asking again
    assert offers.take(2) is None
    assert offers.offer(1.0 + RETRY_SENDER_S, "b", _head(3), version=2, most=2, roster=roster, asked=True) is None
    offers.clear()  # a coordinator is known again
    assert offers.take(2) is None


def test_a_member_of_the_run_naming_a_version_past_what_this_member_could_witness_is_refused_unread() -> None:
    """Fails on main (HeadOffers kept one offer, the latest version, whatever it named): a hostile
    member of the run answering v10^6 displaced the honest v3, and its chain was fetched and verified
    whole (up to 64 MiB) before the first record this member had not witnessed refused it."""
    offers = HeadOffers()
    roster = {"honest", "hostile"}
    assert offers.offer(0.0, "honest", _head(3), version=0, most=3, roster=roster, asked=True) is None
    problem = offers.offer(0.1, "hostile", _head(10**6), version=0, most=3, roster=roster, asked=True)
    assert problem is not None and "more than 3 record(s) past this member's v0" in problem
    # At most as far as it holds span plans past its chain: a hostile answer of the same version
    # comes first (it was offered last), and the honest one is still there once it failed.
    assert offers.offer(0.2, "hostile", _head(3), version=0, most=3, roster=roster, asked=True) is None
    assert offers.take(0) == ("hostile", _head(3))
    offers.failed(1.0, "hostile")
    assert offers.take(0) == ("honest", _head(3))
    # Holding no plan past its chain it could witness nothing: every head is refused unread.
    assert offers.offer(2.0, "honest", _head(4), version=3, most=0, roster=roster, asked=True) is not None
    # An offer the member has caught up with meanwhile (it loaded another) is not tried.
    assert offers.offer(3.0, "honest", _head(2), version=1, most=3, roster=roster, asked=True) is None
    assert offers.take(2) is None


def test_a_chain_named_with_no_coordinator_known_is_bounded_by_what_this_member_could_witness() -> None:
    assert witnessable([4, 8, 12], 0) == 3 and witnessable([4, 8, 12, 16], 8) == 2 and witnessable([], 0) == 0
    records, size = witnessed_chain_limits(0, 3)
    assert records == 3 and size == 3 * (MAX_ENTRY_BYTES + 1)
    # A long chain held: the prefix lines may be as long as any, within the chain's own bound.
    assert witnessed_chain_limits(10**6, 4) == (10**6 + 4, MAX_CHAIN_BYTES)


def test_records_are_taken_only_from_spans_whose_plan_this_member_accepted_signed_by_their_coordinator() -> None:
    keys = [create_new_key_pair() for _ in range(3)]
    a, b, c = (signing.peer_str(k) for k in keys)
    chain = proven_chain(TASK, INITIAL, MODELS, keys, interval=10)
    # The plans this member accepted (as a non-member it follows them): one per span, by end step.
    plans = {10: (a, b, c), 20: (a, b, c), 30: (a, b, c)}

    def span_members(record: ModelRecord) -> tuple[str, ...] | None:
        return plans.get(record.step)

    added = chain.records[1:]  # held v1; the run ended at v3
    assert witness_problem(added, span_members, {1: a}) is None
    # A term whose coordinator this member did not accept (it won alone, or was away).
    assert "not signed by a coordinator this member accepted" in (witness_problem(added, span_members, {}) or "")
    assert witness_problem(added, span_members, {1: b}) is not None
    # A span it holds no plan of (it was away, or its plans were dropped).
    del plans[30]
    assert "holds no plan of its span" in (witness_problem(added, span_members, {1: a}) or "")
    # A stranger's own chain that extends ours, proven by its own identities (open admission lets it
    # verify): other members than the span's plan, even signed as of the right term.
    plans[30] = (a, b, c)
    sybils = [create_new_key_pair() for _ in range(3)]
    last = chain.records[1].record
    forged = proven_record(replace(last, version=3, parent=last.model_cid, step=30, round=29, model_cid=MODELS[2]),
                           sybils[0], sybils)
    attestations_for(forged.record, sybils)  # it would carry a quorum of its own
    problem = witness_problem([chain.records[1], forged], span_members, {1: a})
    assert problem is not None and "v3 names other members" in problem
