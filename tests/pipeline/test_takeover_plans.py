"""A coordinator of a later term that continues a pipelined span goes back to the confirmed head.

Seen in a 4x2 50.7M run over the emulated WAN (docs/benchmarks.md, "A run that stalled"): every
member lost the others for 5 s during the span's fourth step, the coordinator stepped down, and the
member elected next planned at once, while its own step was still running, from one step before
its own (step 1 at step 2). That step then completed on every member (step 3), so nobody could
follow the plan: each stopped advertising the task, the new coordinator stepped down too, and with
no confirmed checkpoint yet there was no head to resync from. Every member stayed unable to lead,
and every term passed without a coordinator. Pure: the round book and election, injected clock.

A ring (data-parallel) takeover raced the same way: planned from one step before the new
coordinator's own while its round still ran, it was two steps behind every member once that round
completed, and each went back to the run's root (run/_resync.py, load_root). Two stalls at v0
followed: a coordinator back at the root still saw that plan past its step and resynced instead of
planning (to the root it held, over and over), and a coordinator past the root retried its plan
from step k, which members at the root could not follow, leaving them out until too few were left."""

from __future__ import annotations

from dataclasses import replace

from p2ptrain.protocol import Election, Hold, RoundBook, View
from p2ptrain.task import load_task
from p2ptrain.wire import RoundFailed, RoundPlan

from .test_plan_stages import _coordinator, PEERS, PIPELINED
from .conftest import LM_TASK


LIVE = 3  # the other members, PEERS[:LIVE]


def _elected_again(election: Election, now: float) -> float:
    """``election``'s member steps down at ``now`` and is elected in a later term; the time then."""
    term, until = election.term, now + 100.0
    election.step_down(now)
    while not election.is_coordinator:
        now += 0.25
        assert now < until, "no coordinator"
        election.tick(now, View(advertising=frozenset()))
    assert election.term > term
    return now


def _takeover(task_toml: str, my_step: int, running: bool = True) -> tuple[RoundPlan, RoundPlan, RoundBook, Election]:
    """The coordinator's first span in one term, then (itself elected again in a later term, as a
    member elected after the old coordinator stepped down) its plan at ``my_step``: while its own
    round of the old span still runs (``running``), or after that round ended."""
    task = load_task(task_toml)
    election, book = _coordinator(task)
    live = {election.me, *PEERS[:LIVE]}
    first = book.next_plan(election, 0, live)
    assert first is not None and book.plan_problem(first, election.me, election) is None
    now = _elected_again(election, 100.0)
    plan = book.decide(now + 10.0, election, my_step, live, can_roll_back=True, span_running=running,
                       rounds_running=running, head_version=0)
    assert isinstance(plan, RoundPlan), plan
    assert book.plan_problem(plan, election.me, election) is None
    return first, plan, book, election


def _can_follow(plan: RoundPlan, member_step: int) -> bool:
    """Whether a ring member at ``member_step`` can run ``plan`` without a checkpoint: at its step,
    or one step before it (Trainer.can_align: the trainer keeps the state before its last step)."""
    return plan.step in (member_step, member_step - 1)


def test_a_pipelined_span_taken_over_goes_back_to_the_head_where_every_member_can_follow():
    """On main: a plan from step 1 (its own step 2 less one), which members at step 3 (the step
    that was running completed on them) cannot follow: the run stalled."""
    first, plan, book, _ = _takeover(PIPELINED, my_step=2)
    assert (plan.step, plan.round, plan.version) == (book.head_step, first.round, book.chain.version) == (0, 0, 0)
    assert plan.attempt > first.attempt and plan.term > first.term
    for member_step in (1, 2, 3):  # behind, at, and one past the new coordinator's step
        assert book.rewinds(plan, member_step), member_step


