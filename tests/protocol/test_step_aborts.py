"""protocol.StepAborts: which reports make a member leave its pipelined step, and only while it may.

The runtime (run/_stages.py) and a real run are tests/pipeline/test_unfollowed_plan.py's."""

from __future__ import annotations

from dataclasses import replace

from p2ptrain.protocol import CANNOT_FOLLOW, NO_TRAINING_DATA, OUT_OF_STEP, StepAborts
from p2ptrain.wire import RoundFailed, RoundPlan

CID = "QmT78zSuBmuS4z925WZfrqQ1qHaJ56DQaTfyMUF7F8ff5o"
ME, A, B, STRANGER = "me", "a", "b", "stranger"
PLAN = RoundPlan(task_cid=CID, term=2, round=4, attempt=1, step=4, rounds=2, members=(ME, A, B), base_cid=CID,
                 version=1, stages=(0, 1, 1))


def failed(round: int = 4, reason: str = f"{CANNOT_FOLLOW}: plan from x in term 2, not from the coordinator of term 1",
           **changes) -> RoundFailed:
    return replace(RoundFailed(task_cid=CID, term=2, round=round, attempt=1, step=4, reason=reason), **changes)


def test_a_member_that_takes_no_part_ends_the_step_this_member_is_in():
    aborts = StepAborts(ME)
    assert aborts.begin(PLAN, 0) is None
    assert aborts.report(PLAN, A, failed()) == A
    assert aborts.report(PLAN, B, failed()) == A  # the first one named
    assert aborts.begin(PLAN, 1) is None


def test_a_report_before_the_step_ends_it_as_it_begins():
    aborts = StepAborts(ME)
    assert aborts.report(PLAN, B, failed(round=5, reason=f"{OUT_OF_STEP}: at step 3")) is None
    assert aborts.begin(PLAN, 0) is None  # round 4: B said nothing of it
    assert aborts.begin(PLAN, 1) == B
    assert aborts.report(PLAN, A, failed(round=5, reason=f"{NO_TRAINING_DATA}: gone")) == B  # the first one named


def test_once_the_summary_opened_no_report_ends_the_step():
    """Every member joined the summary: this member may have sent its CONFIRM, and others may apply."""
    aborts = StepAborts(ME)
    aborts.begin(PLAN, 0)
    aborts.close()
    assert aborts.report(PLAN, A, failed()) is None
    assert aborts.begin(PLAN, 1) is None  # the report was of round 4: round 5 goes on


def test_only_a_member_of_the_plan_saying_it_takes_no_part_in_one_of_its_steps_counts():
    aborts = StepAborts(ME)
    aborts.begin(PLAN, 0)
    ignored = [
        (PLAN, STRANGER, failed()),  # not a member of the plan
        (PLAN, ME, failed()),  # our own report
        (PLAN, A, failed(reason="peer b failed: did not answer within the deadline")),  # it took part
        (PLAN, A, failed(term=1)),  # another plan's
        (PLAN, A, failed(attempt=0)),
        (PLAN, A, failed(task_cid="QmSgR48LyZPYQmSgR48LyZPYQmSgR48LyZPYQmSgR48LyZ")),
        (PLAN, A, failed(round=3)),  # not a step of the plan
        (PLAN, A, failed(round=6)),
        (replace(PLAN, stages=None), A, failed()),  # not a pipelined plan
        (None, A, failed()),
    ]
    assert [aborts.report(*args) for args in ignored] == [None] * len(ignored)
    assert aborts.begin(PLAN, 1) is None and aborts.begin(PLAN, 0) is None


def test_a_new_plan_starts_a_new_record():
    aborts = StepAborts(ME)
    aborts.report(PLAN, A, failed())
    retry = replace(PLAN, attempt=2, members=(ME, B), stages=(0, 1))
    assert aborts.begin(retry, 0) is None
    assert aborts.begin(PLAN, 0) is None  # that plan's record went with it
    assert aborts.report(retry, A, failed(attempt=2)) is None  # no longer a member
    # The record is of one plan: its steps at most, however many reports come.
    for i in range(100):
        aborts.report(retry, B, failed(attempt=2, round=4 + i % 2))
    assert len(aborts._absent) <= retry.rounds


def test_a_member_reporting_the_spans_last_round_failed_ends_the_checkpoint_gather_until_it_opens():
    """A split completion at the span's last step (round 5 of PLAN): the reporter never sends its stage
    statement, so no member completes the checkpoint gather; any reason counts there."""
    lost = failed(round=5, reason="peer b failed: the last hop timed out")
    aborts = StepAborts(ME)
    aborts.begin(PLAN, 1)
    assert aborts.report(PLAN, A, lost) is None  # its step: it took part (the summary decides)
    aborts.close()
    assert aborts.begin_checkpoint(PLAN) == A  # reported before this member got to the gather
    assert aborts.report(PLAN, B, lost) == A  # the first one named
    aborts.close()  # every member joined the gather (the report was false): it completes or fails alone
    assert aborts.report(PLAN, B, lost) is None
    fresh = StepAborts(ME)
    assert fresh.begin_checkpoint(PLAN) is None
    assert fresh.report(PLAN, A, failed(round=4, reason="peer b failed: x")) is None  # not the last round
    assert fresh.report(PLAN, STRANGER, lost) is None and fresh.report(PLAN, A, replace(lost, attempt=0)) is None
    assert fresh.report(PLAN, B, lost) == B
    assert fresh.begin_checkpoint(replace(PLAN, attempt=2)) is None  # the retry's gather: a new record
