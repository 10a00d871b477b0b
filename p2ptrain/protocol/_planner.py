"""The coordinator's plan-making: whether to plan now (:func:`decide`), and the plan (:func:`next_plan`).

Both read a :class:`~p2ptrain.protocol.RoundBook` (the plans, failures and quarantine a member
keeps) and change nothing in it: the coordinator then follows its own plan like any member
(:meth:`RoundBook.plan_problem`). Pure, like the book: the node decides when to call them.

Rules, and why:

- A span's members are the previous span's members that are still live, then joiners (in a fixed
  hash order) up to ``peers.max``. No span starts with fewer than ``peers.min`` members, nor without
  a quorum of the previous span's members: on the minority side of a partition nobody can plan, so
  the two sides never both extend the history.
- Joiners are admitted only when the members' state *is* the latest confirmed checkpoint (after a
  confirmation, or at the start), because a joiner loads that checkpoint by CID (weights and
  optimizer state) and must hold exactly what the others hold.
- After a failed round (:meth:`RoundBook.report_failure`) the retry plan is the failed round, next
  attempt, its start step, the live members; after a span this coordinator completed, only once its
  record is rejected (a confirmed one drops the reports: protocol/_failure_reports.py).
- A pipelined plan that leaves a stage without any of its replicas (they died) goes back to the
  latest confirmed checkpoint with a new attempt: that stage's state since is lost, and the stages
  must restart from one version (:func:`~p2ptrain.protocol._plans.orphaned_stages`).
- A new coordinator continues from its own state. If it stopped inside a span it steps back one
  round when it can (it may have applied a round that others did not finish), unless its own round
  of that span still runs (it may yet complete everywhere, and nobody keeps two steps back); a
  member that cannot reach a plan's step stops advertising the task until it has resumed from the
  latest checkpoint, or before the first one from the run's root. A coordinator at the root plans
  from it past a plan its members left (:func:`_behind_observed`), and goes back to it when a
  member of its failed plan reports it stands there (``RoundBook.root_reported``).
- When to plan at all (:func:`decide`): not while its own span runs (unless that span is stuck on a
  peer that will not come), not during a failed round's backoff, not while behind the run (then
  resync), not in the first moments of a fresh run's first term; and without the peers a round or
  a silent coordinator term named, for a while (they are most likely dead); never again once the
  task's publisher cancelled the run.
- Only peers that compute the coordinator's bits, when its class is the run's
  (:mod:`~p2ptrain.protocol._arithmetics`, given the arithmetics the live peers advertise): a
  member of another class would never attest the quorum's checkpoints, and two classes without a
  quorum on either side confirm nothing. A coordinator whose class is not the run's does not plan,
  and a fresh run's first plan waits a while (``ARITHMETIC_WAIT_S``) for live peers whose
  arithmetic is not known yet.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import Enum
from typing import TYPE_CHECKING

from p2ptrain.protocol._arithmetics import Classes, sort_classes
from p2ptrain.protocol._election import Election
from p2ptrain.protocol._failure_reports import awaits_record
from p2ptrain.protocol._plans import orphaned_stages, plan_members, plan_stages, span_length
from p2ptrain.protocol._recut import next_cut
from p2ptrain.wire import RoundPlan

if TYPE_CHECKING:
    from p2ptrain.protocol._round_book import RoundBook

# The first plan waits this long after the coordinator's election, for peers still joining, unless
# the task's ``peers.max`` already advertise it (no one else could be admitted: the wait would only
# delay the run's first step, by 2 s of its ~9 s start on an emulated WAN, bench/wan_train.py), or
# the run resumed from a record whose members all advertise it again (run/_resume.py).
FIRST_ROUND_GRACE_S = 2.0
# A fresh run's first plan waits up to this long after the coordinator's election for live
# advertisers whose arithmetic is not known yet (protocol/_arithmetics.py): a node advertises its
# own once its torch probe ran (mesh/_membership.py: 2 s after its start, then the next heartbeat),
# and a first plan made before that left out peers that a second later would have been members.
# An older node never advertises one: it costs a fresh run this wait once, then is left out.
ARITHMETIC_WAIT_S = 10.0


class Hold(Enum):
    """Why :func:`decide` gives no plan now."""

    WAIT = "wait"  # nothing to plan yet: a span runs, a retry backs off, a barrier, too few peers
    BEHIND = "behind"  # the run is past this coordinator's state: resync instead of planning


def decide(
    book: RoundBook, now: float, election: Election, my_step: int, advertising: Collection[str], *,
    can_roll_back: bool, span_running: bool, rounds_running: bool, head_version: int,
    private: Collection[str] = (), arithmetics: Mapping[str, str | None] | None = None,
    took_part: Collection[str] | None = None,
) -> RoundPlan | Hold:
    """As coordinator at ``now``, by ``book``: the next plan to publish, or why none (:class:`Hold`).

    ``advertising``: the peers (ourselves included) that advertise the task and meet its
    requirements. ``span_running``: our own span (rounds and checkpoint) is under way;
    ``rounds_running``: its rounds are (a newer plan can stop them). ``head_version``: the
    version of the run's latest head heard (0 for none). ``private``: the peers whose
    reachability is ``private`` (their heartbeats, and ours), for the ring's order.
    ``arithmetics``: what each of ``advertising`` advertises as its arithmetic (None: nothing),
    ours as our trainer computes, and members of the run's history still heard
    (:func:`classes_of`); None plans every advertising peer. ``took_part``: the advertising peers
    that took part in the run (a fresh run's census of arithmetics counts only them and ourselves).
    """
    if not election.is_coordinator or book.cancelled:
        return Hold.WAIT
    if arithmetics is not None:
        classes = classes_of(book, election.me, {p: arithmetics.get(p) for p in {*advertising, *arithmetics}},
                             advertising, took_part)
        if not classes.may_lead:
            return Hold.WAIT  # the election moves on: this member does not stand (run/_leading.py)
        unknown = any(arithmetics.get(p) is None for p in set(advertising) - classes.planned)
        if unknown and not run_history(book) and book.elected_at is not None \
                and now - book.elected_at < ARITHMETIC_WAIT_S:
            return Hold.WAIT  # a fresh run: its peers' torch probes may not have run yet
        advertising = classes.planned
    last = book.last_plan
    # Our own round may be waiting (up to the start timeout, 15 s) on a peer that will not
    # come: one of the old term's plan, when we were just elected, or one that reported it
    # cannot take part. Plan at once; the new plan stops that round everywhere.
    stuck = rounds_running and ((last is not None and last.term != election.term) or book.culprit_reported)
    if span_running and not stuck:
        return Hold.WAIT
    quarantined = book.quarantined(now)
    if now < book.retry_after and book.failed_round is not None and not book.all_reported(quarantined):
        # A retry: give the other members time to leave the failed round, unless all have said
        # so. (Only a retry: the next span after a successful one waited here too, ~1 s.)
        return Hold.WAIT
    if head_version > book.chain.version or _behind_observed(book, my_step):
        # Elected while behind the run (a later confirmed model, or a plan seen past our step,
        # e.g. it joined at step 0 and missed the records): it must not plan from its stale state.
        return Hold.BEHIND
    if book.root_reported and my_step > book.head_step:
        # Before the first confirmed checkpoint a member of our failed plan is back at the run's
        # root (RoundBook.note_failure_report), with no checkpoint at the plan's step to come to:
        # the retry from that step would fail on it, and leaving it out may leave too few to plan
        # (a plan from step k at v0 that the members could not follow stalled the run). Go back to
        # the root too (the resync loop's load_root), where a coordinator plans from step 0 and
        # every member can follow; the steps since are redone.
        return Hold.BEHIND
    if awaits_record(book, election, my_step):
        # A member reports the last round of our span failed, and our record of the span is out:
        # a quorum may confirm it whatever we do, so the retry waits for it (_failure_reports.py).
        return Hold.WAIT
    joining_possible = len(set(advertising) - quarantined) < book.task.peers.max
    if last is None and book.chain.records and set(book.chain.records[-1].record.members) <= set(advertising):
        joining_possible = False  # resumed, with every member of the last record back: start now
    if last is None and book.elected_at is not None and now - book.elected_at < FIRST_ROUND_GRACE_S \
            and joining_possible:
        return Hold.WAIT
    # A takeover planned while our own round of the old plan still runs does not step back (see
    # next_plan): that round may yet complete on every member, and none could then go back two steps.
    plan = next_plan(book, election, my_step, set(advertising) - quarantined, can_roll_back and not rounds_running,
                     private)
    return Hold.WAIT if plan is None else plan


def _behind_observed(book: RoundBook, my_step: int) -> bool:
    """Whether a plan seen on the topic (:attr:`RoundBook.observed`) past ``my_step`` makes a
    coordinator resync (:attr:`Hold.BEHIND`) rather than plan.

    At the run's root (step 0, no confirmed checkpoint, none heard) only once for that plan
    (:meth:`RoundBook.note_behind`): a resync gives such a member nothing but the root it holds,
    so stepping down only lets a member that follows the plan lead. Elected again with no newer
    plan seen, nobody led the run past it in between: it is a plan its members left (a takeover
    plan none could follow, after which each went back to the root). Before, every member at the
    root stepped down for it, went back to the root it held and stood again, term after term: no
    plan, ever. It now plans from the root (:func:`next_plan`, the chain's head), which every
    member can follow, one still past it by going back to the root too; the steps since are redone."""
    seen = book.observed
    if seen is None or seen.step <= my_step:
        return False
    at_root = book.chain.version == 0 and seen.version == 0 and my_step == book.head_step == 0
    return not at_root or book.behind_for != seen


def run_history(book: RoundBook) -> tuple[str, ...]:
    """The members whose class is the run's (:func:`~p2ptrain.protocol._arithmetics.sort_classes`):
    those of the latest plan taken from a coordinator (the next plan must keep a quorum of them),
    else of the last confirmed record (a run resumed after a stop), else none (a fresh run)."""
    if book.accepted is not None:
        return book.accepted.members
    return book.chain.records[-1].record.members if book.chain.records else ()


def classes_of(
    book: RoundBook, me: str, arithmetics: Mapping[str, str | None], live: Collection[str] | None = None,
    took_part: Collection[str] | None = None,
) -> Classes:
    """The ``live`` peers' classes as ``me`` sees them (``arithmetics``: each peer's advertised
    arithmetic, ``me``'s own, also of the history's members heard but not advertising), from the
    run's history in ``book``: whom a plan keeps, whom it leaves out, and whether ``me`` may lead.
    ``took_part``: of ``live``, those that took part (a fresh run counts only them and ``me``)."""
    return sort_classes(book.task_cid, me, arithmetics, run_history(book), live, took_part, book.task.peers.min)


def next_plan(
    book: RoundBook, election: Election, my_step: int, live: Collection[str], can_roll_back: bool = False,
    private: Collection[str] = (),
) -> RoundPlan | None:
    """As coordinator at optimizer step ``my_step``: the next plan, or None (wait, or done).

    ``live``: the peers (the coordinator included) that advertise this task and meet its
    requirements. ``can_roll_back``: the trainer keeps the state before its last step.
    ``private``: the peers behind NATs (:func:`~p2ptrain.protocol._plans.ring_order`). The
    coordinator then follows its own plan like any member (:meth:`RoundBook.plan_problem`, then align).
    """
    if not election.is_coordinator:
        return None
    last = book.last_plan
    # The members the next plan must keep a quorum of: the latest plan the members took from a
    # coordinator (rule_problem checks it against the same plan).
    previous = book.accepted.members if book.accepted is not None else ()
    if last is None:
        # A coordinator that (re)synced from the chain continues the round numbering after it.
        start_round = book.chain.records[-1].record.round + 1 if book.chain.records else 0
        attempt, step = _next_attempt(book, election.term), my_step
        if my_step != book.head_step:
            return None  # a fresh run starts from the head of the chain
    elif book.failed_round is not None:
        start_round, attempt = book.failed_round, last.attempt + 1
        step = last.step + (book.failed_round - last.round)
    elif my_step == last.step + last.rounds:
        start_round, attempt, step = last.round + last.rounds, last.attempt, my_step
        if my_step not in (book.head_step, book.rejected_step) and not _may_overlap(book, last, my_step, live):
            return None  # barrier: the span's checkpoint is not confirmed (or rejected) yet
    elif last.term != election.term and last.step <= my_step < last.step + last.rounds:
        # Taking over a span the old coordinator did not finish: step back one round when we
        # can, since we may have applied a round that others did not complete. Not while our own
        # round of it still runs (decide passes can_roll_back False then): it may complete on every
        # member before our plan arrives, and a member one step past us keeps only the state one
        # step back (Trainer.can_align), so a plan two steps behind it could not be followed.
        step = my_step - 1 if can_roll_back and my_step > last.step else my_step
        start_round, attempt = last.round + (step - last.step), last.attempt + 1
    else:
        return None  # the current span is still running
    if my_step not in (step, step + 1) or step >= book.total_steps:
        return None
    # A pipelined span continued by a coordinator of a later term goes back to the head: the
    # members' steps are not the new coordinator's to know (_takes_over_pipeline says why).
    takeover = _takes_over_pipeline(book, election, last, step)
    # A stage whose replicas all left (below) sends the run back to the head, where joiners are
    # admitted: one may be the member that stage needs (a run with no member to spare).
    admit = step == book.head_step or (step > book.head_step and (takeover or bool(orphaned_stages(book.accepted, live))))
    members = plan_members(book.task, book.task_cid, previous, live, admit_joiners=admit, private=private,
                           coordinator=election.me)
    if members is None or election.me not in members:
        return None
    if step > book.head_step and (takeover or orphaned_stages(book.accepted, members)):
        # A stage lost every replica since the last confirmed checkpoint: what it learnt since is
        # gone, so every stage goes back to that checkpoint (the same version everywhere, or the
        # stages would not make one model) and the steps since are redone. assign moves a member
        # into the empty stage; it loads that stage's files by CID from the checkpoint's manifest.
        # A pipelined takeover goes back the same way.
        start_round = book.chain.records[-1].record.round + 1 if book.chain.records else 0
        step, attempt = book.head_step, max(attempt, _next_attempt(book, election.term))
    micros = book.stage_times.for_plan(book.chain, step, book.chain.version)
    times_cut = book.stage_times.cut_at(step)
    # Under balance = "recut", at the confirmed checkpoint of its step the cut moves by the times (protocol/_recut.py).
    cut = next_cut(book.task, book.accepted, step == book.head_step, micros, times_cut)
    return RoundPlan(
        task_cid=book.task_cid, term=election.term, round=start_round, attempt=attempt, step=step,
        rounds=span_length(book.task, start_round, book.total_steps), members=members,
        base_cid=book.chain.head_cid, version=book.chain.version,
        stages=plan_stages(book.task, members, book.accepted, micros, cut, times_cut), cut=cut,
    )


def _takes_over_pipeline(book: RoundBook, election: Election, last: RoundPlan | None, step: int) -> bool:
    """Whether the plan from ``step`` continues a pipelined span of an earlier term's coordinator
    (a takeover or a retry of its failed round) past the confirmed head: then it goes back to the
    head (:meth:`RoundBook.rewinds`), the one step every member can follow.

    A new coordinator plans at once, while its own round of the old plan may still be running
    (see :func:`decide`), and a pipelined step that every member had under way completes on all
    of them before the new plan stops it. From a step behind theirs (one before its own, as a
    takeover plans) no member could follow the plan: each stopped advertising the task, the
    coordinator itself stepped down, and before the first confirmed checkpoint there was no head
    to resync from, so nobody could lead again (a 4x2 50.7M run over the emulated WAN: every term
    passed without a coordinator for 7 minutes). Going back costs the steps since the head.

    The span's end counts too (``step`` = its last step's end, its checkpoint abandoned: nobody
    records it in a later term): each stage sums over its own replicas, so a stage whose sum did
    not need a member that left applied the span's last step while another stage failed it. From
    the span's end the members one step before it could not follow, plan after plan (a local-SGD
    pipelined run whose coordinator stopped during its stage's sum stalled so)."""
    return (last is not None and last.stages is not None and last.term != election.term
            and book.head_step < step <= last.step + last.rounds)


def _next_attempt(book: RoundBook, term: int) -> int:
    """An attempt after every plan of ``term`` this member took (0 in a new term), so that the
    next plan comes after them (:func:`~p2ptrain.protocol._plans.plan_order`) whatever its round."""
    taken = [p.attempt + 1 for p in (book.last_plan, book.accepted) if p is not None and p.term == term]
    return max(taken, default=0)


def _may_overlap(book: RoundBook, last: RoundPlan, my_step: int, live: Collection[str]) -> bool:
    """Whether the span after ``last`` (ended at ``my_step``, its checkpoint unsettled) may be
    planned now: in overlap mode, once the checkpoint before it is settled (at most one unsettled)
    and while no peer waits to join a span with room for it (joiners need a confirmed head)."""
    if not book.overlap or book.settled_step < book.previous_checkpoint(my_step):
        return False
    kept = [p for p in last.members if p in live]
    waiting = [p for p in live if p not in last.members]
    return not (waiting and len(kept) < book.task.peers.max)