def test_a_pipelined_span_taken_over_at_its_end_without_a_record_goes_back_to_the_head():
    """A pipelined span's stages end their last step apart: each stage sums over its own replicas,
    so a stage whose sum did not include the stopped coordinator applied the span's last step (its
    members at the span's end) while the coordinator's stage failed it (one step before). The old
    coordinator never records that checkpoint; the new one, elected at the span's end, abandons it
    (run/_leading.py) and plans. On main it planned the next span from the span's end, past the
    head: the members one step before it resynced to the head and could not follow, plan after
    plan, and the run stalled (tests/pipeline/test_local_sgd_pipeline_takeover.py, ``sum``). Now it
    goes back to the head, which every member can follow."""
    first, plan, book, _ = _takeover_at_end(PIPELINED)
    end = first.step + first.rounds
    assert (plan.step, plan.round, plan.version) == (book.head_step, first.round, book.chain.version) == (0, 0, 0)
    assert plan.term > first.term  # (term, attempt, round) order: it supersedes the old span's plans
    for member_step in (end - 1, end):  # the stage that failed the last step, and the one that applied it
        assert book.rewinds(plan, member_step), member_step
    # A ring run's members all applied the span's last step alike: its next span starts there, as before.
    ring_first, ring, _, _ = _takeover_at_end(LM_TASK)
    assert (ring.step, ring.round) == (ring_first.step + ring_first.rounds, ring_first.round + ring_first.rounds)


def _takeover_at_end(task_toml: str) -> tuple[RoundPlan, RoundPlan, RoundBook, Election]:
    """As :func:`_takeover`, elected again at the end of the first span, whose checkpoint it abandons."""
    task = load_task(task_toml)
    election, book = _coordinator(task)
    live = {election.me, *PEERS[:LIVE]}
    first = book.next_plan(election, 0, live)
    assert first is not None and book.plan_problem(first, election.me, election) is None
    end = first.step + first.rounds
    now = _elected_again(election, 100.0)
    assert book.abandon_unrecorded(end) == end
    plan = book.decide(now + 10.0, election, end, live, can_roll_back=True, span_running=False,
                       rounds_running=False, head_version=0)
    assert isinstance(plan, RoundPlan), plan
    assert book.plan_problem(plan, election.me, election) is None
    return first, plan, book, election


def test_a_ring_span_taken_over_after_its_round_ended_still_steps_back_one_round():
    """Without stages, and with no round of the old span running here, the takeover is as before:
    one step back from the new coordinator's own (it may have applied a round others did not)."""
    first, plan, _, _ = _takeover(LM_TASK, my_step=2, running=False)
    assert (plan.step, plan.round, plan.attempt) == (1, first.round + 1, first.attempt + 1)
    assert all(_can_follow(plan, s) for s in (1, 2))


def test_a_ring_takeover_planned_while_its_round_runs_does_not_step_back():
    """On main: planned at step 2 while its round from step 2 still ran, from step 1. That round
    then completed on every member (step 3), and no member could go back two steps: each went back
    to the root at v0 (or to the head), and the run stalled (the tests below)."""
    first, plan, _, _ = _takeover(LM_TASK, my_step=2)
    assert (plan.step, plan.round, plan.attempt) == (2, first.round + 2, first.attempt + 1)
    for member_step in (2, 3):  # the round under way had not completed, or completed, on the member
        assert _can_follow(plan, member_step), member_step


def test_a_coordinator_back_at_the_root_plans_from_it_past_a_plan_nobody_followed():
    """On main: every member went back to the root (step 0, v0) after a takeover plan from step 1
    that none could follow; each one elected saw that plan past its step and resynced instead of
    planning (Hold.BEHIND), to the root it already held, then stood again: no plan, ever. Now it
    steps down for that plan once (a member that follows it may lead), and plans the next time."""
    first, left, book, election = _takeover(LM_TASK, my_step=2, running=False)
    assert left.step == 1 and book.observed is left and book.chain.version == 0
    live = {election.me, *PEERS[:LIVE]}
    now = 300.0
    for _ in range(2):  # back at the root (Resync.load_root: the book resynced, observed kept), elected
        book = book.resynced(book.chain)
        now = _elected_again(election, now) + 10.0
        plan = book.decide(now, election, 0, live, can_roll_back=False, span_running=False,
                           rounds_running=False, head_version=0)
        if plan is not Hold.BEHIND:
            break
        book.note_behind()  # run/_leading.py, then the resync loop goes back to the root
    assert isinstance(plan, RoundPlan), plan
    assert (plan.step, plan.round, plan.version, plan.base_cid) == (0, first.round, 0, book.chain.head_cid)
    assert plan.term > left.term and set(plan.members) == live
    assert book.plan_problem(plan, election.me, election) is None
    # Where a resync can still mend it, a coordinator behind the run resyncs as before: a head
    # past its chain, or a plan seen past its step while it is not at the root.
    assert book.decide(now, election, 0, live, can_roll_back=False, span_running=False,
                       rounds_running=False, head_version=1) is Hold.BEHIND
    behind = book.resynced(book.chain)
    behind.observed = replace(left, step=3)  # a newer plan seen since: step down for it once more
    assert behind.decide(now, election, 0, live, can_roll_back=False, span_running=False,
                         rounds_running=False, head_version=0) is Hold.BEHIND
    assert behind.decide(now, election, 1, live, can_roll_back=False, span_running=False,
                         rounds_running=False, head_version=0) is Hold.BEHIND


