"""Checkpoints: the coordinator's signed record of a span's model, every member's attestation of it,
and the confirmed chain on disk.

The counting (which record is pending, attestations that came before their record, the quorum,
the deadline) is the pure :class:`~p2ptrain.protocol.Attestations`; this module evaluates,
signs and publishes, and writes what was confirmed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable

import torch
import trio

from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.pipeline import PipelineError
from p2ptrain.base import short_id
from p2ptrain.run._datafeed import DataFeed
from p2ptrain.run._run_state import Nudge, RunState
from p2ptrain.protocol import (Fork, ForkAnswers, Misconduct, RecordError, Status, Tally, attest, election_problem,
                               own_round_lost, record_confirmed, record_id)
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.training import StateSnapshot
from p2ptrain.wire import ModelRecord, RoundPlan, SignedAttestation, SignedModelRecord

logger = logging.getLogger(__name__)


# The coordinator's record of a checkpoint waits for the one before it to settle (overlap mode: the
# next span's checkpoint can be stored first); it looks again at each settlement, and this often
# besides, since it also stops waiting when this member is no longer the plan's coordinator.
SETTLE_CHECK_S = 0.5
# Checkpoint CIDs kept for attesting: the one whose record may be pending and the one stored during
# the next span (at most one checkpoint is unsettled: training.rounds).
KEPT_CHECKPOINTS = 2


class Attesting:
    """Records and attestations of one run, and the coordinator's record at the end of a span."""

    def __init__(self, run: RunState, data: DataFeed) -> None:
        self.run = run
        self.data = data
        self.checkpoint_cids: dict[int, tuple[str, str]] = {}  # step -> (model CID, optimizer CID)
        # This member's round totals (rounds, compute, sync, apply seconds, bytes sent) at its last
        # checkpoint: the coordinator's record reports the span's means from them.
        self._totals_before = (0, 0.0, 0.0, 0.0, 0)
        self._settle_news = Nudge()  # a record was confirmed or rejected
        self._split_logged = 0  # the version of the last record whose split attestations were logged (_split)
        self._withheld = ""  # the id of the last record this member did not attest for its binding (logged once)
        self._answers = ForkAnswers()  # when a fork is answered with the record confirmed here and its proof

    def span_metrics(self, plan: RoundPlan) -> dict[str, float] | None:
        """At the end of ``plan``'s span, before the next one: as the coordinator of its term, the
        record's metrics known now (the last training loss, the span's round means; the evaluation
        comes next, :meth:`evaluate`); None for the other members."""
        run = self.run
        coordinator = run.election.is_coordinator and plan.term == run.election.term
        metrics = {"train_loss": run.metrics.get("train_loss", math.nan), **self._span_means()}
        self._totals_before = self._totals()
        return metrics if coordinator else None

    async def evaluate(self, metrics: dict[str, float], snapshot: StateSnapshot | None = None) -> None:
        """Add the test split's loss and accuracy to ``metrics``: of the trainer's weights now, or
        of ``snapshot``'s (overlap mode: the trainer is in the next span by then)."""
        run = self.run
        try:
            await self.data.fetch_test_split()
            metrics.update(await trio.to_thread.run_sync(self.data.evaluate, snapshot))
        except ContentUnavailable as exc:
            # Metrics are a report, not part of the model: publish without them rather than stall.
            logger.warning("%s: cannot evaluate (test data unavailable: %s)", run.log_prefix, exc)

    async def evaluate_through(
        self, metrics: dict[str, float],
        evaluate: Callable[[Iterable[tuple[torch.Tensor, torch.Tensor]]], Awaitable[dict[str, float]]],
    ) -> None:
        """A pipelined checkpoint's :meth:`evaluate`: the test split's loss and accuracy added to
        ``metrics`` by ``evaluate`` (the run's StageRounds.evaluate: through the stages), when the
        task has a test split and a replica of every stage answers in time."""
        run = self.run
        if run.task.dataset is None:
            return  # the members' own data: no member holds the whole model to evaluate on it
        try:
            await self.data.fetch_test_split()
            # Read from the store in a worker thread, as the data-parallel evaluation does (the split
            # is what this member holds already; its batches' tokens are small beside a model).
            batches = await trio.to_thread.run_sync(lambda: list(self.data.test_batches()))
            began = trio.current_time()
            metrics.update(await evaluate(batches))
            logger.info("%s: test split evaluated through the stages in %.0f ms", run.log_prefix,
                        1e3 * (trio.current_time() - began))
        except (ContentUnavailable, PipelineError) as exc:
            # Metrics are a report, not part of the model: publish without them rather than stall.
            logger.warning("%s: cannot evaluate through the stages (%s)", run.log_prefix, exc)

    async def checkpoint_stored(
        self, plan: RoundPlan, step: int, model_cid: str, optim_cid: str, metrics: dict[str, float] | None
    ) -> None:
        """Our state at the end of ``plan`` is stored: as its coordinator (``metrics`` from
        :meth:`span_metrics` and :meth:`evaluate`), publish the signed record once the checkpoint
        before it is settled; as a member, attest the record once it is here."""
        run = self.run
        self.checkpoint_cids[step] = (model_cid, optim_cid)
        for old in sorted(self.checkpoint_cids)[:-KEPT_CHECKPOINTS]:
            del self.checkpoint_cids[old]
        self._check_own_state()  # its record may have been confirmed before our state was hashed
        if run.book is not None and run.book.chain.records and run.book.chain.records[-1].record.step == step:
            self._end_if_over()
        if metrics is not None and await self._previous_settled(plan, step):
            _, book = run.require()
            signed = book.checkpoint_record(plan, step, model_cid, optim_cid, metrics, run.node.key_pair,
                                            votes=run.election.certificate)
            problem = election_problem(signed, book.chain.rules) if book.chain.rules is not None else None
            if problem is not None:
                # Our votes do not make a quorum of this span's members (members left since we were
                # elected, in overlap mode): nobody could check the record, so it is not published;
                # the checkpoint counts as rejected and the next one tries again.
                logger.warning("%s: not publishing the checkpoint at step %d: %s", run.log_prefix, step, problem)
                book.rejected_step = step
                self._settle_news.set()
                run.wake_leader.set()
            else:
                logger.info("%s: publishing model v%d %s (accuracy %s)", run.log_prefix, signed.record.version,
                            model_cid, _fmt(metrics.get("accuracy")))
                await run.broadcast(signed)  # our own copy comes back through on_record
        await self._attest_if_ready()

    async def _previous_settled(self, plan: RoundPlan, step: int) -> bool:
        """Wait until the checkpoint before ``step`` is confirmed or rejected (its record is the new
        one's parent); False when this member stopped being the coordinator of ``plan``'s term
        meanwhile (its record would be refused). At once without overlapping checkpoints: the
        barrier held the span until then."""
        run = self.run
        while run.election.is_coordinator and plan.term == run.election.term:
            _, book = run.require()
            pending = run.attestations.tally if run.attestations.pending else None
            # (a record of an earlier step still pending: a retried span's, after its first record
            # of that step was rejected; one record at a time, or members would keep the second open)
            if book.settled_step >= book.previous_checkpoint(step) and (pending is None or pending.record.step >= step):
                return True
            await self._settle_news.wait(SETTLE_CHECK_S)
        logger.info("%s: not publishing the checkpoint at step %d: no longer the coordinator of term %d",
                    run.log_prefix, step, plan.term)
        return False

    def _totals(self) -> tuple[int, float, float, float, int]:
        t = self.run.timings
        return (self.run.rounds_done, t.compute_s, t.sync_s, t.apply_s, self.run.bytes_sent)

    def _span_means(self) -> dict[str, float]:
        """The coordinator's mean round of the span (since its last checkpoint): compute, sync and
        apply seconds and bytes sent, for ``task report``. Four of the record's 16 metrics; none when
        it ran no round (a coordinator that just took over)."""
        now, before = self._totals(), self._totals_before
        rounds = now[0] - before[0]
        if rounds <= 0:
            return {}
        names = ("round_compute_s", "round_sync_s", "round_apply_s", "round_bytes_sent")
        return {name: round((now[i + 1] - before[i + 1]) / rounds, 6) for i, name in enumerate(names)}

    async def on_record(self, signed: SignedModelRecord, sender: str) -> None:
        """A record from ``sender`` (the mesh checked it published the message: a fork is answered
        only when the coordinator published it itself)."""
        run = self.run
        if run.book is None or not run.synced:
            return
        try:
            tally = run.attestations.offer_record(signed, run.book, run.election.coordinator, trio.current_time())
        except RecordError as exc:
            self._refused(signed, exc)
            if isinstance(exc, Fork):
                await self._answer_fork(signed, sender)
            return
        await self._settled(tally)
        await self._attest_if_ready()

    def _refused(self, signed: SignedModelRecord, exc: RecordError) -> None:
        """Count a refused record; one that breaks the run's rules (:class:`Misconduct`) signed by
        the coordinator we follow is evidence against it: we stop following it (a new term)."""
        run = self.run
        if run.book is not None and run.book.chain.holds(signed.record):
            return  # one we confirmed, sent again (a member's proof for a coordinator that missed it)
        if not isinstance(exc, Misconduct):
            logger.warning("%s: refused model record: %s", run.log_prefix, exc)
            if str(exc).startswith("gap") and signed.record.coordinator == run.election.coordinator:
                run.asking.note_later(signed.record.version)  # the run is past us: ask once it ends
            return
        run.refuse("record_rules", f"refused model record v{signed.record.version} of "
                   f"{short_id(signed.record.coordinator)}: {exc}")
        if signed.record.coordinator == run.election.coordinator:
            run.accuse(signed.record.coordinator, str(exc))

    async def _answer_fork(self, signed: SignedModelRecord, sender: str) -> None:
        """The coordinator we follow published a sibling of a record this member confirmed: it missed
        that record's quorum (its deadline passed first, or attestations were lost), which splits
        the run for good. Send it the attestations that confirmed the record, then the record
        (when :class:`ForkAnswers` says so): it counts them and confirms it after all."""
        run = self.run
        if run.book is None:
            return
        chain, record = run.book.chain, signed.record
        version = self._answers.due(chain, signed, sender, run.election.coordinator, trio.current_time())
        if version is None:
            return
        held, proof = chain.records[version - 1], chain.proofs[version - 1]
        logger.warning("%s: the coordinator %s published model record v%d (step %d) while this member confirmed "
                       "another v%d (step %d) with %d attestations: sending it that record and its proof",
                       run.log_prefix, short_id(record.coordinator), record.version, record.step,
                       record.version, held.record.step, len(proof))
        # The attestations first: a coordinator elected after the record takes it only as a proof,
        # confirmed by the attestations that came before it (Attestations._proven).
        for attestation in proof:
            await run.node.publish(run.topic, attestation)
        await run.node.publish(run.topic, held)

    async def _attest_if_ready(self) -> None:
        """Attest the records we owe once our own state is at their step (we hashed our weights),
        unless our state is a record's and an attestation of ours binds us to its sibling."""
        run = self.run
        for record in run.attestations.owed(run.me):
            cids = self.checkpoint_cids.get(record.step)
            if cids is None:
                continue  # our round is still running (checkpoint_stored calls us again), or long past
            now = trio.current_time()
            if cids == (record.model_cid, record.optimizer_cid):
                bound = run.attestations.bound_to(record, now)
                if bound is not None:
                    self._withhold(record, bound, now)
                    continue
                run.attestations.attesting(record, now)
            await run.broadcast(attest(record, cids[0], cids[1], run.node.key_pair))

    def _withhold(self, record: ModelRecord, bound: tuple[str, float], now: float) -> None:
        if self._withheld != record_id(record):
            self._withheld = record_id(record)
            logger.warning("%s: not attesting model record v%d (step %d): this member attested another v%d "
                           "%.0f s ago (record %s), which a quorum may still confirm elsewhere", self.run.log_prefix,
                           record.version, record.step, record.version, now - bound[1], bound[0][:12])

    async def on_attestation(self, signed: SignedAttestation) -> None:
        try:
            tally = self.run.attestations.add(signed, self.run.book)
        except RecordError as exc:
            logger.warning("%s: refused attestation: %s", self.run.log_prefix, exc)
            return
        logger.debug("%s: attestation of v%d from %s: %s", self.run.log_prefix, signed.attestation.version,
                     short_id(signed.attestation.attester), "early" if tally is None else tally.status.value)
        await self._settled(tally)
        await self._attest_if_ready()  # (one that ruled a record out frees the sibling it bound us from)

    async def expire(self, now: float) -> None:
        """A pending record short of a quorum of attestations by its deadline is rejected; a binding
        that lapsed lets this member attest what it withheld (each tick of the leader)."""
        await self._settled(self.run.attestations.expire(now))
        await self._attest_if_ready()

    async def _settled(self, tally: Tally | None) -> None:
        """Act on what counting decided: append a confirmed record, open the barrier on a rejection;
        then take up the record kept for after it (overlap mode) and attest it. An open record's
        late quorum goes to :meth:`_confirmed_late`."""
        run = self.run
        if tally is None or run.book is None:
            return
        if tally is not run.attestations.tally:
            await self._confirmed_late(tally)
            return
        status = tally.status
        if status is Status.CONFIRMED and run.book.chain.version < tally.record.version:
            self._confirm(tally)
        elif status is Status.REJECTED:
            run.book.rejected_step = tally.record.step
            self._outvoted(tally)
            self._split(tally)
            run.wake_leader.set()
        else:
            return
        self._settle_news.set()
        if run.attestations.next is None or run.book is None:
            return
        try:
            following = run.attestations.take_next(run.book, run.election.coordinator, trio.current_time())
        except RecordError as exc:
            logger.warning("%s: refused the model record kept for after v%d: %s", run.log_prefix,
                           tally.record.version, exc)
            return
        await self._settled(following)
        await self._attest_if_ready()

    async def _confirmed_late(self, tally: Tally) -> None:
        """An open record (one this member's deadline rejected, or one a member sent with its proof)
        reached its quorum: it is the run's record of its version, as wherever it was confirmed in
        time, and joins the chain if it still extends it. The pending sibling of that version (the
        coordinator's next checkpoint) is set aside: recorded again on the new head by its signer
        (:meth:`_record_again`), else its checkpoint counts as rejected."""
        run = self.run
        _, book = run.require()
        if tally.status is not Status.CONFIRMED or book.chain.version >= tally.record.version:
            return
        try:
            book.chain.check(tally.signed)
        except RecordError as exc:
            logger.info("%s: a late quorum for model record v%d that no longer extends the chain: %s",
                        run.log_prefix, tally.record.version, exc)
            return
        logger.warning("%s: model record v%d (step %d) confirmed late, after this member had gone on without it: "
                       "the run's v%d", run.log_prefix, tally.record.version, tally.record.step, tally.record.version)
        self._confirm(tally)
        sibling = run.attestations.confirmed_late(tally, book.chain.version)
        if sibling is not None:
            logger.warning("%s: model record v%d (step %d) set aside: the run confirmed another v%d",
                           run.log_prefix, sibling.record.version, sibling.record.step, sibling.record.version)
            if not await self._record_again(sibling):
                book.rejected_step = max(book.rejected_step or 0, sibling.record.step)
        self._settle_news.set()

    async def _record_again(self, sibling: Tally) -> bool:
        """As the coordinator that signed ``sibling`` (set aside for a record confirmed late): record
        its checkpoint again as the next version, on the new head. Counted as rejected instead, a
        last step's checkpoint was lost and the run never ended (test_last_round_failure, 2 members)."""
        run = self.run
        _, book = run.require()
        r, plan = sibling.record, book.span_plans.get(sibling.record.step)
        if r.coordinator != run.me or plan is None or book.span_members(r) is None or r.step <= book.head_step \
                or r.term != run.election.term or not run.election.is_coordinator:  # (span_members: its plan's)
            return False
        again = book.checkpoint_record(plan, r.step, r.model_cid, r.optimizer_cid, dict(r.metrics), run.node.key_pair,
                                       votes=run.election.certificate)
        logger.info("%s: recording the checkpoint at step %d again, as model v%d", run.log_prefix, r.step, again.record.version)
        await run.broadcast(again)  # our own copy comes back through on_record
        return True

    def _outvoted(self, tally: Tally) -> None:
        """A rejected record that a quorum of its plan's members computed otherwise (their signed
        attestations all name one other model): its coordinator stops leading. Members accuse it,
        as for a record that breaks the rules, since one that signs the plan's members and a model
        nobody trained would otherwise see every record rejected and lead on, the run confirming
        nothing; a coordinator that finds its own record outvoted (its state is not the span's)
        steps down. Counted once per coordinator (late attestations settle the tally again)."""
        run = self.run
        computed = tally.outvoted()
        record = tally.record
        if computed is None or record.coordinator != run.election.coordinator:
            return
        why = (f"model record v{record.version} names {record.model_cid}, but a quorum of its span's "
               f"{len(tally.members)} members computed {computed}")
        if record.coordinator == run.me:
            logger.warning("%s: %s; stepping down", run.log_prefix, why)
            run.election.step_down(trio.current_time())
            return
        run.refuse("record_outvoted", f"{why} (coordinator {short_id(record.coordinator)})")
        run.accuse(record.coordinator, why)

    def _split(self, tally: Tally) -> None:
        """A rejected record whose span's members hashed their weights to more than one model, none
        of them a quorum's: no checkpoint of such a span can ever be confirmed, and the usual cause is
        members whose steps round differently (docs/deploy.md, "Which machines compute the same
        bits"). Say which members computed what, with the arithmetic each advertises, once per record."""
        run = self.run
        if not tally.differing or tally.outvoted() is not None or tally.record.version == self._split_logged:
            return
        self._split_logged = tally.record.version
        # The record's model: its coordinator's own state (it signed it), and whoever attested it so far.
        groups: dict[str, list[str]] = {tally.record.model_cid: sorted({*tally.matching, tally.record.coordinator})}
        for attester, cid in sorted(tally.differing.items()):
            groups.setdefault(cid, []).append(attester)

        def who(peer: str) -> str:
            return f"{short_id(peer)} ({run.arithmetic(peer) or 'arithmetic not advertised'})"

        run.refuse("attestations_split",
                   f"model record v{tally.record.version} rejected: its span's {len(tally.members)} members computed "
                   f"{len(groups)} different models, none by a quorum: "
                   + "; ".join(f"{cid}: {', '.join(map(who, peers))}" for cid, peers in groups.items() if peers)
                   + " (members must compute the same bits: `p2ptrain docs deploy`, \"Which machines compute the same bits\")")

    def _confirm(self, tally: Tally) -> None:
        run = self.run
        _, book = run.require()
        book.chain.append(tally.signed, tuple(tally.matching.values()))
        lost = own_round_lost(book, run.me)  # (before record_confirmed drops our own report)
        for false in record_confirmed(book, trio.current_time(), run.me):  # (a retry behind it: protocol/_failure_reports.py)
            run.refuse("failure_report", f"dropped a failure report: {false}")
        record = tally.record
        run.metrics.update(record.metrics)
        run.save_chain()
        logger.info(
            "%s: model v%d confirmed by %d/%d members: %s (round %d, step %d, accuracy %s)",
            run.log_prefix, record.version, len(tally.matching), len(tally.members), record.model_cid,
            record.round, record.step, _fmt(record.metrics.get("accuracy")),
        )
        if lost:
            self.lost_span()
        self._check_own_state()
        self._end_if_over()
        run.wake_leader.set()

    def lost_span(self) -> None:
        """This member's round of the span whose record the chain's head is failed here, and a quorum
        of the span's members confirmed that record: no retry comes (``own_round_lost``). It stops
        advertising and loads the record's state by CID (run/_resync.py) before it trains on or
        ends; before, it waited for a checkpoint of its own that never came, and ended "done" one
        step short (tests/runtime/test_last_round_failure.py)."""
        run = self.run
        _, book = run.require()
        record = book.chain.records[-1].record
        logger.warning("%s: this member's last round of the span to step %d failed here, and its record (model v%d) "
                       "was confirmed by the others: loading it", run.log_prefix, record.step, record.version)
        run.mark_stale(record.step, trio.current_time())

    def _end_if_over(self) -> None:
        """End the run once its last checkpoint is confirmed (:meth:`RunState.end_if_over`); a member
        of its span once its own state of it is hashed too (:meth:`checkpoint_stored` calls again)."""
        run = self.run
        _, book = run.require()
        last = book.chain.records[-1].record
        if run.me in last.members and last.step not in self.checkpoint_cids \
                and not isinstance(run.trainer, StagedTrainer):
            return
        run.end_if_over()

    def _check_own_state(self) -> None:
        """A member whose own checkpoint at the last confirmed step is not the confirmed one (a quorum
        attested other bits: its optimizer steps round differently, e.g. torch's scalar CPU kernels
        among vectorized ones, training/_arithmetic.py) would go on from weights of its own and never
        attest again, while its status named the run's model. It says so, stops advertising, and
        loads the confirmed state by CID (run/_resync.py) before it trains on or ends. A pipelined
        run's stages are checked by their replicas instead (run/_stage_checkpoints.py)."""
        run = self.run
        if run.book is None or run.trainer is None or isinstance(run.trainer, StagedTrainer) \
                or not run.book.chain.records:
            return
        record = run.book.chain.records[-1].record
        own = self.checkpoint_cids.get(record.step)
        if own is None or own == (record.model_cid, record.optimizer_cid):
            return
        del self.checkpoint_cids[record.step]  # not our state at that step once we load the confirmed one
        run.refuse("own_state_differs",
                   f"this member's state at step {record.step} ({own[0]}) is not the confirmed model "
                   f"v{record.version} ({record.model_cid}): its steps round differently from the quorum's "
                   f"(this member: {run.arithmetic(run.me)}; its coordinator {short_id(record.coordinator)}: "
                   f"{run.arithmetic(record.coordinator) or 'not advertised'}; `p2ptrain docs deploy`, \"Which "
                   f"machines compute the same bits\"); loading the confirmed state")
        run.mark_stale(record.step, trio.current_time())

def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
