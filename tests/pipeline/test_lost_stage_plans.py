"""A stage left with no replica (issue 31): the coordinator's next plan moves a member from the most
replicated stage there and takes the whole run back to its last confirmed checkpoint (the seed-built
model before any), with a new attempt, so that it comes after the plans whose steps it redoes.
Pure: the round book driven with an injected clock, no network."""

from __future__ import annotations

from p2ptrain.protocol import (assign, Hold, orphaned_stages, plan_order, stage_moves, stage_rings)
from p2ptrain.protocol._plans import rule_problem
from p2ptrain.protocol._round_book import RETRY_BACKOFF_S
from p2ptrain.task import load_task, stage_parameters
from p2ptrain.wire import RoundFailed, RoundPlan

from .conftest import CID, LM_TASK
from .test_plan_stages import _coordinator, PEERS

# Four pieces in three stages, at least three members: the middle stage (two blocks) is the costliest.
THREE = LM_TASK.replace("min = 4", "min = 3").replace("total_steps = 10", "total_steps = 20\ncheckpoint_interval = 4") \
    + "[pipeline]\nstages = 3\n"


def _first_span(book, election, live):
    plan = book.next_plan(election, 0, live)
    assert plan is not None and book.plan_problem(plan, election.me, election) is None
    return plan


def _failed(book, plan, at_round: int, culprit: str, now: float) -> None:
    """Round ``at_round`` of ``plan`` failed at ``now``, naming ``culprit`` (gone)."""
    book.note_round_failed(now, culprit, gone=True)
    report = RoundFailed(task_cid="QmTask", term=plan.term, round=at_round, attempt=plan.attempt,
                         step=plan.step + at_round - plan.round, reason="a peer is gone")
    assert book.report_failure(report, plan.members[0])


def _decide(book, election, now, my_step, advertising):
    return book.decide(now, election, my_step, advertising, can_roll_back=True, span_running=False,
                       rounds_running=False, head_version=0)


def test_a_stage_whose_replicas_all_left_is_orphaned_and_the_moves_are_named():
    before = RoundPlan(task_cid=CID, term=1, round=4, attempt=0, step=4, rounds=4, members=("a", "b", "c", "d"),
                       base_cid=CID, version=1, stages=(0, 1, 1, 2))
    assert orphaned_stages(before, ("a", "b", "c", "d")) == ()
    assert orphaned_stages(before, ("a", "b", "d")) == ()  # stage 1 keeps b
    assert orphaned_stages(before, ("a", "b", "c")) == (2,)
    assert orphaned_stages(before, ("b",)) == (0, 2)
    assert orphaned_stages(None, ("a",)) == () and orphaned_stages(RoundPlan(**{**before.__dict__, "stages": None}), ()) == ()
    after = RoundPlan(**{**before.__dict__, "attempt": 1, "members": ("a", "b", "c"), "stages": (0, 1, 2)})
    assert stage_moves(before, after) == (("c", 1, 2),)
    assert stage_moves(before, before) == ()


def test_plans_are_ordered_by_term_then_attempt_then_round():
    base = dict(task_cid=CID, step=0, rounds=4, members=("a",), base_cid=CID, version=0)
    span, nxt = RoundPlan(term=3, round=4, attempt=1, **base), RoundPlan(term=3, round=8, attempt=1, **base)
    retry, rewind = RoundPlan(term=3, round=9, attempt=2, **base), RoundPlan(term=3, round=4, attempt=3, **base)
    later = RoundPlan(term=4, round=0, attempt=0, **base)
    assert sorted([later, rewind, retry, nxt, span], key=plan_order) == [span, nxt, retry, rewind, later]


