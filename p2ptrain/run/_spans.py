"""Running the plans this member follows: a span's rounds back to back, then its checkpoint.

Each round is :func:`p2ptrain.training.run_round` (local gradient in a worker thread, the
sparse ring all-reduce, the identical optimizer step). In local-SGD mode the same call is H inner
steps, the all-reduce of the pseudo-gradient and the outer step (the trainer's, see
:mod:`p2ptrain.training._local_sgd`), so a span's rounds, its checkpoint and everything after are
counted in outer steps; only the wait for the members to join a round is the task's
``outer.wait_s`` (:func:`round_start_timeout`). A newer plan (a retry, a new coordinator's
plan) cancels the span that runs: a round still waiting on a dead or absent peer would otherwise
hold this member until its start timeout. At the end of a span the model and optimizer state are
stored by CID and handed to :class:`~p2ptrain.run._attesting.Attesting`: before the next span,
or with ``[training] overlap_checkpoints`` from a copy taken before it, while it trains
(docs/training.md, "Overlapping checkpoints").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import trio
from libp2p.peer.id import ID

from p2ptrain.collective import CollectiveError, Misbehaved, PeerFailed
from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.base import fmt_bytes, fmt_s
from p2ptrain.run._attesting import Attesting
from p2ptrain.run._buffers import combine_buffers
from p2ptrain.run._datafeed import DataFeed
from p2ptrain.run._feedback_file import load_feedback, save_feedback
from p2ptrain.run._run_state import RunState
from p2ptrain.run._stage_copies import keep_stage_copies
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.run._stages import StageRounds
from p2ptrain.pipeline import PipelineError
from p2ptrain.protocol import (buffers_round_id, NO_TRAINING_DATA, OUT_OF_STEP, round_completed, round_id, shard_of,
                               span_confirmed)
from p2ptrain.training import Average, PlanAverager, StateSnapshot, TrainerError, run_round
from p2ptrain.task import Task
from p2ptrain.wire import RoundPlan

logger = logging.getLogger(__name__)

# One hop of the all-reduce (a chunk to the next member) must arrive within this.
HOP_TIMEOUT_S = 5.0
# Members start a round at different times (compute, plan latency): a round waits this long for all.
START_TIMEOUT_S = 15.0
# Plans queued for the round loop; a newer one supersedes the queued ones, so a few suffice.
PLAN_QUEUE = 64
# A load of another state waits this long (or a local-SGD round's ``outer.wait_s``, if longer) for the
# span it stopped to end: its worker thread ends its step, and a checkpoint under way ends first.
SPAN_END_WAIT_S = 2 * START_TIMEOUT_S


def round_start_timeout(task: Task) -> float:
    """How long a round waits for every member to join: START_TIMEOUT_S, or in local-SGD mode the
    task's ``outer.wait_s`` (members join after H inner steps each; a member later than that is
    left out: the others' round fails naming it, and the retry goes on without it)."""
    if task.training.local_sgd and task.outer is not None:
        return task.outer.wait_s
    return START_TIMEOUT_S


