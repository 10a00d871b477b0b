"""A coordinator that the drivers convict as a replica of its plan (red team h-attack8): its own
book left it out of nothing (``convicted_failure`` skipped the member itself, and a round's failure
names no culprit at the member it names), so it planned the retry with itself at once, however
often it was convicted, while every other member's book left it out longer each time
(protocol.Convictions). A slow coordinator-replica (or a hostile one that stalls its HOLDINGS)
thus failed a step every few steps for the whole run, never left out. Now its own book convicts it
too: it plans nothing while it is out, and stands for no election (run/_leading.py: may_lead), so it
steps down and a member whose book leaves it out plans the retry without it.

The same held for a coordinator that is the driver failing alone (protocol.LoneFailures): the
step's ``Misbehaved`` names it, and run/_spans.py left out no culprit when that was itself.

First pure: the books and elections as the runtime drives them (run/_stages.py, run/_spans.py); on
main ``book.quarantined`` does not hold the coordinator and the retry 1.5 s later lists it again.
Then six full peers whose coordinator, once planned, stalls as a stage-1 replica or fails every step
as a driver (whichever it is in the plan): on main no plan without it ever came."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.collective import Misbehaved
from p2ptrain.protocol import Chain, Election, ElectionConfig, Hold, RoundBook
from p2ptrain.protocol._election import View
from p2ptrain.run._step_summary import convicted_failure
from p2ptrain.wire import RoundFailed, RoundPlan
from p2ptrain.testing import local_peers
import p2ptrain.run._stages as stages_module
from tests.protocol._books import CID, elected
from tests.protocol.test_convictions import TASK

from . import test_failing_driver as failing, test_stalling_replica as stalling
from .conftest import planned_six
from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)


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


@pytest.fixture
def blameworthy(monkeypatch):
    """Each member's driver and replica, honest until the test names its peer (test_failing_driver's
    HOSTILE: every step it drives fails; test_stalling_replica's STALLERS: each HOLDINGS 4.5 s late)."""
    monkeypatch.setattr(stages_module, "Driver", failing.MaybeFailing)
    monkeypatch.setattr(stages_module, "StageReplica", stalling.MaybeStalling)
    failing.HOSTILE.clear()
    stalling.STALLERS.clear()
    yield
    failing.HOSTILE.clear()
    stalling.STALLERS.clear()


@pytest.mark.usefixtures("quick_timers_slow_joins", "blameworthy")  # tests/conftest.py: idle waits shortened
@pytest.mark.timeout(300)  # the suite's bound, declared (as test_stalling_replica's)
async def test_a_coordinator_a_steps_summary_blames_steps_down_and_the_run_goes_on_without_it(tmp_path: Path) -> None:
    with trio.fail_after(280):
        async with local_peers(6, tmp_path) as peers:  # peers.min 4: the run can go on without one
            _, task_cid = await publish(peers, stalling.TASK, shards=3)
            run = (await peers.join_all(task_cid))[0]
            await peers.wait_until(lambda: planned_six(run), 150, what="a plan of six, three replicas of stage 1")
            plan, blamed = run.book.last_plan, run.election.coordinator
            assert plan is not None and plan.stages is not None and blamed in plan.members
            driver = plan.stages[plan.members.index(blamed)] == 0
            (failing.HOSTILE if driver else stalling.STALLERS).add(blamed)
            watcher = next(p for p in peers if p.node.peer_id.to_base58() != blamed).tasks.runs[task_cid].shared

            def plan_without_it() -> RoundPlan | None:
                last = watcher.book.last_plan if watcher.book else None
                return last if last is not None and blamed not in last.members else None

            without = await peers.wait_until(plan_without_it, 200, what=f"a plan without the coordinator, blamed as a "
                                             f"{'driver failing alone' if driver else 'stalling replica'} "
                                             f"(on main: it planned the retry with itself, every time)")
            assert len(without.members) == 5 and watcher.election.coordinator != blamed
            done = watcher.rounds_done
            await peers.wait_until(lambda: watcher.rounds_done > done or None, 60, what="a step without it")
