"""RoundBook.holds_dropped for a member that never took the retry: a plan it missed redid its steps.

A round can complete at one member and fail at the others; the coordinator retries it with the next
attempt. A member that took the retry's plan either rolls the step back (``Trainer.align``) or, left
out of it, notes the step redone without it (``RoundBook.left_out_from``, test_dropped_steps.py). One
that never took that plan (its message lost, or its term's coordinator not yet known here) noted
nothing, and a later plan that names it from the step it stands at passed ``can_align``: it trained
on with weights of the dropped attempt that no other member held, until the resync loop saw the head
ahead of its chain (about 2 s, mid-span) or its next checkpoint was confirmed without it.
Now a plan that does not follow on the last one this member took (in its term: the next span of its
attempt, or a retry of one of its rounds with the next attempt; from another term, whose attempts
start over: not from a checkpoint it has not confirmed) marks what it applied past that plan's start
as dropped, and the member resyncs before it follows. Fails on main, where the book has no such rule."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import Chain, Election, ElectionConfig, RoundBook, signing
from p2ptrain.task import load_task
from p2ptrain.wire import RoundPlan
from tests.protocol._books import CID, elected, task_text

MODEL = "QmQQFmbEzeKEYVMidxPKhdPYbB5DR8mFW8YG5KaEvoSi1o"
TASK = task_text(checkpoint_interval=10)


def _setup() -> tuple[Election, RoundBook, tuple[str, ...], RoundPlan]:
    election = Election("QmTask", create_new_key_pair(b"\x05" * 32), ElectionConfig(heartbeat_s=1.0, timeout_beats=3))
    elected(election)
    me = election.me
    others = tuple(signing.peer_str(create_new_key_pair(bytes([i]) * 32)) for i in range(10, 13))
    everyone = tuple(sorted((me, *others)))
    book = RoundBook(load_task(TASK), "QmTask", Chain("QmTask", CID), 100)
    first = _plan(election.term, 0, 0, everyone, rounds=10)
    assert book.plan_problem(first, me, election) is None
    return election, book, everyone, first


def _plan(term: int, step: int, attempt: int, members: tuple[str, ...], rounds: int | None = None,
          version: int = 0, base: str = CID) -> RoundPlan:
    return RoundPlan(task_cid="QmTask", term=term, round=step, attempt=attempt, step=step,
                     rounds=rounds if rounds is not None else 10 - step % 10, members=members, base_cid=base,
                     version=version)


def test_a_later_retry_of_a_retry_it_missed_is_not_followed_on_the_step_it_applied_alone():
    election, book, everyone, _ = _setup()
    # Round 4 completed here (step 5) and failed elsewhere. The retry (attempt 1, from step 4) never
    # reached this member; it redid step 4, then its round 5 failed: the next retry, from step 5,
    # names this member again, which stands at step 5 (can_align holds), on round 4's dropped weights.
    retry_of_retry = _plan(election.term, 5, 2, everyone)
    assert book.plan_problem(retry_of_retry, election.me, election) is None
    assert book.holds_dropped(retry_of_retry, 5)  # on main: followed


def test_the_next_span_after_a_missed_retry_is_not_followed_either():
    # The missed retry (attempt 1) ran to the checkpoint at step 10; this member's round 9 completed
    # here alone (step 10). The next span (attempt 1, from v1 or, its checkpoint rejected, from v0).
    for version in (1, 0):
        election, book, everyone, _ = _setup()
        nxt = _plan(election.term, 10, 1, everyone, version=version, base=MODEL if version else CID)
        assert book.plan_problem(nxt, election.me, election) is None
        assert book.holds_dropped(nxt, 10)


def test_a_new_terms_plan_from_a_checkpoint_it_has_not_confirmed_is_not_followed():
    # The next term's coordinator went back and redid the span without this member (which did not know
    # it yet); that span's checkpoint at step 10 is v1, and the next span, attempt 0 again in the new
    # term, names it back: the same (attempt, round) as the next span of the plan it took.
    election, book, everyone, first = _setup()
    elected(election, 50.0)
    assert election.term > first.term
    nxt = _plan(election.term, 10, 0, everyone, version=1, base=MODEL)
    assert book.plan_problem(nxt, election.me, election) is None
    assert book.holds_dropped(nxt, 10)


def test_plans_that_follow_on_keep_the_steps_applied():
    # The next span of the same attempt (also before this member confirmed its checkpoint: the
    # attestations may come after the plan), then a retry of one of its rounds.
    election, book, everyone, first = _setup()
    nxt = _plan(election.term, 10, 0, everyone, version=1, base=MODEL)
    assert book.plan_problem(nxt, election.me, election) is None and not book.holds_dropped(nxt, 10)
    retry = _plan(election.term, 13, 1, everyone, version=1, base=MODEL)
    assert book.plan_problem(retry, election.me, election) is None
    assert not book.holds_dropped(retry, 13) and not book.holds_dropped(retry, 14)
    # The next term's coordinator takes the span over (the next attempt, from a step within it).
    election, book, everyone, first = _setup()
    elected(election, 50.0)
    takeover = _plan(election.term, 3, 1, everyone)
    assert book.plan_problem(takeover, election.me, election) is None and not book.holds_dropped(takeover, 4)
    # Or one that continues a plan of the old term this member did not take (from the base it
    # confirmed): its coordinator's own plans, which this member follows (refused, that coordinator
    # would lead on with no quorum and no record to outvote it). Its checkpoint's attestations tell.
    elected(election, 75.0)
    own = _plan(election.term, 6, 3, everyone)
    assert book.plan_problem(own, election.me, election) is None and not book.holds_dropped(own, 6)
    # It goes on to the next span of a checkpoint abandoned (no record: the version confirmed here).
    elected(election, 100.0)
    span = _plan(election.term, 10, 1, everyone)
    assert book.plan_problem(span, election.me, election) is None and not book.holds_dropped(span, 10)
    # A plan from this member's confirmed head (a pipelined run sent back to it: RoundBook.rewinds).
    election, book, everyone, first = _setup()
    back = _plan(election.term, 0, 1, everyone)
    assert book.plan_problem(back, election.me, election) is None and not book.holds_dropped(back, 3)


def test_a_takeover_from_the_base_of_the_plan_taken_is_followed_before_that_base_is_confirmed_here():
    # The next span from v1 (step 10) arrived before v1's attestations: this member took it with its
    # chain at v0 (plans may be ahead of the chain). Its coordinator stopped at step 14; the next term's
    # takes the span over from step 13, from v1 too, before those attestations reach this member. It
    # built on v1 itself: nothing it applied was redone. On main it was marked and resynced (a reload,
    # or, the head still v0 here, a report that it cannot follow and a retry without it).
    election, book, everyone, _ = _setup()
    nxt = _plan(election.term, 10, 0, everyone, version=1, base=MODEL)
    assert book.plan_problem(nxt, election.me, election) is None and book.chain.version == 0
    elected(election, 50.0)
    takeover = _plan(election.term, 13, 1, everyone, version=1, base=MODEL)
    assert book.plan_problem(takeover, election.me, election) is None
    assert book.left_out_from is None and not book.holds_dropped(takeover, 14)
    # From a checkpoint after that base (v2, not confirmed here) it is still marked: here it cannot be
    # told from a redo of the span it missed (the third case above), even when v2 is its own span's.
    election, book, everyone, _ = _setup()
    assert book.plan_problem(_plan(election.term, 10, 0, everyone, version=1, base=MODEL), election.me, election) is None
    elected(election, 50.0)
    later = _plan(election.term, 20, 0, everyone, version=2, base=MODEL)
    assert book.plan_problem(later, election.me, election) is None and book.holds_dropped(later, 20)
