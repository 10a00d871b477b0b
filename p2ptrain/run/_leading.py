"""The control loop: the election's clock and view, and what the elected coordinator does.

Every member ticks its :class:`~p2ptrain.protocol.Election` (a fraction of a heartbeat, or
at once when woken: a span ended, a checkpoint was confirmed or rejected, a failure was reported).
While this member is coordinator it asks its :class:`~p2ptrain.protocol.RoundBook` for the
next plan, publishes it, and publishes the run's head (which also re-announces the task). The
decisions (who is alive, who stands, whether to plan now) are the state machines'; this module only
gathers their inputs from the node and carries out their outputs. That includes the arithmetic
each live peer advertises: a member whose class is not the run's does not stand, and the plans leave
it out (protocol/_arithmetics.py); both sides log that once and show it in ``task status``.
"""

from __future__ import annotations

import logging
import math

import trio
from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.run._attesting import Attesting
from p2ptrain.run._plan_intake import PlanIntake
from p2ptrain.run._resync import Resync
from p2ptrain.run._run_state import RunState
from p2ptrain.run._spans import Spans
from p2ptrain.control import Phase
from p2ptrain.protocol import ATTEST_TIMEOUT_S, Classes, ElectionMessage, Hold, receive_noting, term_candidate, View
from p2ptrain.wire import TASKS_TOPIC, TaskAnnounce, TaskHead

logger = logging.getLogger(__name__)

TICK_FRACTION = 0.25  # control-loop period, as a fraction of the heartbeat interval
HEAD_EVERY_S = 2.0  # how often the coordinator publishes the run's head (and re-announces the task)
# A cancelled member whose last span ended waits at most this long for that span's checkpoint to be
# confirmed before it stops: the record's own deadline (attestations.ATTEST_TIMEOUT_S, 20 s), after
# which the record is rejected anyway and the last confirmed model is the one kept.
CANCEL_SETTLE_S = ATTEST_TIMEOUT_S


