"""A coordinator of a later term that continues a pipelined span goes back to the confirmed head.

Seen in a 4x2 50.7M run over the emulated WAN (docs/benchmarks.md, "A run that stalled"): every
member lost the others for 5 s during the span's fourth step, the coordinator stepped down, and the
member elected next planned at once, while its own step was still running, from one step before
its own (step 1 at step 2). That step then completed on every member (step 3), so nobody could
follow the plan: each stopped advertising the task, the new coordinator stepped down too, and with
no confirmed checkpoint yet there was no head to resync from. Every member stayed unable to lead,
and every term passed without a coordinator. Pure: the round book and election, injected clock."""

from __future__ import annotations

from p2ptrain.protocol import View
from p2ptrain.task import load_task
from p2ptrain.wire import RoundPlan

from .test_plan_stages import _coordinator, PEERS, PIPELINED
from .conftest import LM_TASK


def _takeover(task_toml: str, my_step: int) -> tuple[RoundPlan, RoundPlan, object]:
    """The coordinator's first span in one term, then (itself elected again in a later term, as a
    member elected after the old coordinator stepped down) its plan at ``my_step`` while its own
    round of the old span still runs."""
    task = load_task(task_toml)
    election, book = _coordinator(task)
    live = {election.me, *PEERS[:3]}
    first = book.next_plan(election, 0, live)
    assert first is not None and book.plan_problem(first, election.me, election) is None
    now, term = 100.0, election.term
    election.step_down(now)
    while not election.is_coordinator:
        now += 0.25
        assert now < 200, "no coordinator"
        election.tick(now, View(advertising=frozenset()))
    assert election.term > term
    plan = book.decide(now + 10.0, election, my_step, live, can_roll_back=True, span_running=True,
                       rounds_running=True, head_version=0)
    assert isinstance(plan, RoundPlan), plan
    assert book.plan_problem(plan, election.me, election) is None
    return first, plan, book


def test_a_pipelined_span_taken_over_goes_back_to_the_head_where_every_member_can_follow():
    """On main: a plan from step 1 (its own step 2 less one), which members at step 3 (the step
    that was running completed on them) cannot follow: the run stalled."""
    first, plan, book = _takeover(PIPELINED, my_step=2)
    assert (plan.step, plan.round, plan.version) == (book.head_step, first.round, book.chain.version) == (0, 0, 0)
    assert plan.attempt > first.attempt and plan.term > first.term
    for member_step in (1, 2, 3):  # behind, at, and one past the new coordinator's step
        assert book.rewinds(plan, member_step), member_step


def test_a_ring_span_taken_over_still_steps_back_one_round():
    """Without stages the takeover is as before: one step back from the new coordinator's own."""
    first, plan, _ = _takeover(LM_TASK, my_step=2)
    assert (plan.step, plan.round, plan.attempt) == (1, first.round + 1, first.attempt + 1)