def test_members_back_at_the_root_take_the_retry_back_there():
    """On main: a coordinator at step 2 at v0 retried its takeover from step 1 while two members,
    back at the root, reported they could not follow it (at step 0). It left them out of plans, and
    the two left (peers.min is 4) could not plan: the run waited, and the same retry failed on them
    again after their quarantine. Now it goes back to the root too (Hold.BEHIND: the resync loop's
    load_root), and from there plans step 0 with them."""
    _, left, book, election = _takeover(LM_TASK, my_step=2, running=False)
    live = {election.me, *PEERS[:LIVE]}
    now = 200.0
    at_root = PEERS[:2]
    for peer in at_root:
        report = RoundFailed(task_cid=left.task_cid, term=left.term, round=left.round, attempt=left.attempt,
                             step=0, reason="cannot follow this plan: at step 0, the plan starts at step 1")
        assert book.note_failure_report(now, report, peer, election.me, coordinator=True)
    assert book.quarantined(now) == frozenset()  # they can follow a plan from the root: not culprits
    assert book.decide(now + 10.0, election, 2, live, can_roll_back=True, span_running=False,
                       rounds_running=False, head_version=0) is Hold.BEHIND
    # Back at the root itself (run/_leading.py notes it, the resync loop's load_root), in the
    # next term it plans from there, with them.
    book.note_behind()
    book = book.resynced(book.chain)
    now = _elected_again(election, now + 20.0) + 10.0
    plan = book.decide(now, election, 0, live, can_roll_back=False, span_running=False,
                       rounds_running=False, head_version=0)
    assert isinstance(plan, RoundPlan), plan
    assert plan.step == 0 and set(at_root) <= set(plan.members)
    assert book.plan_problem(plan, election.me, election) is None


def test_a_member_that_goes_back_to_the_root_twice_is_a_culprit_the_second_time():
    """A member goes back to the root once at v0 and then follows the plan from it. One that reports
    standing at the root again is failing rounds on purpose: without a limit it could send every
    coordinator back to the root after each of its rounds and hold the run at v0, never left out."""
    _, left, book, election = _takeover(LM_TASK, my_step=2, running=False)
    hostile, now = PEERS[0], 200.0
    report = RoundFailed(task_cid=left.task_cid, term=left.term, round=left.round, attempt=left.attempt,
                         step=0, reason="cannot follow this plan: at step 0, the plan starts at step 1")
    assert book.note_failure_report(now, report, hostile, election.me, coordinator=True)
    assert book.root_reported and book.quarantined(now) == frozenset()
    book = book.resynced(book.chain)  # the coordinator went back to the root (its resync)
    plan = book.next_plan(election, 0, {election.me, *PEERS[:LIVE]})
    assert plan is not None and hostile in plan.members and plan.rounds > 2
    assert book.plan_problem(plan, election.me, election) is None
    # It follows the plan from the root for two rounds, then fails the third and says it is at step 0.
    again = replace(report, term=plan.term, round=plan.round + 2, attempt=plan.attempt)
    assert book.note_failure_report(now + 30.0, again, hostile, election.me, coordinator=True)
    assert not book.root_reported
    assert hostile in book.quarantined(now + 30.0)
