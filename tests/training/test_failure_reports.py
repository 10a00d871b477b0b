"""Which failure reports a coordinator believes (protocol/_failure_reports.py), pure: three members'
elections and books (test_training_gating.py's ``Run``), a span planned, its rounds completed.

Fails on main: a report from a peer that is not a member of the plan counted, and so did a report
of a round before one that completed here; the retry from that round, behind the coordinator by
more than a step, was never planned, and no plan came after it (tests/runtime/test_false_reports.py
plays both on real hosts: a stranger's one report stopped a run for good)."""

from __future__ import annotations

from typing import Any

import pytest

from p2ptrain.protocol import (CANNOT_FOLLOW, Hold, attest, own_round_lost, record_confirmed, refuse_report,
                               round_completed)
from p2ptrain.protocol._round_book import RETRY_BACKOFF_S
from p2ptrain.base import short_id
from p2ptrain.wire import RoundFailed, RoundPlan

from .test_training_gating import INITIAL, Run


@pytest.fixture
def run3(digits: Any, digits_task: Any) -> Run:
    _, cid = digits
    return Run(digits_task(cid, steps=10), "QmTask")


def _report(run: Run, plan: RoundPlan, index: int) -> RoundFailed:
    return RoundFailed(task_cid=run.task_cid, term=plan.term, round=plan.round + index, attempt=plan.attempt,
                       step=plan.step + index, reason="peer X failed: (is it true?)")


def _complete(run: Run, plan: RoundPlan, now: float, rounds: range) -> list[str]:
    return [line for i in rounds for line in round_completed(run.book, now, plan, plan.round + i)]


def test_a_report_from_a_peer_the_plan_does_not_name_is_refused_and_asks_for_no_retry(run3: Run) -> None:
    run = run3
    plan = run.follow(run.decide(10.0))
    assert plan.rounds >= 2
    report = _report(run, plan, 0)
    problem = refuse_report(run.book, 11.0, report, "12D3KooWStranger")
    assert problem is not None and "not a member of plan" in problem
    assert not run.book.note_failure_report(11.0, report, "12D3KooWStranger", run.c, coordinator=True)
    assert run.book.failed_round is None
    # The span completes here; its checkpoint settles: the next span, not a retry 4 steps back.
    _complete(run, plan, 12.0, range(plan.rounds))
    end = plan.step + plan.rounds
    run.book.rejected_step = end
    following = run.decide(13.0, my_step=end)
    assert isinstance(following, RoundPlan) and following.step == end, following


def test_a_report_of_a_round_before_one_completed_here_is_false_and_its_sender_left_out(run3: Run) -> None:
    run = run3
    plan = run.follow(run.decide(10.0))
    liar = run.others[0]
    # Round 0 completed here, and the liar says it failed there: a split completion, for all this
    # member can tell (believed: the retry would go back to round 0).
    assert _complete(run, plan, 11.0, range(1)) == []
    assert refuse_report(run.book, 11.1, _report(run, plan, 0), liar) is None
    assert run.book.note_failure_report(11.1, _report(run, plan, 0), liar, run.c, coordinator=True)
    assert run.book.failed_round == plan.round
    # Round 1 completes here, the liar in it: its report of round 0 was false. Dropped, counted once.
    dropped = _complete(run, plan, 12.0, range(1, 2))
    assert len(dropped) == 1 and "left out of the next plans" in dropped[0], dropped
    assert run.book.failed_round is None and liar in run.book.quarantined(12.0)
    # The same report again, or of any round before: refused at once.
    problem = refuse_report(run.book, 12.5, _report(run, plan, 0), liar)
    assert problem is not None and "completed here with every member of it" in problem
    assert not run.book.note_failure_report(12.5, _report(run, plan, 0), liar, run.c, coordinator=True)
    # The span ends: the next one is planned (without the liar while it is left out), no retry.
    _complete(run, plan, 13.0, range(2, plan.rounds))
    end = plan.step + plan.rounds
    run.book.rejected_step = end
    following = run.decide(14.0, my_step=end)
    assert isinstance(following, RoundPlan) and following.step == end and liar not in following.members, following


