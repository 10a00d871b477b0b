"""When a member leaves a pipelined step at once: a member of its plan said it takes no part in it.

A member that cannot follow a plan (it got the plan before it accepted its term's coordinator, it
is out of step, it has no training data) says so at once in a signed failure report (pubsub's strict
signing: the sender is the message's verified origin). A data-parallel round gives up on it after
its start timeout; a pipelined step waited for it at the step summary's join for ``STEP_TIMEOUT_S``
(120 s, so long because the drivers join only after their whole step), every member of the plan.
Now a member leaves the step at once when a member of the plan it follows says, for that plan's
term, attempt and that step's round, that it takes no part (:func:`says_absent`), and names it as
the step's culprit: the run's usual round failure then leaves it out of plans for the quarantine
(``RoundBook.note_round_failed``, and ``Participation.note_missed`` strikes a newcomer), and the
coordinator's retry runs without it, as a data-parallel round's does after a member is missing.

Why leaving is safe, and only until then: the step summary is a witnessed gather
(collective/_gather.py), and no member returns from it before every member's CONFIRM has arrived
(collective/_witness.py). A member that leaves before its summary's round has opened (before every
member has joined it, :meth:`StepAborts.close`) has sent no CONFIRM, and never will for that step,
so no member can complete the summary: none applies the step, every one drops it alike, and the
retry repeats it. After its round opened, a report no longer ends the step here (the reporter joined
it after all): it completes, or fails on its own deadlines, as any step does.

What a hostile member gains: nothing it could not do by never joining the summary (which costs the
others the 120 s), and it pays the same way. Only a member of the plan counts, for a step of that
plan, reporting its own absence; each report names its sender as the culprit, so every member that
left for it leaves it out of its next plans for the quarantine, and it can abort only a step it is
planned in. A member that keeps reporting is treated like any member that keeps failing rounds:
quarantined each time, struck only when it also took part in no round and cast no vote lately
(docs/security.md, "Step aborts").

The same holds for the checkpoint at a span's end, a gather of every member's signed stage
statement (run/_stage_checkpoints.py) that a member joins only once its last step completed: a
member of the plan that reports the span's last round failed (a split completion: the others
stepped, it did not) never sends its statement, so nobody can complete that gather either. The
others waited for it the gather's start timeout (15 s), and the coordinator's retry, planned at
once, failed at members still waiting there (not yet rolled back): one more retry. Now a member
leaves the gather when such a report comes before every member joined it
(:meth:`StepAborts.begin_checkpoint`), whatever the report's reason, if the reporter has not joined
it a grace later (run/_step_window.py): a false report, whose sender sent its statement after all,
ends nothing (it is judged once the record is confirmed), and a member that withholds its statement
could end the checkpoint anyway (at the cost of the others' start timeout).

Pure: the caller hands in the plan it follows, the reports and where its step stands; no clock is
needed (the quarantine's is the book's).
"""

from __future__ import annotations

from p2ptrain.wire import RoundFailed, RoundPlan

# How a failure report begins when its sender takes no part in the plan's rounds (run/_plan_intake.py,
# run/_resync.py and run/_spans.py write these): it cannot follow the plan, it is out of step, or it
# has no training data. A round that failed for any other reason says so otherwise ("peer X failed:
# ..."); such a report leaves no step here: its sender took part, and its collective's abort notice
# names whom it blames.
CANNOT_FOLLOW = "cannot follow this plan"
OUT_OF_STEP = "out of step"
NO_TRAINING_DATA = "no training data"
ABSENT_REASONS = (CANNOT_FOLLOW, OUT_OF_STEP, NO_TRAINING_DATA)


def says_absent(reason: str) -> bool:
    """Whether a failure report's ``reason`` says its sender takes no part in the plan's rounds."""
    return reason.startswith(ABSENT_REASONS)


class StepAborts:
    """One member's record of which members of the plan it follows said they take no part in which
    of its steps, and whether its own step may still be left (see the module docstring)."""

    def __init__(self, me: str) -> None:
        self.me = me
        self._plan: tuple[str, int, int, int] | None = None  # (task, term, first round, attempt): whose record
        self._absent: dict[int, str] = {}  # a round of that plan -> the first member that said it takes no part
        self._open: int | None = None  # the round of that plan whose step this member may still leave
        self._lost_last: str | None = None  # the first member of that plan that reported its last round failed
        self._gathering = False  # whether this member may still leave that plan's checkpoint gather

    def report(self, plan: RoundPlan | None, reporter: str, report: RoundFailed) -> str | None:
        """``reporter``'s signed failure report while this member follows ``plan`` (a pipelined plan:
        None or another plan counts nothing). Returns the member to name when this member must leave
        its step now: ``reporter``, a member of ``plan`` other than this one, said it takes no part in
        the step of ``report.round``, the one this member may still leave. A report for a step this
        member has not begun is kept for :meth:`begin`. While this member may still leave the checkpoint
        gather of ``plan`` (:meth:`begin_checkpoint`): the member to name when ``reporter`` reported the
        span's last round failed, for any reason."""
        if plan is None or plan.stages is None:
            return None
        if (report.task_cid, report.term, report.attempt) != (plan.task_cid, plan.term, plan.attempt):
            return None
        if reporter == self.me or reporter not in plan.members or not plan.round <= report.round < plan.round + plan.rounds:
            return None
        self._keep(plan)
        if report.round == plan.round + plan.rounds - 1 and self._lost_last is None:
            self._lost_last = reporter
        if self._gathering:
            return self._lost_last
        if not says_absent(report.reason):
            return None
        self._absent.setdefault(report.round, reporter)  # at most plan.rounds entries, one plan's
        return self._absent[report.round] if self._open == report.round else None

    def begin(self, plan: RoundPlan, index: int) -> str | None:
        """This member begins the step of round ``index`` of ``plan`` (in local-SGD mode, each of its
        passes): it may leave it until :meth:`close`. Returns the member that already said it takes
        no part in it (then leave at once, naming it), or None."""
        self._keep(plan)
        self._open = plan.round + index
        return self._absent.get(self._open)

    def begin_checkpoint(self, plan: RoundPlan) -> str | None:
        """This member's last step of ``plan``'s span completed and it joins the checkpoint's gather: it
        may leave it until :meth:`close`. Returns the member that already reported the span's last
        round failed (then leave at once, naming it), or None."""
        self._keep(plan)
        self._open, self._gathering = None, True
        return self._lost_last

    def close(self) -> None:
        """Every member joined this member's step summary or checkpoint gather (its round opened here,
        before this member sends anything in it): no report ends it any more."""
        self._open, self._gathering = None, False

    def _keep(self, plan: RoundPlan) -> None:
        """Keep the record of ``plan``: that of an earlier plan goes (its steps are not run again)."""
        key = (plan.task_cid, plan.term, plan.round, plan.attempt)
        if key != self._plan:
            self._plan, self._absent, self._open = key, {}, None
            self._lost_last, self._gathering = None, False