def test_the_last_replica_of_a_stage_gone_moves_a_member_there_and_goes_back_to_the_checkpoint():
    task = load_task(THREE)
    costs = stage_parameters(task)
    election, book = _coordinator(task)
    live = {election.me, *PEERS[:3]}
    first = _first_span(book, election, live)
    rings = stage_rings(first)
    assert sorted(map(len, rings)) == [1, 1, 2]
    donor = next(s for s, ring in enumerate(rings) if len(ring) == 2)
    lone = [(s, ring[0]) for s, ring in enumerate(rings) if len(ring) == 1 and ring[0] != election.me]
    orphan, victim = lone[0]

    # Round 2 of the span (step 2: two steps past the initial model) fails without the victim.
    _failed(book, first, first.round + 2, victim, now=100.0)
    advertising = live - {victim}
    assert _decide(book, election, 100.0 + RETRY_BACKOFF_S / 2, 2, advertising) is Hold.WAIT  # the retry backs off
    plan = _decide(book, election, 100.0 + RETRY_BACKOFF_S, 2, advertising)
    assert isinstance(plan, RoundPlan)
    # Back to the seed-built initial model (no checkpoint is confirmed yet): step 0, round 0, a new attempt.
    assert (plan.step, plan.round, plan.version, plan.base_cid) == (0, 0, 0, CID)
    assert plan.attempt == first.attempt + 1 and plan_order(plan) > plan_order(first)
    assert plan.rounds == 4 and set(plan.members) == advertising
    # The last of the most replicated stage (in sort order) moved there; the others stayed.
    moved = max(rings[donor])
    assert stage_moves(first, plan) == ((moved, donor, orphan),)
    assert plan.stages == tuple(assign(plan.members, costs, dict(zip(first.members, first.stages)))[m]
                                for m in plan.members)
    assert [len(r) for r in stage_rings(plan)] == [1, 1, 1]
    # The members hold it to the rules (the assignment from the plan before), and each goes back.
    assert rule_problem(task, book.total_steps, plan, first) is None
    assert book.rewinds(plan, 2) and book.rewinds(plan, 1) and not book.rewinds(plan, 0)
    assert book.plan_problem(plan, election.me, election) is None and book.last_plan is plan


def test_a_stage_that_keeps_a_replica_is_retried_where_it_failed():
    task = load_task(THREE)
    election, book = _coordinator(task)
    live = {election.me, *PEERS[:3]}
    first = _first_span(book, election, live)
    rings = stage_rings(first)
    pair = next(ring for ring in rings if len(ring) == 2)
    victim = next(m for m in pair if m != election.me)
    _failed(book, first, first.round + 2, victim, now=100.0)
    plan = _decide(book, election, 100.0 + RETRY_BACKOFF_S, 2, live - {victim})
    assert isinstance(plan, RoundPlan)
    assert (plan.step, plan.round, plan.attempt) == (2, first.round + 2, first.attempt + 1)
    assert stage_moves(first, plan) == () and not book.rewinds(plan, 2)


def test_with_no_member_to_spare_a_joiner_takes_the_stage_at_the_checkpoint():
    task = load_task(THREE)
    election, book = _coordinator(task)
    live = {election.me, *PEERS[:2]}
    first = _first_span(book, election, live)
    assert sorted(first.stages) == [0, 1, 2]
    victim = next(m for m in first.members if m != election.me)
    orphan = first.stages[first.members.index(victim)]
    _failed(book, first, first.round + 1, victim, now=100.0)
    # Two members cannot serve three stages: no plan, until a peer that holds the checkpoint joins.
    assert _decide(book, election, 100.0 + RETRY_BACKOFF_S, 1, live - {victim}) is Hold.WAIT
    joiner = PEERS[5]
    plan = _decide(book, election, 100.0 + RETRY_BACKOFF_S, 1, (live - {victim}) | {joiner})
    assert isinstance(plan, RoundPlan) and (plan.step, plan.round) == (0, 0)
    assert plan.stages[plan.members.index(joiner)] == orphan and stage_moves(first, plan) == ()
    assert rule_problem(task, book.total_steps, plan, first) is None
