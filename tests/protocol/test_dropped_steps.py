"""RoundBook.holds_dropped: a member left out of a retry does not build on the step the run dropped.

A round (a stage's sum, a data-parallel all-reduce) can complete at one member and fail at another:
the member that completed it applied the step, and only following the retry would roll it back
(``Trainer.align``). Left out of that retry (named in an abort notice, which any member of the round
can send), it kept the dropped attempt's weights; named again in a later plan from a step past the
one redone, ``can_align`` held, and it trained on with weights no other member had (red team
h-attack4, MEDIUM: its stage's second opinions then disagreed with its honest replicas). Now such a
member resyncs from the head first (run/_plan_intake.py ``PlanIntake.on_plan`` marks its state stale). Fails on
main, where the book has no such rule."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Chain, Election, ElectionConfig, RoundBook, signing
from p2ptrain.task import load_task
from p2ptrain.wire import RoundPlan
from tests.protocol._books import CID, elected, task_text

TASK = task_text()


def _elected() -> Election:
    """A lone peer's election, won: the plans below are its term's coordinator's."""
    election = Election("QmTask", create_new_key_pair(b"\x05" * 32), ElectionConfig(heartbeat_s=1.0, timeout_beats=3))
    elected(election)
    return election


def test_a_member_left_out_of_a_retry_does_not_follow_a_later_plan_on_the_step_it_applied_alone():
    election = _elected()
    me = election.me
    others = tuple(signing.peer_str(create_new_key_pair(bytes([i]) * 32)) for i in range(10, 13))
    everyone = tuple(sorted((me, *others)))

    def plan(step: int, attempt: int, members: tuple[str, ...], rounds: int = 5) -> RoundPlan:
        return RoundPlan(task_cid="QmTask", term=election.term, round=step, attempt=attempt, step=step, rounds=rounds,
                         members=members, base_cid=CID, version=0)

    book = RoundBook(load_task(TASK), "QmTask", Chain("QmTask", CID), 100)
    first = plan(0, 0, everyone, rounds=10)
    assert book.plan_problem(first, me, election) is None
    # Round 4 completed here (this member is at step 5) and failed elsewhere; the retry from step 4
    # leaves this member out.
    retry = plan(4, 1, others, rounds=6)
    assert book.plan_problem(retry, me, election) == "not a member of this span"
    assert not book.holds_dropped(retry, 4)  # had it not applied round 4, nothing was dropped here
    later = plan(6, 2, everyone)
    assert book.plan_problem(later, me, election) is None
    assert book.holds_dropped(later, 5)  # on main: followed, on round 4's dropped weights
    assert book.holds_dropped(later, 6)
    assert not book.holds_dropped(later, 4)  # at the step the run redid from: its weights are the run's
    # A plan from the step redone itself: align rolls the applied step back, nothing to resync.
    assert not book.holds_dropped(plan(4, 3, everyone), 5)
    # Once a plan names it, the mark is the runtime's to clear (PlanIntake.on_plan decides once).
    book.left_out_from = None
    assert not book.holds_dropped(later, 5)


def test_a_member_never_left_out_holds_nothing_dropped():
    election = _elected()
    me = election.me
    others = tuple(signing.peer_str(create_new_key_pair(bytes([i]) * 32)) for i in range(20, 22))
    book = RoundBook(load_task(TASK), "QmTask", Chain("QmTask", CID), 100)
    span = RoundPlan(task_cid="QmTask", term=election.term, round=0, attempt=0, step=0, rounds=5,
                     members=tuple(sorted((me, *others))), base_cid=CID, version=0)
    assert book.plan_problem(span, me, election) is None
    assert not book.holds_dropped(span, 1)
    later = RoundPlan(task_cid="QmTask", term=election.term, round=3, attempt=1, step=3, rounds=5,
                      members=span.members, base_cid=CID, version=0)
    assert not book.holds_dropped(later, 3) and not book.holds_dropped(later, 4)
