"""Which failure reports a member believes: pure, driven by the book and an injected clock.

A ``RoundFailed`` makes the coordinator redo its plan from the earliest round reported failed (the
retry, docs/training.md, "A member dies"): a round may complete at some members and fail at
others, and the retry puts them back on one state. Before, every signed report that named the plan
the coordinator followed (its task, term, attempt and one of its rounds) counted, whoever sent it.
Red team h-attack5 found two ways to stop a run with it, for good:

- a peer that never joined the task (a fresh identity on the task's topic) sent one report of the
  running span's first round; the span completed, its checkpoint was confirmed, and the retry from
  that round, four steps behind every member, could never be planned (``next_plan``: the
  coordinator's step is neither the retry's nor the one after): three members at step 4 of 24 for
  the 90 s the test waited, nothing logged;
- a member of the plan that reported each round it had completed did the same, and was never left
  out (a report names nobody but its sender, and this sender was not blamed).

Now a report counts only from a member of the plan (nobody else takes part in its rounds), and only
if no later round of the same plan completed here. Every member of a plan takes part in each of its
rounds (a ring's all-reduce, a pipelined step's witnessed summary), and a member whose round failed
leaves the span, so once round ``j`` completed here a report that round ``k < j`` failed is false,
whenever it comes, and so is one saying its sender took no part in round ``j`` itself (cannot
follow, out of step, no training data: :data:`~p2ptrain.protocol.CANNOT_FOLLOW`...): it is dropped
(no retry), counted, and its sender, a member that took part with this one, is left out of the next
plans for the quarantine (``FAILED_PEER_QUARANTINE_S``), as a member a round names. Any other report
of the latest round completed here cannot be told from a split completion (that round completed
here and failed there) and is followed as before, once per member and round (:func:`split_problem`).

A report of a span's last round is the exception: the coordinator that completed it publishes the
span's record at once, and a quorum of the span's members may confirm it whatever comes after. The
retry redid that round anyway (from the step before the record's): a member that reported every
span's last round after completing it had the run confirm one state and go on from another (its
redo without that member), every honest member then found its state was "not the confirmed model"
and blamed its arithmetic, its coordinator stepped down, and the last span's retry left the members
one step short of the run's end (tests/runtime/test_false_reports.py). Now such a retry waits for the
record (:func:`awaits_record`): rejected, the round is redone as before (a split completion where
too few completed it to confirm its record, e.g. one of two members); confirmed, the report is
dropped (:func:`record_confirmed`) and not believed once the record is (:func:`believed`): a
quorum of the span's members holds the state after the round. Its sender is left out only if it
attested the record (then its report was false: :func:`report_problem`); a member whose round
really failed holds the state before and attests nothing: it loads the confirmed state at once
(:func:`own_round_lost`; it waited for a checkpoint of its own that never came, and ended the run
"done" one step short), and is not left out (red team h-attack7: a hostile ring neighbour that
made its last hop time out got it left out every span, itself never blamed).

A pipelined span is different (:func:`held_after`): its record names a manifest gathered from every
member of the plan, each one's signed statement of its stage at the span's end
(run/_stage_checkpoints.py), which a member sends only once its last round completed. A member
whose round really failed sends none, no record comes, the checkpoint counts as rejected and the
round is redone with it (tests/pipeline/test_pipelined_last_step.py). So once such a record is
confirmed every report of its span is false, attested or not: on main a liar whose attestation was
not among the quorum's (it sent none, or a late one) was dropped uncounted and kept in the plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2ptrain.base import short_id
from p2ptrain.protocol._quarantine import exclude
from p2ptrain.protocol._step_aborts import says_absent
from p2ptrain.wire import RoundFailed, RoundPlan

if TYPE_CHECKING:
    from p2ptrain.protocol._election import Election
    from p2ptrain.protocol._round_book import RoundBook


def names_plan(plan: RoundPlan | None, report: RoundFailed) -> bool:
    """Whether ``report`` is of ``plan`` (its task, term and attempt, one of its rounds)."""
    return plan is not None and (report.task_cid, report.term, report.attempt) == (plan.task_cid, plan.term, plan.attempt) \
        and plan.round <= report.round < plan.round + plan.rounds


def report_problem(book: RoundBook, report: RoundFailed, reporter: str) -> str | None:
    """Why ``reporter``'s ``report`` of the plan this member follows is not to be believed, or None
    (also None for a report of another plan: that one is ignored as before, not refused)."""
    plan = book.last_plan
    if plan is None or not names_plan(plan, report):
        return None
    if reporter not in plan.members:
        return f"{short_id(reporter)}, not a member of plan {plan.round}.{plan.attempt}, reports round {report.round} failed"
    if span_confirmed(book, plan) and held_after(book, plan, reporter):
        # Another member's report of a confirmed span's last round is moot, not false (believed: no retry).
        return (f"{short_id(reporter)} reports round {report.round} of plan {plan.round}.{plan.attempt} failed "
                f"({report.reason[:80]}), but {_how_held(plan)} (model v{book.chain.version}): "
                f"left out of the next plans")
    done = book.completed_round
    if done is not None and refuted(report.round, says_absent(report.reason), done):
        return (f"{short_id(reporter)} reports round {report.round} of plan {plan.round}.{plan.attempt} failed "
                f"({report.reason[:80]}), but round {done} of it completed here with every member of it: left out of "
                f"the next plans")
    return None


def refuted(round_: int, absent: bool, done: int) -> bool:
    """Whether a report that round ``round_`` failed at its sender is false once round ``done`` of
    the same plan completed here: a later one did, in which the sender took part (a member whose
    round failed leaves the span), or that one did and the sender says it took no part at all
    (``absent``, :func:`~p2ptrain.protocol.says_absent`: every member takes part in each round)."""
    return round_ < done or (round_ == done and absent)


def refuse_report(book: RoundBook, now: float, report: RoundFailed, reporter: str) -> str | None:
    """:func:`report_problem`, and :func:`split_problem` for a report of the latest round completed
    here; a member of the plan whose report is false is left out of the next plans from ``now`` for
    the quarantine. The runtime's one entry for each report heard (it counts what this returns)."""
    problem = report_problem(book, report, reporter)
    if problem is None and book.last_plan is not None and names_plan(book.last_plan, report) \
            and report.round == book.completed_round and not span_confirmed(book, book.last_plan):
        problem = split_problem(book, reporter, report.round)
    if problem is not None and book.last_plan is not None and reporter in book.last_plan.members:
        exclude(book.failed_peers, reporter, now)
    return problem


