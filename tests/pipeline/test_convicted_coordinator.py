"""A coordinator that the drivers convict as a replica of its plan (red team h-attack8): its own
book left it out of nothing (``convicted_failure`` skipped the member itself, and a round's failure
names no culprit at the member it names), so it planned the retry with itself at once, however
often it was convicted, while every other member's book left it out longer each time
(protocol.Convictions). A slow coordinator-replica (or a hostile one that stalls its HOLDINGS)
thus failed a step every few steps for the whole run, never left out. Now its own book convicts it
too: it plans nothing while it is out, and stands for no election (run/_leading.py: may_lead), so it
steps down and a member whose book leaves it out plans the retry without it.

Pure: the books and elections as the runtime drives them (run/_stages.py, run/_spans.py). On main
``book.quarantined`` does not hold the coordinator and the retry 1.5 s later lists it again."""

from __future__ import annotations

import dataclasses

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.collective import Misbehaved
from p2ptrain.protocol import Chain, Election, ElectionConfig, Hold, RoundBook
from p2ptrain.protocol._election import View
from p2ptrain.run._step_summary import convicted_failure
from p2ptrain.wire import RoundFailed, RoundPlan
from tests.protocol._books import CID, elected
from tests.protocol.test_convictions import TASK


def _member(seed: int) -> tuple[Election, RoundBook]:
    election = Election("QmTask", create_new_key_pair(bytes([seed]) * 32), ElectionConfig(heartbeat_s=1.0, timeout_beats=3))
    return election, RoundBook(TASK, "QmTask", Chain("QmTask", CID), 100)


def _decide(book: RoundBook, election: Election, now: float, live: set[str]) -> RoundPlan | Hold:
    return book.decide(now, election, 0, live, can_roll_back=False, span_running=False, rounds_running=False,
                       head_version=0)


def test_a_coordinator_convicted_as_a_replica_leads_no_plan_while_it_is_out():
    coordinator, book = _member(5)
    elected(coordinator)
    me = coordinator.me
    members = [_member(seed) for seed in range(10, 14)]
    live = {me, *(e.me for e, _ in members)}  # five: one to spare over peers.min = 4
    plan = _decide(book, coordinator, 0.0, live)
    assert isinstance(plan, RoundPlan) and plan.stages is not None and set(plan.members) == live
    stages = list(plan.stages)
    mine = plan.members.index(me)
    if stages[mine] == 0:  # the coordinator a replica of stage 1 (it may be either)
        other = stages.index(1)
        stages[mine], stages[other] = 1, 0
        plan = dataclasses.replace(plan, stages=tuple(stages))
    assert book.plan_problem(plan, me, coordinator) is None

    # Step 0's summary convicts the coordinator, on every member alike (run/_stages.py).
    failure = convicted_failure(plan, 0, (me,), {}, "test", convictions=book.convictions, now=5.0, me=me)
    assert isinstance(failure, Misbehaved) and str(failure.peer_id) == me
    book.note_round_failed(5.0)  # run/_spans.py: the failure names this member, so no culprit here
    report = RoundFailed(task_cid="QmTask", term=plan.term, round=plan.round, attempt=plan.attempt, step=plan.step)
    assert book.note_failure_report(5.0, report, me, me, coordinator=True)
    for _, other_book in members:
        convicted_failure(plan, 0, (me,), {}, "test", convictions=other_book.convictions, now=5.0, me="someone else")

    assert me in book.quarantined(7.0)  # on main: not (its own book skipped it)
    assert _decide(book, coordinator, 7.0, live) is Hold.WAIT  # on main: the retry, with itself again
    assert me in book.convictions.out(7.0)  # what the runtime's may_lead reads: it steps down
    coordinator.tick(7.0, View(advertising=frozenset(live)), may_lead=me not in book.convictions.out(7.0))
    assert not coordinator.is_coordinator

    # A member elected meanwhile plans without it (its book convicted it alike), and it is back after 10 s.
    successor, their_book = members[0]
    elected(successor, 7.0)
    without = _decide(their_book, successor, 8.0, live)
    assert isinstance(without, RoundPlan) and set(without.members) == live - {me}
    assert me not in book.quarantined(15.5) and me not in their_book.quarantined(15.5)