class Leading:
    """Election ticks for every member; plans and heads while this member is the coordinator."""

    def __init__(self, run: RunState, spans: Spans, attesting: Attesting, resync: Resync, intake: PlanIntake) -> None:
        self.run = run
        self.intake = intake  # plans held until the election accepts their sender (settled here)
        self.spans = spans
        self.attesting = attesting
        self.resync = resync
        self._chain_cid: tuple[int, str] | None = None  # (chain version, CID of its bytes)
        self._idle_since: float | None = None  # when a cancelled run was first seen between spans

    async def on_election_message(self, sender: str, msg: ElectionMessage) -> None:
        """A vote request, vote or coordinator heartbeat from ``sender``: the election answers, while
        the run goes on here. Done, it votes no more: a member that missed the run's last record
        stood once its coordinator ended, the done members elected it, and it led a run with nothing
        left to plan, never done (tests/pipeline/test_pipelined_last_step.py); unelected, it asks
        for the run's head, which they answer (protocol/_trailing.py)."""
        run = self.run
        if run.done.is_set():
            return
        now = trio.current_time()
        before = run.election.coordinator
        # What it shows of the sender (a vote in an election we are in, a late vote for us, a
        # coordinator) goes into the participation ledger there: the simulations drive the same.
        outs = receive_noting(run.election, run.participation, now, sender, msg)
        run.save_ballots()  # before a vote leaves (see RunState.save_ballots)
        for out in outs:
            await run.node.publish(run.topic, out)
        self._note_coordinator(before, now)
        await self.intake.settle()  # a beat that carried a held plan's certificate: followed now

    def _note_coordinator(self, before: str | None, now: float) -> None:
        """Log a change of coordinator; remember when this member was elected (plan grace) and who
        leads each term (to check the records of chains heads name)."""
        election = self.run.election
        self.resync.note_coordinator()
        if election.coordinator != before and election.coordinator is not None:
            who = "this peer" if election.is_coordinator else short_id(election.coordinator)
            logger.info("%s: coordinator of term %d is %s", self.run.log_prefix, election.term, who)
            if election.is_coordinator and self.run.book is not None:
                self.run.book.note_elected(now)
                self._abandon_unrecorded()

    def _abandon_unrecorded(self) -> None:
        """Newly elected with no record pending: a checkpoint the previous coordinator stored but did
        not record gets no record any more; counted as rejected so the barrier opens
        (:meth:`~p2ptrain.protocol.RoundBook.abandon_unrecorded`)."""
        run = self.run
        if run.trainer is None or run.book is None or not run.synced or run.attestations.pending:
            return
        step = run.book.abandon_unrecorded(run.trainer.step)
        if step is not None:
            logger.warning("%s: the checkpoint at step %d has no record from the previous coordinator; "
                           "going on from model v%d", run.log_prefix, step, run.book.chain.version)

    def _abandon_inherited(self) -> None:
        """A coordinator elected while a span of an earlier term ran (its own rounds were past
        planning over, or the span was storing its checkpoint) sees that span end with a
        checkpoint its coordinator of that term will not record: it no longer leads, and only it
        could (:meth:`Attesting.checkpoint_stored`). At election there was nothing to abandon yet,
        so the barrier at that checkpoint waited forever (a pipelined run whose coordinator stepped
        down at step 3 of 8 stopped at step 8, version 0). Abandoned the same way once the span
        has ended here (:meth:`_abandon_unrecorded`: none pending, counted as rejected)."""
        run = self.run
        book, trainer = run.book, run.trainer
        last = book.last_plan if book is not None else None
        if last is None or trainer is None or last.term >= run.election.term or trainer.step != last.step + last.rounds:
            return
        self._abandon_unrecorded()

    def view(self) -> View:
        """What this node sees of its peers, for the election."""
        run = self.run
        now = trio.current_time()
        coordinator = run.election.coordinator
        discovery = run.node.discovery
        connected: frozenset[str] | None = None
        if discovery is not None:
            connected = frozenset(p for p in (coordinator,) if p and discovery.connected(ID.from_base58(p)))
        return View(
            heard=frozenset(record.peer_id.to_base58() for record in run.node.membership.alive()),
            advertising=frozenset(run.advertising()),
            gone=run.book.gone(now) if run.book is not None else frozenset(),
            connected=connected,
        )

    async def run_loop(self) -> None:
        run = self.run
        election = run.election
        period = run.node.config.heartbeat_interval * TICK_FRACTION
        last_head, head_version = -math.inf, -1
        while True:
            now = trio.current_time()
            head_members = run.heads.members if run.heads is not None else ()
            # A joiner that has seen no plan yet votes with the run's members from its head: with
            # the live peers instead it refused the coordinator's certificate (2 votes, a quorum of
            # its 4 live peers is 3) and stood for the term itself.
            roster = run.book.roster(run.me, head_members) if run.book is not None else tuple(head_members)
            before = election.coordinator
            classes = self._classes()
            # A member a pipelined step's summary blamed (a replica convicted, a driver failing alone)
            # leads no plan while its book leaves it out of them, as every member's does: a
            # coordinator steps down (run/_spans.py, _failed_here).
            left_out = run.book is not None and run.me in run.book.quarantined(now)
            may_lead = run.synced and (classes is None or classes.may_lead) and not left_out
            outs = election.tick(now, self.view(), roster, may_lead=may_lead)
            run.participation.note_sent(now, run.me, outs)
            run.save_ballots()
            for out in outs:
                await run.node.publish(run.topic, out)
            if election.given_up is not None and run.book is not None:
                # A coordinator that fell silent is most likely dead: a plan listing it would fail
                # on it (the mesh drops it only after 5 s). Left out like a peer a round named.
                run.book.note_silent_coordinator(now, election.given_up)
            self._note_coordinator(before, now)
            await self.intake.settle()  # held plans whose hold ended: reported
            self._judge_claim(now, classes)
            if election.is_coordinator and not self.spans.running:
                self._abandon_inherited()
            self._note_own_exclusion(classes)
            run.note_waiting(self._peers_short(classes, now), now,
                             run.book.convictions.out(now) if run.book is not None else {})
            await self.attesting.expire(now)
            if election.is_coordinator and run.synced and run.book is not None:
                await self._maybe_plan(now, classes)
                # Also at once when a checkpoint was confirmed: a member that the next plan lists
                # without its state catches up from this head.
                if now - last_head >= HEAD_EVERY_S or run.book.chain.version != head_version:
                    last_head, head_version = now, run.book.chain.version
                    await self._publish_head()
            if run.cancel_reason is not None and self.cancel_settled(now):
                run.phase = Phase.CANCELLED
                run.done.set()
                return
            await run.wake_leader.wait(period)

    def _classes(self) -> Classes | None:
        """The live advertisers' classes of arithmetic as this member sees them (None before its
        trainer exists), noted for ``task status`` (arithmetic_left_out, arithmetic_run)."""
        run = self.run
        if run.book is None or run.trainer is None:
            return None
        live = run.advertising()
        if run.class_of(run.me) not in run.barred:  # (a barred member counts itself no more than the others do)
            live.add(run.me)
        took_part = run.participation.took_part(trio.current_time())
        classes = run.book.classes(run.me, self._arithmetics(live), live, took_part)
        run.left_out, run.arithmetic_run = dict(classes.left_out), classes.run
        return classes

    def _judge_claim(self, now: float, classes: Classes | None) -> None:
        """Mark a term of a fresh run whose candidate was of the run's class and that passed without
        a plan; a class with too many such terms loses its claim (protocol/_class_claims.py): logged
        and counted (``class_claim_lapsed`` under ``rejected``)."""
        run = self.run
        if classes is None or run.book is None:
            return
        candidate = term_candidate(run.election)
        candidate_class = run.class_of(candidate) if candidate is not None else None
        lapsed = run.claims.tick(now, run.election.term, candidate_class, classes.run, fresh=not run.book.history())
        run.advertising()  # (the bars as they stand now)
        if lapsed is not None and lapsed in run.barred:
            run.rejected["class_claim_lapsed"] += 1
            logger.warning("%s: %s held this fresh run's class for %d more terms whose candidate was of it, and none "
                           "of its peers planned: it yields its claim, and its peers count neither as voters nor in the "
                           "census until a plan is taken or the next class failed as often (`p2ptrain docs security`, "
                           "\"Early voting Sybils\")", run.log_prefix, lapsed, run.claims.lapse_terms)

    def _arithmetics(self, live: set[str]) -> dict[str, str | None]:
        """What ``live`` peers advertise as their arithmetic, and the run's history members still
        heard that do not advertise the task now (done, or loading a checkpoint): they still decide
        the run's class (protocol/_arithmetics.py)."""
        run = self.run
        heard = {p for p in (run.book.history() if run.book is not None else ()) if run.arithmetic(p) is not None}
        return {p: run.arithmetic(p) for p in live | heard}

    def _note_own_exclusion(self, classes: Classes | None) -> None:
        """This member computes other bits than the run's class and the run's latest plan does
        not list it: say so once, with both arithmetics and what to do. It waits as a non-member
        (it does not stand, nor count in the members' elections and quorums) rather than spin."""
        run = self.run
        plan = run.book.accepted if run.book is not None else None
        if classes is None or plan is None or run.me in plan.members or run.me not in classes.left_out:
            return
        run.note_left_out(run.me, f"this member is left out of the run's plans: it computes with "
                          f"{run.arithmetic(run.me)}, the run's members with {classes.run}, other bits "
                          f"(`p2ptrain docs deploy`, \"Which machines compute the same bits\"); it waits as a non-member")

    def _peers_short(self, classes: Classes | None, now: float) -> int:
        """How many more peers the run needs now: for a quorum of the roster (no coordinator can be
        elected without it), or, between spans, for ``peers.min`` advertising members of the run's
        class (no span is planned with fewer) that no round or conviction left out for now (the
        book's quarantine: a run of exactly ``peers.min`` waits it out). 0 while a span runs, or
        while this member is not at the run's state."""
        run = self.run
        if not run.synced or self.spans.running or run.cancel_reason is not None:
            return 0
        live = classes.planned if classes is not None and run.me in classes.planned else run.advertising()
        out = run.book.quarantined(now) if run.book is not None else frozenset()
        return max(run.election.short_of_quorum, run.task.peers.min - len(set(live) - out))

    def cancel_settled(self, now: float) -> bool:
        """Whether a cancelled run may stop now: at a span boundary (no span of ours running), once
        the span's checkpoint is confirmed (our step is the chain's head) or CANCEL_SETTLE_S after
        the span ended; a span under way is never cut (its members would fail their rounds)."""
        run = self.run
        if self.spans.running:
            self._idle_since = None
            return False
        if self._idle_since is None:
            self._idle_since = now
        if run.trainer is None or run.book is None or not run.synced:
            return True  # nothing of ours to settle (still preparing, or resyncing)
        settled = run.trainer.step == run.book.head_step and not run.attestations.pending
        return settled or now - self._idle_since >= CANCEL_SETTLE_S

    async def _maybe_plan(self, now: float, classes: Classes | None) -> None:
        run = self.run
        trainer, book = run.require()
        membership = run.node.membership
        struck = run.participation.struck(now)
        for peer in book.silent_members(now) - {run.me}:
            run.participation.note_missed(now, peer)  # left out of the retry unless it took part lately
        for peer in sorted(run.participation.struck(now) - struck):  # (once per strike: a plan may wait on it)
            logger.info("%s: %s did not report the failure of round %s; not counted until it takes part "
                        "or its backoff ends", run.log_prefix, short_id(peer), book.failed_round)
        # Peers behind NATs (what their heartbeats say, and what we found of ourselves): the plan's
        # ring keeps them apart where it can (training.plans.ring_order).
        private = {r.peer_id.to_base58() for r in membership.alive() if r.reachability == "private"}
        if membership.reachability == "private":
            private.add(run.me)
        advertising = run.advertising()
        decision = book.decide(
            now, run.election, trainer.step, advertising, can_roll_back=trainer.can_roll_back,
            span_running=self.spans.running or self.spans.starting, rounds_running=self.spans.in_rounds,
            head_version=run.heads.version if run.heads is not None else 0, private=private,
            arithmetics=self._arithmetics(advertising), took_part=run.participation.took_part(now),
        )
        if decision is Hold.BEHIND:
            # Elected while behind the run (e.g. it joined at step 0 and missed the records): it
            # must not plan from its own stale state. Resync first; the next term picks another.
            logger.warning("%s: coordinator but behind the run; resyncing instead of planning", run.log_prefix)
            book.note_behind()
            run.desync(now)
            return
        if decision is Hold.WAIT:
            return
        plan = decision
        for peer, arithmetic in (classes.left_out.items() if classes is not None else ()):
            if peer != run.me and peer not in plan.members:
                run.note_left_out(peer, f"plans leave {short_id(peer)} out: it advertises "
                                  f"{arithmetic or 'no arithmetic (an older version, or its torch probe has not run yet)'}, "
                                  f"the run computes with {classes.run if classes else None} "
                                  f"(`p2ptrain docs deploy`, \"Which machines compute the same bits\")")
        logger.info("%s: plan rounds %d-%d (attempt %d) from step %d with %d members", run.log_prefix,
                    plan.round, plan.round + plan.rounds - 1, plan.attempt, plan.step, len(plan.members))
        await run.broadcast(plan)

    async def _publish_head(self) -> None:
        run = self.run
        _, book = run.require()
        chain = book.chain
        if self._chain_cid is None or self._chain_cid[0] != chain.version:
            # Stored once per confirmed version, not at every head (every HEAD_EVERY_S).
            cid = await trio.to_thread.run_sync(run.content.store.add_bytes, chain.to_bytes())
            self._chain_cid = (chain.version, cid)
        chain_cid = self._chain_cid[1]
        head = chain.records[-1].record if chain.records else None
        plan = book.last_plan
        msg = TaskHead(
            task_cid=run.task_cid, term=run.election.term, version=chain.version,
            step=head.step if head else 0, round=plan.round if plan else 0, total_steps=run.total_steps,
            chain_cid=chain_cid, model_cid=chain.head_cid,
            optimizer_cid=head.optimizer_cid if head else chain.head_cid,
            members=plan.members if plan else (), done=bool(head and head.step >= run.total_steps),
        )
        await run.node.publish(TASKS_TOPIC, msg)
        await run.node.publish(TASKS_TOPIC, TaskAnnounce(task_cid=run.task_cid, name=run.task.name))
        run.heads, run.head_sender = msg, run.me
