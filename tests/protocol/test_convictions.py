"""A replica convicted again and again is left out longer each time (protocol.Convictions), even
where that leaves a pipelined run short of ``peers.min``: the coordinator waits rather than take it
back. Before, a conviction left it out for the 10 s quarantine only: in a run of exactly
``peers.min`` members the coordinator waited those 10 s, planned the retry with the replica again,
and a replica that stalls every step was convicted three steps later, a failed step every ~25 s for
the whole run (the in-process run: tests/pipeline/test_stalling_replica.py). The decision tests fail
on main (no Convictions; the retry 10 s after the second conviction names the replica again)."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Chain, Convictions, Election, ElectionConfig, Hold, RoundBook, signing
from p2ptrain.task import load_task
from p2ptrain.wire import RoundFailed, RoundPlan
from tests.protocol._books import CID, elected, lm, task_text

TASK = load_task(task_text(lm(2), min_peers=4, pipeline="stages = 2\n") + "")


def test_each_conviction_in_a_row_doubles_the_time_out_up_to_a_cap():
    convictions = Convictions()
    now, outs = 0.0, []
    for _ in range(7):
        seconds = convictions.convict("r", now)
        outs.append(seconds)
        assert convictions.out(now) == {"r": now + seconds} and convictions.length("r") == seconds
        now += seconds
        assert convictions.out(now) == {}  # back when its time out ends
        now += 30.0  # back for a few steps, convicted again
    assert outs == [10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 320.0]
    assert convictions.length("never convicted") == 0.0


def test_a_conviction_long_after_the_last_one_counts_as_a_first_one():
    convictions = Convictions()
    assert convictions.convict("r", 0.0) == 10.0
    assert convictions.convict("r", 100.0) == 20.0  # within 600 s of the end of the last one (10 s)
    assert convictions.convict("other", 100.0) == 10.0  # each replica its own record
    assert convictions.convict("r", 120.0 + 600.0 + 1.0) == 10.0  # forgiven: an honest one under a passing load


def _setup() -> tuple[Election, RoundBook, list[str]]:
    election = Election("QmTask", create_new_key_pair(b"\x05" * 32), ElectionConfig(heartbeat_s=1.0, timeout_beats=3))
    elected(election)
    others = [signing.peer_str(create_new_key_pair(bytes([i]) * 32)) for i in range(10, 14)]
    return election, RoundBook(TASK, "QmTask", Chain("QmTask", CID), 100), others


def _decide(book: RoundBook, election: Election, now: float, live: set[str]) -> RoundPlan | Hold:
    return book.decide(now, election, 0, live, can_roll_back=False, span_running=False, rounds_running=False,
                       head_version=0)


def _convict(book: RoundBook, election: Election, plan: RoundPlan, replica: str, now: float) -> None:
    """``replica`` convicted in ``plan``'s first round, as every member takes it (run/_stages.py:
    the book's convictions; run/_spans.py: the round's culprit; the coordinator's own report)."""
    book.convictions.convict(replica, now)
    book.note_round_failed(now, replica)
    report = RoundFailed(task_cid="QmTask", term=plan.term, round=plan.round, attempt=plan.attempt, step=plan.step)
    assert book.note_failure_report(now, report, election.me, election.me, coordinator=True)


def test_a_run_of_exactly_peers_min_waits_out_a_replica_convicted_again_rather_than_retry_with_it():
    election, book, others = _setup()
    live = {election.me, *others[:3]}  # exactly peers.min = 4
    plan = _decide(book, election, 0.0, live)
    assert isinstance(plan, RoundPlan) and set(plan.members) == live and plan.stages is not None
    staller = next(m for m, s in zip(plan.members, plan.stages, strict=True) if s == 1 and m != election.me)
    assert book.plan_problem(plan, election.me, election) is None

    _convict(book, election, plan, staller, 5.0)  # the first conviction: the usual quarantine, 10 s
    assert _decide(book, election, 14.0, live) is Hold.WAIT  # three members: short of peers.min, no retry
    retry = _decide(book, election, 15.5, live)
    assert isinstance(retry, RoundPlan) and staller in retry.members and retry.attempt == 1
    assert book.plan_problem(retry, election.me, election) is None

    _convict(book, election, retry, staller, 30.0)  # back, stalled again: out for 20 s
    assert _decide(book, election, 41.0, live) is Hold.WAIT  # on main: the retry with the staller again
    assert book.quarantined(41.0) == {staller}
    joined = others[3]  # a peer joins meanwhile (at the head, step 0, where joiners come in): it goes on without the staller
    without = _decide(book, election, 41.0, live | {joined})
    assert isinstance(without, RoundPlan) and set(without.members) == live - {staller} | {joined}
    back = _decide(book, election, 50.5, live)  # its time out over and nobody else: it is planned again
    assert isinstance(back, RoundPlan) and staller in back.members


def test_convictions_survive_a_resync():
    _, book, others = _setup()
    book.convictions.convict(others[0], 0.0)
    assert book.resynced(Chain("QmTask", CID)).quarantined(5.0) == {others[0]}