def split_problem(book: RoundBook, reporter: str, round_: int) -> str | None:
    """A member reports round ``round_`` failed there, and it completed here: a split completion,
    for all this member can tell, and its retry puts every member back on one state. Believed once
    per member and round: the retry redoes that round, and a member that reports it failed again
    after it completed here again (a member that completes each span's last round and says it
    failed would have it redone for ever) is not believed (None: believed, noted)."""
    if book.split_rounds.get(reporter) == round_:
        return (f"{short_id(reporter)} reports round {round_} failed again, and it completed here again with every "
                f"member of the plan: left out of the next plans")
    book.split_rounds[reporter] = round_  # (one entry per member of a plan: its latest)
    return None


def round_completed(book: RoundBook, now: float, plan: RoundPlan, round_: int) -> list[str]:
    """Round ``round_`` of ``plan`` completed here at ``now`` (every member of the plan took part in
    it). Reports already counted of an earlier round of that plan, or saying their sender took no
    part in this one, are false, and so is a second report of this round completed here twice
    (:func:`split_problem`): dropped (the retry they asked for goes with them when no other asks for
    it), their senders left out of the next plans. Returns why, one line per report dropped."""
    if plan is not book.last_plan:
        return []
    book.completed_round = max(round_, book.completed_round if book.completed_round is not None else round_)
    lines = []
    for reporter, (k, absent) in sorted(book.failure_rounds.items()):
        if refuted(k, absent, round_):
            lines.append(f"{short_id(reporter)} reported round {k} of plan {plan.round}.{plan.attempt} failed, but "
                         f"round {round_} of it completed here with every member of it: left out of the next plans")
        elif k == round_ and (split := split_problem(book, reporter, k)) is not None:
            lines.append(split)
        else:
            continue
        del book.failure_rounds[reporter]
        exclude(book.failed_peers, reporter, now)
    if lines and not book.failure_rounds:
        book.failed_at = None
    return lines


def span_confirmed(book: RoundBook, plan: RoundPlan) -> bool:
    """Whether the chain's head is the record of ``plan``'s span (its end step, term, attempt and
    last round): a quorum of its members attested the state after its last round."""
    if not book.chain.records:
        return False
    r = book.chain.records[-1].record
    return (r.step, r.term, r.attempt, r.round) == (plan.step + plan.rounds, plan.term, plan.attempt,
                                                    plan.round + plan.rounds - 1)


