"""Round bookkeeping: who takes part, from which step, for how many rounds, and when to checkpoint.

Every member keeps a :class:`RoundBook` (the last plan it followed, the latest plan it saw, and the
confirmed chain), so when the coordinator dies the next one continues from its own state instead of
from scratch. All of it is pure: the node decides when to call it. The coordinator makes its plans
from it (p2ptrain/protocol/_planner.py: whether to plan now, and the plan).

Rules, and why:

- A plan covers a *span* of rounds, up to and including the next checkpoint round; members run its
  rounds back to back (round ``round + i`` starts at step ``step + i``). One pubsub message per span,
  not per round, keeps fast rounds clear of gossipsub's per-peer rate limit.
- A span ends with a checkpoint: the coordinator publishes a record and waits for its confirmation
  (or rejection) before the next plan (a barrier), so members still hold the checkpointed state when
  they attest.
- With ``[training] overlap_checkpoints = true`` the barrier moves one span later: every member
  takes its checkpoint's bytes (and the coordinator its evaluation) before the next span starts,
  and storing, the record, the attestations and the confirmation go on while the next span trains.
  At most one checkpoint is unsettled: the span after a checkpoint's span is not planned before it
  is confirmed or rejected (:meth:`RoundBook.settled_step`). While peers wait to join (and there is
  room) the coordinator keeps the barrier of a checkpoint, since joiners are admitted only at a
  confirmed head. A plan made while its start's checkpoint is unsettled names the latest confirmed
  model as its ``base_cid``/``version``: its ``step`` is then one span past that record's.
  A checkpoint that a coordinator of an earlier term stored but never recorded (it died first)
  gets no record any more (records come from the coordinator only): a new coordinator with no
  record pending counts it as rejected (:meth:`RoundBook.abandon_unrecorded`), or the barrier one
  span later would never open.
- When a member's all-reduce fails (a peer died) it stops and sends ``round_failed``; the
  coordinator answers with a retry plan: the failed round, next attempt, its start step, the live
  members. A member that already applied that round's step rolls it back (:meth:`Trainer.align`):
  nobody can be further ahead, because the next round's all-reduce needs everyone.
- Who a span's plan names, when joiners come in, how a new coordinator continues, and when to plan
  at all: p2ptrain/protocol/_planner.py.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from libp2p.crypto.keys import KeyPair

from p2ptrain.base import short_id
from p2ptrain.protocol import _planner
from p2ptrain.protocol._arithmetics import Classes
from p2ptrain.protocol._election import Election
from p2ptrain.protocol._failure_reports import believed
from p2ptrain.protocol._step_aborts import says_absent
from p2ptrain.protocol._planner import Hold
from p2ptrain.protocol._plans import follows_on, is_checkpoint, plan_order, rule_problem
from p2ptrain.protocol._lineage import Chain
from p2ptrain.protocol._quarantine import Convictions, exclude, until_later
from p2ptrain.protocol._records import certificate, sign_record
from p2ptrain.protocol._stage_costs import StageTimes
from p2ptrain.task import Task
from p2ptrain.wire import ModelRecord, RoundFailed, RoundPlan, SignedModelRecord, SignedVote

# After a failed round, the coordinator waits this long before it plans the retry, so the other members have left it.
RETRY_BACKOFF_S = 1.5
# Spans whose plans a member keeps for their records: the span under way, the one whose checkpoint
# may be unsettled (overlap mode), and two more for records that come late.
KEPT_SPAN_PLANS = 4


class RuleBreak(str):
    """A reason not to follow a plan that is also evidence against the coordinator that sent it
    (:meth:`RoundBook.rule_problem`): the member stops following that coordinator."""


@dataclass
class RoundBook:
    """What a member knows of the run: plans followed and seen, failures, the confirmed chain."""

    task: Task
    task_cid: str
    chain: Chain
    total_steps: int
    last_plan: RoundPlan | None = None  # the last plan this member followed
    observed: RoundPlan | None = None  # the latest plan seen on the topic, followed or not
    failure_rounds: dict[str, tuple[int, bool]] = field(default_factory=dict)  # believed: reporter -> earliest (round, absent)
    completed_round: int | None = None  # the latest round of last_plan completed here (_failure_reports.py)
    split_rounds: dict[str, int] = field(default_factory=dict)  # member -> round it reported failed, done here
    failed_at: float | None = None  # when the first report of it came (its own included): silent_members
    # The step of a checkpoint whose record was rejected: the barrier opens, training goes on, and
    # the next checkpoint tries again (joiners wait for a confirmed one).
    rejected_step: int | None = None
    # The coordinator's plan gating (see decide); kept across a resync (see resynced).
    failed_peers: dict[str, float] = field(default_factory=dict)  # peer -> left out of plans until
    # Peers a round found unreachable (a broken channel, a refused dial) -> until when: the election
    # counts them as dead at once, not when the mesh stops hearing them (5 s) or beats stop (3 s).
    gone_peers: dict[str, float] = field(default_factory=dict)
    convictions: Convictions = field(default_factory=Convictions)  # replicas convicted: out longer each time
    retry_after: float = 0.0  # a retry is not planned before then (RETRY_BACKOFF_S after a failure)
    elected_at: float | None = None  # when this member last became coordinator
    # A member of the current plan reported that it cannot take part: retry without it now.
    culprit_reported: bool = False
    # A member of the failed plan reported that it stands at the run's root, step 0 before the first
    # confirmed checkpoint (note_failure_report): the retry goes back there (planner's decide).
    root_reported: bool = False
    # Who made a failed plan go back to the root that way, once each in a run: a member that goes back
    # to the root follows the plan from it, so a second such report is a member failing rounds on
    # purpose (it could otherwise hold the run at v0 forever, never left out) and is a culprit again.
    root_reporters: set[str] = field(default_factory=set)
    # The plan seen on the topic (observed) that this member, as coordinator, last resynced for
    # (Hold.BEHIND, note_behind): at the run's root it plans rather than resync for it again.
    behind_for: RoundPlan | None = None
    # The task's publisher cancelled the run: no plan is made any more (the span under way ends).
    cancelled: bool = False
    # The elected coordinators' latest plan for each span, by the step the span ends at (followed or
    # only seen): a record of that span must name exactly its members, and its quorum counts them.
    span_plans: dict[int, RoundPlan] = field(default_factory=dict)
    # Plans of the elected coordinator that broke the rules, as (end step, term, attempt): no record
    # of theirs is believed, here or in a chain a head names.
    refused_spans: set[tuple[int, int, int]] = field(default_factory=set)
    accepted: RoundPlan | None = None  # the latest plan taken from an elected coordinator
    # The first step of the plans taken that left this member out (the run redoes its steps from there
    # without it), or the start of the plan it took before one that does not follow on it (holds_dropped).
    left_out_from: int | None = None
    stage_times: StageTimes = field(default_factory=StageTimes)  # by step: what plans from it weigh stages by

    @property
    def failed_round(self) -> int | None:
        """The earliest round of last_plan's attempt a believed report says failed, or None."""
        return min((k for k, _ in self.failure_rounds.values()), default=None)

    @property
    def head_step(self) -> int:
        """The step of the latest confirmed model (0 for the initial model)."""
        return self.chain.records[-1].record.step if self.chain.records else 0

    @property
    def overlap(self) -> bool:
        """Whether checkpoints settle while the next span trains (the task's ``overlap_checkpoints``)."""
        return bool(self.task.training.overlap_checkpoints)

    @property
    def settled_step(self) -> int:
        """The step of the latest checkpoint that is settled: confirmed (the chain's head) or rejected."""
        return max(self.head_step, self.rejected_step or 0)

    def previous_checkpoint(self, step: int) -> int:
        """The step of the last checkpoint before ``step`` (0, the initial model, for none): every
        ``checkpoint_interval`` steps, where spans end (:func:`~p2ptrain.protocol._plans.span_length`;
        a round ``r`` ends at step ``r + 1``)."""
        interval = self.task.training.checkpoint_interval
        return max(0, (step - 1) // interval * interval)

    def unsettled(self, my_step: int) -> int | None:
        """The step of this member's checkpoint that is neither confirmed nor rejected, or None: at
        ``my_step`` when a span just ended there, else the last one before it (overlap mode)."""
        if my_step > self.settled_step and is_checkpoint(self.task, my_step - 1, self.total_steps):
            return my_step
        previous = self.previous_checkpoint(my_step)
        return previous if previous > self.settled_step else None

    def abandon_unrecorded(self, my_step: int) -> int | None:
        """As a newly elected coordinator with no record pending: the checkpoint an earlier
        coordinator stored but did not record (it died between its span's end and its record) never
        gets a record (records are taken from the coordinator only), so it counts as rejected: the
        barrier opens and training goes on from the latest confirmed model. In either mode: without
        it the barrier at that checkpoint (one span later with overlap) waited forever. Returns its
        step, or None when there is none."""
        step = self.unsettled(my_step)
        if step is not None:
            self.rejected_step = step
        return step

    def end_of_run(self, me: str, trainer_step: int) -> str | None:
        """Whether the confirmed chain ends the run for this member: None while its last record is
        short of the run's last step; "done" when its trainer is at that step; "load" when the record
        was confirmed without it (a joiner not yet admitted when the last span ran): it loads the last
        checkpoint by CID first, or it would end naming a model it does not hold. None for a member of
        the last span short of its step: its last round runs, or failed here (run/_attesting.py,
        ``lost_span``: it loads); it ended "done" one step short (tests/runtime/test_last_round_failure.py)."""
        if not self.chain.records:
            return None
        last = self.chain.records[-1].record
        if last.step < self.total_steps:
            return None
        return "done" if trainer_step == last.step else None if me in last.members else "load"

    def roster(self, me: str, head_members: Sequence[str] = ()) -> tuple[str, ...]:
        """The voters to give :meth:`Election.tick`: the members of the last span we took part in;
        for a peer that is not among them (a joiner, or one dropped while away), the members of the
        latest plan seen on the topic; with no plan seen yet, ``head_members`` (the members the
        run's head names: with the live peers instead, a joiner refused the coordinator's
        certificate, 2 votes where a quorum of its 4 live peers is 3, and stood itself); without
        those, the members of the last record of our chain (a member that resumed its chain after
        a stop of the whole run: nobody publishes plans or heads, and a quorum of those members
        elects the run's next coordinator); none before the first span (then the live peers vote)."""
        if self.last_plan is not None and me in self.last_plan.members:
            return self.last_plan.members
        if self.observed is not None:
            return self.observed.members
        if head_members or not self.chain.records:
            return tuple(head_members)
        return self.chain.records[-1].record.members

    def resynced(self, chain: Chain) -> RoundBook:
        """The book of a member that loaded ``chain``'s head: plans and failures start afresh from
        it; the roster seen on the topic, the spans' plans and the plan gating's timers carry over."""
        return RoundBook(
            self.task, self.task_cid, chain, self.total_steps, observed=self.observed, convictions=self.convictions,
            failed_peers=self.failed_peers, gone_peers=self.gone_peers, retry_after=self.retry_after,
            elected_at=self.elected_at, culprit_reported=self.culprit_reported, cancelled=self.cancelled,
            span_plans=self.span_plans, refused_spans=self.refused_spans, accepted=self.accepted,
            behind_for=self.behind_for, root_reporters=self.root_reporters,
        )

    def note_behind(self) -> None:
        """As coordinator, this member resyncs instead of planning (:attr:`Hold.BEHIND`) while it
        saw :attr:`observed`: remembered across the resync (planner's ``_behind_observed``)."""
        self.behind_for = self.observed

    def span_members(self, record: ModelRecord) -> tuple[str, ...] | None:
        """The members of the plan that ``record``'s span ran under (the coordinator's latest plan
        for the span ending at its step, of its term and last round), or None when this member knows
        no such plan: then it cannot count the record's quorum, and does not take it up."""
        plan = self.span_plans.get(record.step)
        if plan is None or (plan.term, plan.attempt, plan.round + plan.rounds - 1) != (
                record.term, record.attempt, record.round):
            return None  # none, or another of the span's plans (a retry this member did not see)
        return plan.members

    def lineage_problem(self, records: Sequence[SignedModelRecord]) -> str | None:
        """Why records a head's chain adds cannot be taken, by what this member saw of their spans:
        a span whose plan it refused, or a record whose members are not its span's plan's."""
        for signed in records:
            r = signed.record
            if (r.step, r.term, r.attempt) in self.refused_spans:
                return f"model record v{r.version} ends a span whose plan broke the rules"
            members = self.span_members(r)
            if members is not None and tuple(r.members) != members:
                return f"model record v{r.version} names other members than its span's plan"
        return None

    # --- what the coordinator hears (inputs to decide) --------------------------------------------

    def note_elected(self, now: float) -> None:
        """This member became coordinator at ``now`` (the first plan waits FIRST_ROUND_GRACE_S)."""
        self.elected_at = now

    def note_round_failed(self, now: float, culprit: str | None = None, gone: bool = False) -> None:
        """A round failed here at ``now``: back off the retry; leave ``culprit`` (the peer the round
        blamed; ourselves only when a pipelined step's summary did) out of plans, and when ``gone``
        (unreachable) out of the election's live peers too, for FAILED_PEER_QUARANTINE_S."""
        if culprit is not None:
            exclude(self.failed_peers, culprit, now)
            if gone:
                exclude(self.gone_peers, culprit, now)
        self.retry_after = now + RETRY_BACKOFF_S

    def note_failure_report(self, now: float, report: RoundFailed, reporter: str, me: str, *, coordinator: bool) -> bool:
        """A ``round_failed`` from ``reporter`` (:meth:`report_failure`; True if it calls for a
        retry). As coordinator, a reporter that could not take part at all (:meth:`reporter_out_of_step`)
        is the culprit: left out of plans, and the retry is planned now (see decide's "stuck")."""
        if not self.report_failure(report, reporter):
            return False
        if self.failed_at is None:
            self.failed_at = now
        if coordinator and reporter != me and self.reporter_out_of_step(report):
            if not self.chain.records and report.step == 0 and reporter not in self.root_reporters:
                # Back at the run's root (run/_resync.py, load_root), with no checkpoint at the
                # plan's step to come to: it can follow a plan from the root, not this one.
                self.root_reporters.add(reporter)
                self.root_reported = True
            else:
                exclude(self.failed_peers, reporter, now)
            self.culprit_reported = True
        return True

    def note_silent_coordinator(self, now: float, peer: str) -> None:
        """The election gave up on coordinator ``peer`` (:attr:`Election.given_up`): most likely
        dead, and a plan listing it would fail on it (the mesh drops it only after 5 s)."""
        exclude(self.failed_peers, peer, now)

    def gone(self, now: float) -> frozenset[str]:
        """Peers a round found unreachable, still quarantined: for the election's View.gone."""
        return until_later(self.gone_peers, now)

    def quarantined(self, now: float) -> frozenset[str]:
        """Peers left out of plans at ``now`` (named in a failed round, or convicted as replicas)."""
        return until_later(self.failed_peers, now) | frozenset(self.convictions.out(now))

    def decide(
        self, now: float, election: Election, my_step: int, advertising: Collection[str], *,
        can_roll_back: bool, span_running: bool, rounds_running: bool, head_version: int,
        private: Collection[str] = (), arithmetics: Mapping[str, str | None] | None = None,
        took_part: Collection[str] | None = None,
    ) -> RoundPlan | Hold:
        """As coordinator at ``now``: the next plan to publish, or why none
        (:func:`~p2ptrain.protocol._planner.decide`)."""
        return _planner.decide(
            self, now, election, my_step, advertising, can_roll_back=can_roll_back, span_running=span_running,
            rounds_running=rounds_running, head_version=head_version, private=private, arithmetics=arithmetics,
            took_part=took_part,
        )

    def classes(
        self, me: str, arithmetics: Mapping[str, str | None], live: Collection[str] | None = None,
        took_part: Collection[str] | None = None,
    ) -> Classes:
        """The ``live`` peers' classes of arithmetic as ``me`` sees them
        (:func:`~p2ptrain.protocol._planner.classes_of`)."""
        return _planner.classes_of(self, me, arithmetics, live, took_part)

    def history(self) -> tuple[str, ...]:
        """The members whose class is the run's (:func:`~p2ptrain.protocol._planner.run_history`)."""
        return _planner.run_history(self)

    def report_failure(self, report: RoundFailed, reporter: str) -> bool:
        """Note ``reporter``'s ``round_failed`` for the current plan; True if it calls for a retry."""
        if not believed(self, report, reporter):
            return False  # (another plan's, or one not to believe: protocol/_failure_reports.py)
        said = (report.round, says_absent(report.reason))
        self.failure_rounds[reporter] = min(said, self.failure_rounds.get(reporter, said))
        return True

    def all_reported(self, excluding: Collection[str]) -> bool:
        """Whether every member of the failed plan but ``excluding`` (the culprits) reported the
        failure: then all have left the round, and the retry need not wait any longer."""
        last = self.last_plan
        return (
            last is not None and self.failed_round is not None
            and set(last.members) - set(excluding) <= self.failure_rounds.keys()
        )

    def silent_members(self, now: float) -> frozenset[str]:
        """Members of the failed plan that did not report its failure by the end of the retry's
        backoff: most likely never in the round at all (a peer that only advertised the task), so
        the coordinator counts it as their missed chance (:meth:`Participation.note_missed`).

        The backoff counts from the first report of this failure (:attr:`failed_at`), or from our
        own failure if later, never from :attr:`retry_after` alone: a report that came before our own
        round failed found an earlier failure's (0 for none), and every member yet to report was
        struck at once. A late joiner in its first span (no round nor vote to shield it) was, and the
        retry without it kept no quorum of the plan (3 of 4, a member dead): 60 s lost (issue 28)."""
        last = self.last_plan
        if last is None or self.failed_round is None or self.failed_at is None:
            return frozenset()
        if now < max(self.retry_after, self.failed_at + RETRY_BACKOFF_S):
            return frozenset()
        return frozenset(set(last.members) - self.failure_rounds.keys())

    def reporter_out_of_step(self, report: RoundFailed) -> bool:
        """Whether a report of the current plan comes from a member that could not take part at all
        (its step neither the failed round's nor the next: a state the run had left): the culprit."""
        last = self.last_plan
        if last is None:
            return False
        expected = last.step + (report.round - last.round)
        return report.step not in (expected, expected + 1)

    def next_plan(
        self, election: Election, my_step: int, live: Collection[str], can_roll_back: bool = False,
        private: Collection[str] = (),
    ) -> RoundPlan | None:
        """As coordinator at optimizer step ``my_step``: the next plan, or None
        (:func:`~p2ptrain.protocol._planner.next_plan`)."""
        return _planner.next_plan(self, election, my_step, live, can_roll_back, private)

    def rewinds(self, plan: RoundPlan, my_step: int) -> bool:
        """Whether ``plan`` takes this member, at ``my_step``, back to the confirmed checkpoint it
        starts from (:meth:`next_plan`: a stage lost every replica): a pipelined plan from this
        member's head of the chain, behind its step. It drops what it holds and loads its plan's
        stage from that checkpoint (run/_stages.py) instead of resyncing."""
        return (plan.stages is not None and plan.step == self.head_step < my_step
                and (plan.version, plan.base_cid) == (self.chain.version, self.chain.head_cid))

    def plan_problem(self, plan: RoundPlan, sender: str, election: Election) -> str | None:
        """Why a member should not follow ``plan``, or None. Records it as the last plan when followed.

        Every plan of this task that arrives should pass through here, also on peers that are not
        members: it is how a joiner learns the roster that elected the coordinator.
        """
        if plan.task_cid != self.task_cid:
            return "plan for another task"
        seen = self.observed
        if seen is None or plan_order(plan) > plan_order(seen):
            self.observed = plan
        if plan.term != election.term or sender != election.coordinator:
            return f"plan from {short_id(sender)} in term {plan.term}, not from the coordinator of term {election.term}"
        broken = self.rule_problem(plan)
        if broken is not None:
            self.refused_spans.add((plan.step + plan.rounds, plan.term, plan.attempt))
            return RuleBreak(broken)
        accepted = self.accepted
        if accepted is None or plan_order(plan) > plan_order(accepted):
            self.accepted = plan
            self.stage_times.forget_after(plan.step)  # the steps it redoes: their times here are a dropped attempt's
        self._note_span(plan)
        if election.me not in plan.members:
            self.left_out_from = min(plan.step, self.left_out_from if self.left_out_from is not None else plan.step)
            return "not a member of this span"
        last = self.last_plan
        if last is not None and plan_order(plan) <= plan_order(last):
            return f"plan {plan.term}/{plan.round}.{plan.attempt} is not after {last.term}/{last.round}.{last.attempt}"
        if last is not None and self.left_out_from is None and not follows_on(last, plan, self.chain.version, self.head_step):
            self.left_out_from = last.step  # a plan it never took may have redone what it applied since (holds_dropped)
        self.last_plan = plan
        self.failed_at, self.completed_round, self.failure_rounds = None, None, {}
        self.culprit_reported = self.root_reported = False  # they were about the plan this one supersedes
        return None

    def holds_dropped(self, plan: RoundPlan, my_step: int) -> bool:
        """Whether this member, at ``my_step``, holds steps the run dropped that ``plan`` (which names
        it) would build on: a plan it took left it out from a step ``s`` it had gone past (it applied
        an attempt that completed here and failed elsewhere; the retry redid ``s`` without it), or
        ``plan`` does not follow on the plan it took last, from ``s`` (a plan between them it never
        took: :func:`~p2ptrain.protocol._plans.follows_on`); the run's head is before ``my_step`` (its
        weights are its own), and ``plan`` starts past ``s`` (from ``s``, align rolls back): it resyncs."""
        return (s := self.left_out_from) is not None and my_step > max(s, self.head_step) and plan.step > s

    def rule_problem(self, plan: RoundPlan) -> str | None:
        """Why the elected coordinator's ``plan`` breaks the run's rules (:func:`~p2ptrain.protocol._plans.rule_problem`,
        against the latest plan accepted here, the stage times of the step it starts at and this chain's head)."""
        t = self.stage_times
        return rule_problem(self.task, self.total_steps, plan, self.accepted, t.for_plan(self.chain, plan.step, plan.version),
                            times_cut=t.cut_at(plan.step), head=(self.head_step, self.chain.version, self.chain.head_cid))

    def _note_span(self, plan: RoundPlan) -> None:
        """Remember ``plan`` as its span's (the latest for the step it ends at), for the record of
        that span; a few spans back are kept (at most one checkpoint is unsettled)."""
        end = plan.step + plan.rounds
        held = self.span_plans.get(end)
        if held is None or plan_order(plan) > plan_order(held):
            self.span_plans[end] = plan
        for step in sorted(self.span_plans)[:-KEPT_SPAN_PLANS]:
            del self.span_plans[step]
        for refused in sorted(self.refused_spans)[:-KEPT_SPAN_PLANS]:
            self.refused_spans.discard(refused)  # (end step first: the oldest spans go)

    def checkpoint_record(
        self, plan: RoundPlan, step: int, model_cid: str, optimizer_cid: str, metrics: dict[str, float],
        key_pair: KeyPair, votes: Sequence[SignedVote] = (),
    ) -> SignedModelRecord:
        """As coordinator, after the last round of a span: the signed record that extends the chain,
        carrying ``votes`` (this coordinator's certificate of ``plan``'s term) for whoever checks
        its election later.

        Non-finite metrics (a diverged evaluation) are left out: records are strict JSON.
        """
        record = ModelRecord(
            task_cid=self.task_cid, version=self.chain.version + 1, parent=self.chain.head_cid,
            round=plan.round + plan.rounds - 1, step=step, members=plan.members,
            metrics={k: float(v) for k, v in sorted(metrics.items()) if math.isfinite(v)},
            model_cid=model_cid, optimizer_cid=optimizer_cid, term=plan.term, coordinator="", attempt=plan.attempt,
        )
        return sign_record(record, key_pair, certificate(votes, plan.members))
