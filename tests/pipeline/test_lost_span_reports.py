"""A report of a pipelined span's last step once its record is confirmed (protocol/_failure_reports.py,
``held_after``), pure: three members' elections and books (tests/training/test_training_gating.py's
``Run``) on a task cut into two stages.

A data-parallel record is confirmed by a quorum of its span's members, possibly without one whose
last round failed there: such a reporter, which did not attest, is believed to have lost the round
(it loads the record) and is not left out. A pipelined record names a manifest gathered from every
member of the plan, each one's stage statement sent once its last round completed: no record comes
without every member, so a report of its span is false whoever attested. Fails on main: a liar
whose attestation was not among the quorum's was dropped uncounted and kept in the next plan
(tests/pipeline/test_pipelined_last_step.py plays it on real hosts)."""

from __future__ import annotations

from p2ptrain.protocol import record_confirmed, refuse_report
from p2ptrain.task import load_task
from p2ptrain.wire import RoundPlan
from tests.training.test_failure_reports import _confirm, _report, _span_reported_at_its_end
from tests.training.test_training_gating import Run

from .conftest import LM_TASK

TWO_STAGES = LM_TASK.replace("min = 4", "min = 2").replace("total_steps = 10", "total_steps = 20\ncheckpoint_interval = 4") \
    + "[pipeline]\nstages = 2\n"


def test_a_report_of_a_confirmed_pipelined_span_is_false_whoever_attested() -> None:
    run = Run(load_task(TWO_STAGES), "QmTask")
    liar, other = run.others
    plan, end = _span_reported_at_its_end(run, liar)  # believed until the record settles: a split, for all it can tell
    assert plan.stages is not None and len(plan.members) == 3
    # A quorum confirms the record without the liar's attestation (it sent none, or too late).
    _confirm(run, plan, end, (other,))
    dropped = record_confirmed(run.book, 15.0, run.c)
    assert len(dropped) == 1 and "stage statement" in dropped[0], dropped
    assert liar in run.book.quarantined(15.0) and other not in run.book.quarantined(15.0)
    assert run.book.failed_round is None
    following = run.decide(15.5, my_step=end)
    assert isinstance(following, RoundPlan) and liar not in following.members, following
    # A report of the confirmed span heard later is refused as it comes, from any member of it.
    problem = refuse_report(run.book, 16.0, _report(run, plan, plan.rounds - 1), other)
    assert problem is not None and "stage statement" in problem, problem
