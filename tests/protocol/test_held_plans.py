"""The rules of the plans a member holds until its election accepts their sender
(protocol/_held_plans.py): which are held, when one is handed back, when one is given up, the bound.
The runtime's race it closes: tests/runtime/test_late_join_plan.py."""

from __future__ import annotations

from p2ptrain.protocol import HeldPlans
from p2ptrain.protocol._held_plans import MAX_HELD_PLANS
from p2ptrain.wire import RoundPlan

ME, LEADER, OTHER = "QmMe", "QmLeader", "QmOther"
HOLD_S = 2.0


def _plan(term: int = 1, round: int = 0, attempt: int = 0) -> RoundPlan:
    return RoundPlan(task_cid="QmTask", term=term, round=round, attempt=attempt, step=round, rounds=4,
                     members=(LEADER, ME, OTHER), base_cid="QmBase", version=0)


def test_only_a_plan_of_a_term_whose_coordinator_is_unknown_may_wait() -> None:
    assert HeldPlans.holds(_plan(term=1), term=1, coordinator=None)  # elected, its beat not heard yet
    assert HeldPlans.holds(_plan(term=2), term=1, coordinator=None)  # a term we have not reached
    assert HeldPlans.holds(_plan(term=2), term=1, coordinator=OTHER)  # a later term than our coordinator's
    assert not HeldPlans.holds(_plan(term=1), term=1, coordinator=OTHER)  # this term has another coordinator
    assert not HeldPlans.holds(_plan(term=0), term=1, coordinator=None)  # a term we are past


def test_a_held_plan_is_handed_back_only_once_the_election_accepts_its_sender_for_its_term() -> None:
    held = HeldPlans(HOLD_S)
    plan = _plan(term=1)
    assert held.hold(0.0, LEADER, plan) == []
    assert held.settle(0.5, term=1, coordinator=None) == ([], [])  # still no coordinator: kept
    assert held.settle(0.6, term=0, coordinator=LEADER) == ([], [])  # its sender leads an earlier term: kept
    ready, given_up = held.settle(1.0, term=1, coordinator=LEADER)
    assert [(h.sender, h.plan) for h in ready] == [(LEADER, plan)] and given_up == []
    assert len(held) == 0 and held.settle(1.1, term=1, coordinator=LEADER) == ([], [])


def test_a_held_plan_is_given_up_when_its_hold_ends_or_it_can_no_longer_be_followed() -> None:
    held = HeldPlans(HOLD_S)
    held.hold(0.0, LEADER, _plan(term=1))
    assert held.settle(HOLD_S - 0.01, term=1, coordinator=None) == ([], [])
    ready, given_up = held.settle(HOLD_S, term=1, coordinator=None)
    assert ready == [] and [h.sender for h in given_up] == [LEADER]

    held.hold(0.0, LEADER, _plan(term=1))
    ready, given_up = held.settle(0.5, term=1, coordinator=OTHER)  # the election accepted another peer
    assert ready == [] and len(given_up) == 1

    held.hold(0.0, LEADER, _plan(term=1))
    ready, given_up = held.settle(0.5, term=2, coordinator=None)  # the election moved past its term
    assert ready == [] and len(given_up) == 1
    assert len(held) == 0


def test_at_most_a_few_plans_are_held_the_oldest_given_up_first_and_none_twice() -> None:
    held = HeldPlans(HOLD_S)
    plans = [_plan(term=1, round=0, attempt=a) for a in range(MAX_HELD_PLANS + 2)]
    assert held.hold(0.0, LEADER, plans[0]) == []
    assert held.hold(0.1, LEADER, plans[0]) == []  # the same plan again (gossip): held once
    dropped = [h.plan for p in plans[1:] for h in held.hold(0.2, LEADER, p)]
    assert dropped == plans[:2] and len(held) == MAX_HELD_PLANS
    ready, _ = held.settle(0.3, term=1, coordinator=LEADER)
    assert [h.plan for h in ready] == plans[2:]  # in the order they came