def awaits_record(book: RoundBook, election: Election, my_step: int) -> bool:
    """Whether the coordinator, at ``my_step``, holds a believed report's retry until the span's
    record settles: it completed the span of its own term's plan (so it publishes that record, or
    counts the checkpoint as rejected: :meth:`RoundBook.unsettled` ends either way, by the
    attestations' deadline at the latest), and the checkpoint at ``my_step`` is not settled yet.
    Confirmed, :func:`record_confirmed` drops the reports; rejected, the retry is planned."""
    plan = book.last_plan
    return (plan is not None and book.failed_round is not None and plan.term == election.term
            and my_step == plan.step + plan.rounds and book.unsettled(my_step) == my_step)


def record_confirmed(book: RoundBook, now: float, me: str | None = None) -> list[str]:
    """The chain's head was just confirmed here at ``now``: if it is the record of the plan this
    member follows, the reports of that plan still believed (its last round's: nothing later refutes
    them) are dropped. A sender whose attestation is among the record's quorum's (any sender, of a
    pipelined span: :func:`held_after`) holds the state after the round it said failed: its report
    was false, and it is left out of the next plans. One that did not attest most likely did fail
    the round, and loads the record's state
    (:func:`own_round_lost`, where it is ``me``): its report is dropped uncounted, and it is not
    left out (a hostile ring neighbour that made its last hop fail got it left out every span).
    Returns why, one line per false report dropped."""
    plan = book.last_plan
    if plan is None or not span_confirmed(book, plan):
        return []
    false = sorted((reporter, k) for reporter, (k, _) in book.failure_rounds.items()
                   if reporter != me and held_after(book, plan, reporter))
    lines = [f"{short_id(reporter)} reported round {k} of plan {plan.round}.{plan.attempt} failed, but "
             f"{_how_held(plan)} (model v{book.chain.version}): left out of the next plans"
             for reporter, k in false]
    for reporter, _ in false:
        exclude(book.failed_peers, reporter, now)
    book.failure_rounds.clear()
    book.failed_at = None
    return lines


def held_after(book: RoundBook, plan: RoundPlan, peer: str) -> bool:
    """Whether ``peer``, a member of ``plan`` whose span's record the chain's head is, is known to
    hold the state after the span's last round: every member of a pipelined plan (the record's
    manifest is a gather of each member's stage statement, sent once its last round completed);
    in a data-parallel one, a member whose attestation confirmed it (:func:`attested`; a quorum
    confirms it without a member whose last round failed there)."""
    return plan.stages is not None or attested(book, peer)


def _how_held(plan: RoundPlan) -> str:
    """Why :func:`held_after` holds, for the log line of a false report."""
    return "it sent its stage statement for its span's checkpoint" if plan.stages is not None \
        else "it attested its span's checkpoint"


def attested(book: RoundBook, peer: str) -> bool:
    """Whether ``peer``'s attestation is among those that confirmed the chain's head (the quorum
    counted when it was confirmed here, or that its chain line carries)."""
    return bool(book.chain.proofs) and any(a.attestation.attester == peer for a in book.chain.proofs[-1])


def believed(book: RoundBook, report: RoundFailed, reporter: str) -> bool:
    """Whether ``reporter``'s ``report`` calls for a retry: of the plan this member follows, not
    refused (:func:`report_problem`), and not of a span whose record is confirmed (no retry follows
    one: the members went on from it)."""
    plan = book.last_plan
    return plan is not None and names_plan(plan, report) and not span_confirmed(book, plan) \
        and report_problem(book, report, reporter) is None


def own_round_lost(book: RoundBook, me: str) -> bool:
    """Whether the chain's head, just confirmed, is the record of the span of the plan ``me``
    follows while ``me``'s own report of a round of it is believed here (asked before
    :func:`record_confirmed` drops it): its round failed here and completed at a quorum of the
    span's members, so no retry comes (a confirmed record drops the reports) and ``me`` holds the
    state before the record's. It loads the record's by CID (run/_attesting.py, ``lost_span``): it
    waited for a checkpoint of its own at that step that never comes, and at the run's end was
    ``done`` one step short of the final model (tests/runtime/test_last_round_failure.py)."""
    plan = book.last_plan
    return plan is not None and me in book.failure_rounds and span_confirmed(book, plan)
