"""Plans that name this member from a sender its election does not accept yet: held, not refused.

A member that starts advertising a task just after the election can get the coordinator's first
plan before it hears a heartbeat with that coordinator's certificate: the plan is then "not from the
coordinator" of its term (:meth:`~p2ptrain.protocol.RoundBook.plan_problem`). It used to report
CANNOT_FOLLOW at once: round 0 failed, and the retry left it out for about a minute (participation
strikes). Seen in a run of six pipelined peers joining over 2 s, two of them 0.4 s after the election.

Such a plan is held instead, when its sender claims to lead a term at or past the member's own and
the member knows no coordinator of that term: the next heartbeat settles it. The trust rule stays:
a held plan is only handed back to the member's intake once the election accepts its sender as the
coordinator of the plan's term (where the intake checks it again, like any plan); it is given up
(reported as CANNOT_FOLLOW, as before) when its hold ends, when the election moved past its term,
or when it accepted someone else for it. Bounded: at most :data:`MAX_HELD_PLANS`, each held at most
``hold_s``; holding one more gives up the oldest. Pure and clock-injected: the run feeds it the time
and the election's term and coordinator (run/_plan_intake.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.wire import RoundPlan

# Plans of one sender's term a member can be sent before a beat reaches it: the first plan and a
# retry or two. More are forged or stale; the oldest is given up.
MAX_HELD_PLANS = 4


@dataclass(frozen=True)
class HeldPlan:
    """One plan held: who sent it, and until when it is held."""

    sender: str
    plan: RoundPlan
    until: float


class HeldPlans:
    """The plans one member holds until its election accepts their sender (see the module)."""

    def __init__(self, hold_s: float, limit: int = MAX_HELD_PLANS) -> None:
        """``hold_s``: how long a plan is held at most (a couple of heartbeats: the next beat
        either brings the sender's certificate or does not)."""
        self.hold_s = hold_s
        self.limit = limit
        self._held: list[HeldPlan] = []

    def __len__(self) -> int:
        return len(self._held)

    @staticmethod
    def holds(plan: RoundPlan, term: int, coordinator: str | None) -> bool:
        """Whether a plan the book would not follow because of its sender may wait for the election
        (term ``term``, ``coordinator`` accepted in it, or None): it claims a later term, or this
        term while no coordinator of it is known. A plan of an earlier term, or of this term from
        another peer than its accepted coordinator, can never be followed: it is not held."""
        return plan.term > term or (plan.term == term and coordinator is None)

    def hold(self, now: float, sender: str, plan: RoundPlan) -> list[HeldPlan]:
        """Hold ``plan`` from ``sender`` until ``now + hold_s``; the plans given up to make room
        (the oldest first), for the caller to report. A plan already held is not held twice."""
        if any(h.sender == sender and h.plan == plan for h in self._held):
            return []
        self._held.append(HeldPlan(sender, plan, now + self.hold_s))
        dropped, self._held = self._held[:-self.limit], self._held[-self.limit:]
        return dropped

    def settle(self, now: float, term: int, coordinator: str | None) -> tuple[list[HeldPlan], list[HeldPlan]]:
        """(ready, given up): the held plans whose sender the election now accepts as coordinator
        of their term (for the intake to check and follow), and those that can no longer be
        (their hold ended, the election is past their term, or accepted another peer for it).
        Both leave the hold; the rest stay, in the order they came."""
        ready, given_up, kept = [], [], []
        for held in self._held:
            if held.plan.term == term and held.sender == coordinator:
                ready.append(held)
            elif now >= held.until or not self.holds(held.plan, term, coordinator):
                given_up.append(held)
            else:
                kept.append(held)
        self._held = kept
        return ready, given_up