def test_a_report_of_the_latest_round_completed_here_still_asks_for_its_retry(run3: Run) -> None:
    run = run3
    """A split completion (the round completed here, failed there): the retry puts every member back
    on one state, as before; a report of a round this member has not completed counts as before too."""
    plan = run.follow(run.decide(10.0))
    member = run.others[1]
    _complete(run, plan, 11.0, range(2))
    assert refuse_report(run.book, 11.5, _report(run, plan, 1), member) is None  # (the runtime's entry)
    assert run.book.note_failure_report(11.5, _report(run, plan, 1), member, run.c, coordinator=True)
    retry = run.decide(12.0, my_step=plan.step + 2)
    assert isinstance(retry, RoundPlan) and (retry.round, retry.attempt) == (plan.round + 1, plan.attempt + 1)
    assert member in retry.members  # nobody named: a split completion blames no one
    # The retry redoes that round; it completes here again and the member says it failed again: a
    # member that did so at every span's last round (nothing later refutes it) had it redone for
    # ever on main. The second time it is not believed, and the run goes on without it.
    run.follow(retry)
    _complete(run, retry, 13.0, range(1))
    problem = refuse_report(run.book, 13.1, _report(run, retry, 0), member)
    assert problem is not None and "failed again" in problem and member in run.book.quarantined(13.1)


def test_a_member_saying_it_took_no_part_in_a_round_that_completed_here_is_refuted(run3: Run) -> None:
    """A pipelined step's reporter that joined its summary anyway (red team h-attack5, item 2): the
    step completed at every member, and on main its report still made the coordinator redo it."""
    run = run3
    plan = run.follow(run.decide(10.0))
    reporter = run.others[0]
    absent = RoundFailed(task_cid=run.task_cid, term=plan.term, round=plan.round, attempt=plan.attempt,
                         step=plan.step, reason=f"{CANNOT_FOLLOW}: (it can)")
    # Before the round completes here the report is believed (its step is left, a retry planned)...
    assert refuse_report(run.book, 11.0, absent, reporter) is None
    assert run.book.note_failure_report(11.0, absent, reporter, run.c, coordinator=True)
    # ... until it completes here: with the reporter in it, so the report was false.
    dropped = _complete(run, plan, 11.5, range(1))
    assert len(dropped) == 1 and run.book.failed_round is None and reporter in run.book.quarantined(11.5), dropped
    # Once completed, the same report is refused as it comes.
    assert refuse_report(run.book, 12.0, absent, reporter) is not None


def _span_reported_at_its_end(run: Run, reporter: str) -> tuple[RoundPlan, int]:
    """A span that completed here (at the coordinator), then ``reporter`` says its last round failed:
    believed (a split completion, for all it can tell). Returns the plan and the span's end step."""
    plan = run.follow(run.decide(10.0))
    last = plan.rounds - 1
    assert _complete(run, plan, 11.0, range(plan.rounds)) == []
    report = _report(run, plan, last)
    assert refuse_report(run.book, 11.5, report, reporter) is None
    assert run.book.note_failure_report(11.5, report, reporter, run.c, coordinator=True)
    assert run.book.failed_round == plan.round + last
    return plan, plan.step + plan.rounds


def _confirm(run: Run, plan: RoundPlan, end: int, attesters: tuple[str, ...]) -> None:
    """The span's record, confirmed here with the attestations of ``attesters`` (and the coordinator's)."""
    signed = run.book.checkpoint_record(plan, end, INITIAL, INITIAL, {}, run.election.key_pair)
    run.book.chain.append(signed, [attest(signed.record, INITIAL, INITIAL, run.elections[p].key_pair)
                                   for p in (run.c, *attesters)])