class Spans:
    """The round loop: takes followed plans, runs their rounds, stores each span's checkpoint."""

    def __init__(self, run: RunState, data: DataFeed, attesting: Attesting) -> None:
        self.run = run
        self.data = data
        self.attesting = attesting
        self.averager = PlanAverager(run.task, run.collective, timeout=HOP_TIMEOUT_S,
                                     start_timeout=round_start_timeout(run.task))
        self._plans_send, self._plans_recv = trio.open_memory_channel[RoundPlan](PLAN_QUEUE)
        # Open while this member is in a span's rounds: a newer plan cancels it (see follow).
        self._scope: trio.CancelScope | None = None
        self.running = False  # a span is under way (its rounds, or its checkpoint until it may overlap)
        self._queued = 0  # plans followed that the round loop has not taken up yet (see starting)
        # Held by a span from its start to its end and by a load of another state (hold_trainer).
        self._trainer_lock = trio.Lock()
        self._settling: trio.Nursery | None = None  # run_loop's, for checkpoints that settle meanwhile
        # A pipelined task's rounds: each member serves its plan's stage (run/_stages.py).
        self.stages = None if run.task.pipeline is None else StageRounds(
            run, hop_timeout=HOP_TIMEOUT_S, start_timeout=START_TIMEOUT_S)

    @property
    def starting(self) -> bool:
        """Whether a plan this member follows waits for the round loop to take it up: for the
        coordinator's planner its span is under way. Before, a coordinator that planned the retry
        of its span's last round (its record rejected) was still at the span's end until the loop
        rolled its trainer back, planned the next span over the retry at once (the rejected
        checkpoint opened the barrier), and the reporter, a step short, could not follow it: both
        went back to the run's last checkpoint (tests/runtime/test_last_round_failure.py)."""
        return self._queued > 0

    @property
    def in_rounds(self) -> bool:
        """Whether this member is inside a span's rounds (where a newer plan cancels it)."""
        return self._scope is not None

    def follow(self, plan: RoundPlan) -> None:
        """Hand a plan this member follows to the round loop; stop the span it supersedes."""
        try:
            self._plans_send.send_nowait(plan)
        except trio.WouldBlock:
            logger.warning("%s: plan queue full; dropped plan %d.%d", self.run.log_prefix, plan.round, plan.attempt)
            return
        self._queued += 1
        self.stop_rounds()

    def stop_rounds(self) -> None:
        """End the rounds of the running span now (their state is kept: the error feedback commits
        only after a round succeeds, the pending gradient stays for the retry)."""
        if self._scope is not None:
            self._scope.cancel()

    async def run_loop(self) -> None:
        # Checkpoints settling (stored, recorded, attested) while the next span trains (overlap
        # mode): tasks of this nursery, cancelled with the run. At most two at once: the barrier
        # plans no span while a checkpoint before the last one is unsettled (training.rounds).
        async with trio.open_nursery() as settling:
            self._settling = settling
            async for plan in self._plans_recv:
                async with self._trainer_lock:  # after a load under way (hold_trainer)
                    while True:  # a newer plan supersedes queued older ones
                        try:
                            plan = self._plans_recv.receive_nowait()
                        except trio.WouldBlock:
                            break
                    self.running, self._queued = True, 0
                    try:
                        await self._run_span(plan)
                    finally:
                        self.running = False
                        self.run.wake_leader.set()

    @asynccontextmanager
    async def hold_trainer(self) -> AsyncIterator[None]:
        """The trainer to a load of another state alone (run/_resync.py): a span under way is stopped
        (its rounds, as a newer plan stops them) and ends first, and none starts until the load is done.

        A round computes and applies in a worker thread: a state loaded meanwhile was torn (a step's
        weights and the checkpoint's step), or undone (local SGD sets back the weights it started
        from), or a pipelined stage freed under its step. TrainerError when the span has not ended
        within SPAN_END_WAIT_S (the resync tries again; a plan it catches up to is told it cannot)."""
        self.stop_rounds()
        wait, held = max(SPAN_END_WAIT_S, round_start_timeout(self.run.task)), False
        with trio.move_on_after(wait):
            await self._trainer_lock.acquire()
            held = True
        if not held:
            raise TrainerError(f"a span of this member still runs on its trainer after {fmt_s(wait)}")
        try:
            yield
        finally:
            self._trainer_lock.release()

    async def _run_span(self, plan: RoundPlan) -> None:
        """The plan's rounds back to back, then its checkpoint; a newer plan or a failure ends it."""
        run = self.run
        trainer, book = run.require()
        try:
            if isinstance(trainer, StagedTrainer) and not trainer.can_align(plan.step) \
                    and book.rewinds(plan, trainer.step):
                # A stage lost every replica: every stage goes back to the plan's checkpoint, and
                # take() loads this member's stage of it by CID (the steps since are redone).
                logger.warning("%s: back from step %d to model v%d (step %d): a stage lost every replica",
                               run.log_prefix, trainer.step, plan.version, plan.step)
                trainer.back_to(plan.step)
            trainer.align(plan.step)
            if self.stages is not None:
                await self.stages.take(plan)
        except TrainerError as exc:
            logger.warning("%s: out of step (%s); resyncing from the latest confirmed model", run.log_prefix, exc)
            run.desync(trio.current_time())
            # The other members would wait for us until their start timeout: say so at once.
            await run.report_failure(plan, 0, f"{OUT_OF_STEP}: {exc}")
            return
        batches: Iterator[Any] = iter(())  # a pipelined run's later stages read no data
        if self.stages is None or self.stages.stage_of(plan) == 0:
            rank, world = shard_of(plan, run.me)
            try:
                batches = await self.data.training_batches(rank, world, trainer.batch_position)
            except ContentUnavailable as exc:
                logger.warning("%s: cannot get my shards for rank %d of %d: %s", run.log_prefix, rank, world, exc)
                await run.report_failure(plan, 0, f"{NO_TRAINING_DATA}: {exc}")
                return
        average = self.averager.for_plan(plan)
        index = 0
        began, sent_before, step_before = trio.current_time(), run.bytes_sent, trainer.step
        scope = self._scope = trio.CancelScope()
        try:
            with scope:
                for index in range(plan.rounds):
                    if run.require()[1].last_plan is not plan:
                        return  # superseded (a retry, or a new coordinator's plan): the loop takes it up
                    if not await self._run_round(plan, index, batches, average):
                        return
        finally:
            self._scope = None
        if scope.cancelled_caught:
            logger.info("%s: round %d (attempt %d) stopped: a newer plan supersedes it", run.log_prefix,
                        plan.round + index, plan.attempt)
            return
        logger.info("%s: span of rounds %d-%d (steps %d-%d) done with %d peers in %s: loss %.4f, %s sent",
                    run.log_prefix, plan.round, plan.round + plan.rounds - 1, step_before + 1, trainer.step,
                    len(plan.members), fmt_s(trio.current_time() - began), run.metrics.get("train_loss", float("nan")),
                    fmt_bytes(run.bytes_sent - sent_before))
        await self._checkpoint(plan)

    async def _run_round(self, plan: RoundPlan, index: int, batches: Iterator[Any], average: Average) -> bool:
        run = self.run
        trainer, _ = run.require()
        try:
            if self.stages is not None:
                result = await self.stages.step(plan, index, batches)
            else:
                result = await run_round(trainer, batches, average, round_id(plan, index), run.timings)
        except (CollectiveError, PipelineError) as exc:
            if self._failed_here(exc):
                run.wake_leader.set()  # the election may act on it now (a dead coordinator)
            logger.warning("%s: round %d (attempt %d) failed: %s", run.log_prefix, plan.round + index,
                           plan.attempt, exc)
            await run.report_failure(plan, index, str(exc))
            if span_confirmed(run.require()[1], plan):
                # The others completed it and confirmed the span's record before our round failed
                # (its last hop timed out here): no retry comes; take the record's state.
                self.attesting.lost_span()
            return False
        timings = run.timings
        stats = run.collective.last_round
        sent = stats.bytes_sent if stats else 0
        run.bytes_sent += sent
        run.bytes_received += stats.bytes_received if stats else 0
        run.rounds_done += 1
        run.participation.note_round(trio.current_time(), plan.members)
        for false in round_completed(run.require()[1], trio.current_time(), plan, plan.round + index):
            run.refuse("failure_report", f"dropped a failure report: {false}")  # (protocol/_failure_reports.py)
        run.metrics["train_loss"] = result.local_loss
        run.round_seconds.observe(timings.last_compute_s, timings.last_sync_s, timings.last_apply_s)
        logger.debug(
            "%s: round %d step %d done with %d peers: compute %.0f ms, sync %.0f ms, apply %.0f ms "
            "(loss %.4f, %s sent)",
            run.log_prefix, plan.round + index, result.step, len(plan.members), 1e3 * timings.last_compute_s,
            1e3 * timings.last_sync_s, 1e3 * timings.last_apply_s, result.local_loss, fmt_bytes(sent),
        )
        return True

    async def _checkpoint(self, plan: RoundPlan) -> None:
        """Take this member's state at the end of ``plan`` and store it by CID for the span's record
        (as coordinator, with its evaluation) and our attestation: before the next span in the
        default mode; with ``overlap_checkpoints`` the next span starts once the state is copied
        (:meth:`Trainer.snapshot`), and the evaluation, storing and the record happen meanwhile."""
        run = self.run
        trainer, book = run.require()
        step = trainer.step
        try:
            if self.stages is not None:
                cid = await self.stages.checkpoint(plan)
                if cid is not None:
                    # The record names the stages' manifest; no member holds the whole model, so the
                    # coordinator evaluates through the stages (docs/pipeline.md, "Test metrics").
                    metrics = self.attesting.span_metrics(plan)
                    if metrics is not None:
                        await self.attesting.evaluate_through(metrics, functools.partial(self.stages.evaluate, plan))
                    await self.attesting.checkpoint_stored(plan, step, cid, cid, metrics)
                    if self._settling is not None:  # while the next span trains (run/_stage_copies.py)
                        self._settling.start_soon(keep_stage_copies, run, cid, self.stages.stage_of(plan))
                    return
            elif await self._average_buffers(plan):
                await self._take_checkpoint(plan)
                return
            book.rejected_step = step  # no checkpoint this span: the barrier opens, the next tries again
            run.wake_leader.set()
        finally:
            trainer.release_span()  # a user's loop waits for this (training/_user_trainer.py)

    async def _average_buffers(self, plan: RoundPlan) -> bool:
        """Combine the members' buffers (BatchNorm's running statistics: each member's come from its
        own data) over the span's ring (run/_buffers.py: the mean, or under ``robust = "clip"`` the
        coordinate-wise median), so that the checkpoint every member hashes is the same; False when
        that round failed (this span then has no checkpoint, and a member it named is left out of
        later plans, as after a failed round). Models without buffers (the registry's) skip it."""
        run = self.run
        trainer, _ = run.require()
        flat = trainer.buffer_vector()
        if flat is None or len(plan.members) < 2:
            return True
        ring = [ID.from_base58(p) for p in plan.members]
        try:
            combined = await combine_buffers(run.collective, flat, ring, buffers_round_id(plan),
                                             robust=run.task.compression.robust, timeout=HOP_TIMEOUT_S,
                                             start_timeout=START_TIMEOUT_S)
        except CollectiveError as exc:
            self._failed_here(exc)
            logger.warning("%s: combining the buffers at step %d failed (%s); no checkpoint this span",
                           run.log_prefix, trainer.step, exc)
            return False
        trainer.load_buffer_vector(combined)
        return True

    def _failed_here(self, exc: CollectiveError | PipelineError) -> bool:
        """A round of ours (a step's, or the buffers' at a span's end) failed here: the book backs
        off the retry and leaves out the peer the failure named, whose chance that was if it was new
        (Participation.note_missed). True when that peer is gone (unreachable). Ourselves only where
        a pipelined step's summary blamed us (a replica convicted, a driver failing alone), as every
        other member's book does: we then lead no plan for the quarantine (run/_leading.py). Before,
        a coordinator so blamed planned the retry with itself at once, never left out."""
        run = self.run
        _, book = run.require()
        now = trio.current_time()
        culprit, gone = None, False
        if isinstance(exc, PeerFailed) and exc.peer_id != run.node.peer_id:
            culprit, gone = exc.peer_id.to_base58(), exc.gone
        elif isinstance(exc, Misbehaved) and self.stages is not None:
            culprit = run.me
        book.note_round_failed(now, culprit, gone)
        if culprit is not None and culprit != run.me:
            run.participation.note_missed(now, culprit)
        return gone

    async def _take_checkpoint(self, plan: RoundPlan) -> None:
        run = self.run
        trainer, _ = run.require()
        step = trainer.step
        metrics = self.attesting.span_metrics(plan)
        residual = self.averager.feedback_state()  # a copy: the next span changes the residual
        if run.task.training.overlap_checkpoints and self._settling is not None:
            # In a thread: copying a model and its optimizer state (205 MB at 17.1 M parameters with
            # Adam) would stall this host's part in the others' traffic.
            began = trio.current_time()
            snapshot = await trio.to_thread.run_sync(trainer.snapshot)
            logger.info("%s: checkpoint at step %d: state copied in %s; storing it while the next span trains",
                        run.log_prefix, step, fmt_s(trio.current_time() - began))
            self._settling.start_soon(self._settle, plan, snapshot, residual, metrics)
        else:
            if metrics is not None:
                await self.attesting.evaluate(metrics)
            model_cid, optim_cid = await self._store(step, trainer.model_bytes, trainer.optimizer_bytes, residual)
            await self.attesting.checkpoint_stored(plan, step, model_cid, optim_cid, metrics)

    async def _settle(self, plan: RoundPlan, snapshot: StateSnapshot, residual: torch.Tensor | None,
                      metrics: dict[str, float] | None) -> None:
        """Overlap mode, in the round loop's nursery: evaluate the snapshot (coordinator), store it,
        then the record and attestations (:meth:`Attesting.checkpoint_stored`)."""
        if metrics is not None:
            await self.attesting.evaluate(metrics, snapshot)
        step = snapshot.step
        model_cid, optim_cid = await self._store(step, snapshot.model_bytes, snapshot.optimizer_bytes, residual)
        del snapshot, residual  # their tensors go now, not when the record settles
        await self.attesting.checkpoint_stored(plan, step, model_cid, optim_cid, metrics)

    def restore_feedback(self, step: int) -> None:
        """This member loaded the checkpoint at ``step``: take back the error feedback it kept there
        (run/_feedback_file.py), if it did; otherwise its residual stays as it is. At step 0 (the
        run's initial state: run/_resync.py, load_root) nothing was left unsent: none is kept."""
        run = self.run
        if step == 0:
            self.averager.drop_feedback()
            return
        trainer, _ = run.require()
        residual = load_feedback(run.dir, step, trainer.num_parameters)
        if residual is not None:
            self.averager.restore_feedback(residual)
            logger.info("%s: error feedback of step %d restored", run.log_prefix, step)

    async def _store(
        self, step: int, model_bytes: Callable[[], bytes], optimizer_bytes: Callable[[], bytes],
        residual: torch.Tensor | None,
    ) -> tuple[str, str]:
        """Serialize the state of ``step`` and add it to the store: its model and optimizer CIDs.
        This member's error feedback at ``step`` (``residual``) is kept on its disk first, so any
        checkpoint it attests can be resumed from exactly (run/_feedback_file.py)."""
        began = trio.current_time()
        # In a thread: serializing a model and its optimizer state copies every tensor (60 ms at 4.3M
        # parameters with Adam), long enough to stall this host's part in the others' traffic.
        model_data, optim_data = await trio.to_thread.run_sync(lambda: (model_bytes(), optimizer_bytes()))
        serialized = trio.current_time()
        store = self.run.content.store
        if residual is not None:
            await trio.to_thread.run_sync(save_feedback, self.run.dir, step, residual)
        model_cid = await trio.to_thread.run_sync(store.add_bytes, model_data)
        optim_cid = await trio.to_thread.run_sync(store.add_bytes, optim_data)
        logger.info("%s: checkpoint at step %d: serialized in %s, stored in %s", self.run.log_prefix, step,
                    fmt_s(serialized - began), fmt_s(trio.current_time() - serialized))
        return model_cid, optim_cid
