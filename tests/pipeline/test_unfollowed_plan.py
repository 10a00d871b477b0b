"""A member that cannot follow a pipelined plan (it did not yet know the coordinator of its term)
says so, and the other members leave the step at once (protocol/_step_aborts.py) instead of waiting
for it at the step summary: a pipelined run of four full peers (``local_peers``).

On main the report changed nothing that ran: the plan's other members waited for the absent member
at the step summary's join for ``STEP_TIMEOUT_S`` (120 s) before the step failed naming it and the
retry went on without it (seen once in a full suite: test_distrusted_liar's member that got the first
plan before it accepted term 2's coordinator). Now each of them leaves the step naming the reporter,
and the coordinator's retry of the step runs without it within seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from p2ptrain.base import short_id
from p2ptrain.protocol import plan_order, RoundBook
from p2ptrain.testing import local_peers
from p2ptrain.wire import RoundPlan

from .test_pipelined_run import publish, small_text, TASK  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

# peers.max 4: the run's members, all from its start (term 0 and the first plan need not wait for more)
FOUR = TASK.replace("max = 8", "max = 4")
assert FOUR != TASK

DEADLINE_S = 200.0
STEP_S = 120.0
# The retry without the member that cannot follow, and a step of it: seconds now; on main the step
# waited 120 s (STEP_TIMEOUT_S) for that member first.
RETRY_S = 40.0
# Member (base58) -> the order of the plan after which it refuses the next plan naming it.
REFUSE: dict[str, tuple[int, ...]] = {}
REFUSED: list[RoundPlan] = []
PLANS: list[RoundPlan] = []  # every plan the watcher took from its coordinator, in order
WATCHER: list[str] = []


def refusing(original):
    def plan_problem(self: RoundBook, plan: RoundPlan, sender: str, election):
        me = election.me
        after = REFUSE.get(me)
        if after is not None and me in plan.members and plan_order(plan) > after \
                and (plan.term, sender) == (election.term, election.coordinator):
            del REFUSE[me]
            REFUSED.append(plan)
            # What a member says when the plan came before it accepted its term's coordinator.
            return f"plan from {short_id(sender)} in term {plan.term}, not from the coordinator of term {plan.term - 1}"
        problem = original(self, plan, sender, election)
        if problem is None and WATCHER and me == WATCHER[0]:
            PLANS.append(plan)
        return problem
    return plan_problem


async def test_a_member_that_cannot_follow_a_plan_costs_the_others_no_step_timeout(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(RoundBook, "plan_problem", refusing(RoundBook.plan_problem))
    for kept in (REFUSE, REFUSED, PLANS, WATCHER):
        kept.clear()
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            _, task_cid = await publish(peers, FOUR)
            runs = await peers.join_all(task_cid)
            watcher = runs[0]
            WATCHER.append(watcher.me)

            def four() -> RoundPlan | None:
                plan = watcher.book.last_plan if watcher.book else None
                return plan if plan is not None and len(plan.members) == 4 and watcher.rounds_done else None

            plan = await peers.wait_until(four, STEP_S, what="a plan of four and a step of it")
            coordinator = watcher.election.coordinator
            absent = next(m for m in plan.members if m not in (coordinator, watcher.me))
            REFUSE[absent] = plan_order(plan)
            refused = await peers.wait_until(lambda: REFUSED[0] if REFUSED else None, STEP_S,
                                             what="the next plan, which the member cannot follow")
            done = watcher.rounds_done
            # The plan's other members leave the step and the retry goes on without it; on main they
            # waited 120 s for it at the step summary first.
            await peers.wait_until(lambda: watcher.rounds_done > done or None, RETRY_S,
                                   what="a step after the member reported it cannot follow the plan")
            retries = [p for p in PLANS if p.round == refused.round and plan_order(p) > plan_order(refused)]
            assert retries and absent not in retries[0].members, (refused, retries)