def test_a_report_of_a_spans_last_round_waits_for_its_record_and_is_dropped_once_it_is_confirmed(run3: Run) -> None:
    """Fails on main: the coordinator published the span's record and planned the retry of its last
    round besides; the record was confirmed by a quorum (the reporter among it) while the others
    redid that round without the reporter, so they went on from a state that was not the confirmed
    one, were told their arithmetic differed, and the last span's retry ended the run a step short
    (tests/runtime/test_false_reports.py)."""
    run = run3
    liar = run.others[0]
    plan, end = _span_reported_at_its_end(run, liar)
    # Our record of the span is out (the checkpoint at ``end`` unsettled): no retry yet.
    assert run.decide(11.5 + 2 * RETRY_BACKOFF_S, my_step=end) is Hold.WAIT
    # A quorum confirms it, the liar's attestation among it (it holds the state after the round it
    # said failed): the report is dropped, counted, its sender left out; the next span follows.
    _confirm(run, plan, end, (liar,))
    dropped = record_confirmed(run.book, 15.0)
    assert len(dropped) == 1 and "attested its span's checkpoint" in dropped[0], dropped
    assert run.book.failed_round is None and liar in run.book.quarantined(15.0)
    following = run.decide(15.5, my_step=end)
    assert isinstance(following, RoundPlan) and following.step == end and liar not in following.members, following
    # The same report again, once the record is confirmed: refused as it comes.
    problem = refuse_report(run.book, 16.0, _report(run, plan, plan.rounds - 1), liar)
    assert problem is not None and "attested its span's checkpoint" in problem
    assert not run.book.note_failure_report(16.0, _report(run, plan, plan.rounds - 1), liar, run.c, coordinator=True)


def test_a_report_of_a_spans_last_round_is_retried_when_its_record_is_rejected(run3: Run) -> None:
    """The honest failure the wait must still handle: the last round failed at a member and
    completed at the others, too few of them to confirm the record (one of two, a member dead):
    rejected by its deadline, then the round is redone with the reporter, as before. A coordinator
    whose own last round failed published no record: its retry does not wait."""
    run = run3
    member = run.others[1]
    plan, end = _span_reported_at_its_end(run, member)
    later = 11.5 + 2 * RETRY_BACKOFF_S
    own_failed = run.decide(later, my_step=end - 1)
    assert isinstance(own_failed, RoundPlan) and own_failed.step == end - 1, own_failed
    assert run.decide(later, my_step=end) is Hold.WAIT
    run.book.rejected_step = end  # the record had no quorum by its deadline (Attesting._settled)
    assert record_confirmed(run.book, later) == []
    retry = run.decide(later, my_step=end)
    assert isinstance(retry, RoundPlan), retry
    assert (retry.round, retry.attempt, retry.step) == (plan.round + plan.rounds - 1, plan.attempt + 1, end - 1)
    assert member in retry.members  # a split completion blames no one


def test_a_member_whose_own_last_round_failed_takes_the_confirmed_record_and_is_not_left_out(run3: Run) -> None:
    """The honest side of the drop (red team h-attack7): a member whose span's last round really
    failed (it completed at the others, who confirm the record) attests nothing. It learns it must
    load the record's state (on main it waited for a checkpoint of its own at that step, and ended
    the run one step short: tests/runtime/test_last_round_failure.py), and is not left out (on main
    it was, for the quarantine: a hostile ring neighbour that made its last hop time out got an
    honest member left out every span); a report of it after the record is not believed either.
    A reporter that attested the record is left out, as before."""
    run = run3
    member, liar = run.others[1], run.others[0]
    plan, end = _span_reported_at_its_end(run, member)
    report = _report(run, plan, plan.rounds - 1)
    assert run.book.note_failure_report(11.6, report, liar, run.c, coordinator=True)  # (split_problem: once each)
    assert not own_round_lost(run.book, member)  # the record is not confirmed yet: a retry may come
    _confirm(run, plan, end, (liar,))
    assert own_round_lost(run.book, member) and not own_round_lost(run.book, run.c)
    dropped = record_confirmed(run.book, 15.0)
    assert len(dropped) == 1 and short_id(liar) in dropped[0], dropped
    assert liar in run.book.quarantined(15.0) and member not in run.book.quarantined(15.0)
    assert run.book.failed_round is None and not own_round_lost(run.book, member)
    # Its report again (or first, after the record: its last hop timed out late): moot, not refused.
    assert refuse_report(run.book, 16.0, report, member) is None
    assert not run.book.note_failure_report(16.0, report, member, run.c, coordinator=True)
    assert member not in run.book.quarantined(16.0) and run.book.failed_round is None
