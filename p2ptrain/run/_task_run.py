"""One task as seen by one member: the run's parts, wired together for the lifetime of the run.

The protocol logic lives in :mod:`p2ptrain.training` as pure state machines (``Election``,
``RoundBook``, ``Attestations``, ``Chain``) and the numerics in ``Trainer``,
:func:`~p2ptrain.training.run_round` and the collective. A run feeds them and carries out what
they decide, one job per module:

- :mod:`~p2ptrain.run._leading`: the control loop (election ticks; while coordinator, plans and
  the run's head);
- :mod:`~p2ptrain.run._plan_intake`: each plan received: followed, caught up to, held or reported;
- :mod:`~p2ptrain.run._spans`: the round loop (the rounds of a followed plan, then its checkpoint);
- :mod:`~p2ptrain.run._attesting`: records, attestations, the confirmed chain on disk;
- :mod:`~p2ptrain.run._resync`: heads, loading the confirmed chain by CID, catching up to a plan;
- :mod:`~p2ptrain.run._resume`: a member that starts with the task's chain on its home resumes
  from its last record (after hearing the other members' chains);
- :mod:`~p2ptrain.run._datafeed`: the member's shards, the test split, replication;
- :mod:`~p2ptrain.run._run_state`: what they share.

This module prepares the run, routes the task's messages to the part whose job they are, and
reports the run's status.

A member advertises a task in its heartbeats only while its state is one that the others hold, so
the coordinator never puts a member into a ring that would compute from different weights.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import trio

from p2ptrain.collective import Collective
from p2ptrain.data import MAX_MANIFEST_BYTES, Manifest
from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.models import input_problem
from p2ptrain.base import short_id
from p2ptrain.node import ContentService, Node
from p2ptrain.run._attesting import Attesting
from p2ptrain.run._chain_file import ChainFile
from p2ptrain.run._datafeed import DataFeed
from p2ptrain.run._leading import HEAD_EVERY_S, Leading
from p2ptrain.run._plan_intake import PlanIntake
from p2ptrain.run._resume import Resume
from p2ptrain.run._resync import Resync
from p2ptrain.run._run_state import Nudge, RunState
from p2ptrain.run._spans import Spans
from p2ptrain.run._stage_checkpoints import initial_manifest
from p2ptrain.run._stage_local_sgd import LocalSGDStagedTrainer, staged_trainer
from p2ptrain.run._stage_status import stage_status, stage_suspects
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.control import FINISHED, ChainEntry, Phase, TaskStatus
from p2ptrain.protocol import Chain, ChainRules, load_model_bytes, RecordError, refuse_report, RoundBook
from p2ptrain.task import Task, total_steps
from p2ptrain.training import LocalSGDTrainer, Trainer, TrainerError, new_trainer, warm_up_torch
from p2ptrain.wire import (
    CoordinatorBeat,
    HeadRequest,
    RoundFailed,
    RoundPlan,
    SignedAttestation,
    SignedModelRecord,
    SignedVote,
    TASKS_TOPIC,
    TaskCancel,
    TaskHead,
    VoteRequest,
)

logger = logging.getLogger(__name__)

# A joiner listens this long for the run's head before it takes step 0 as the run's state: the
# coordinator of a run under way publishes one every HEAD_EVERY_S, and one may be lost.
HEAR_HEAD_S = HEAD_EVERY_S * 1.5
# Meanwhile it asks for the head this often (a request published before our pubsub mesh formed is
# lost): a run that is over has no coordinator publishing heads, its members answer requests
# (services/_head_answers.py), at most one answer per task per second.
ASK_HEAD_EVERY_S = 1.0
# Longest a stopping run waits for its stage channels to close (each close is bounded; peers see a reset or time out).
STOP_TIMEOUT_S = 5.0


def _fresh(heads: TaskHead | None) -> bool:
    """Whether the run's state may be step 0: no head heard, or one from before the first span
    (a head at v0 with members may be up to HEAD_EVERY_S old, the run past its first checkpoint)."""
    return heads is None or (heads.version == 0 and not heads.members)


class TaskRun:
    """One member's run of one task, for the lifetime of :meth:`run`."""

    def __init__(
        self,
        node: Node,
        content: ContentService,
        collective: Collective,
        task: Task,
        task_cid: str,
        *,
        device: str = "auto",
        precision: str = "fp32",
        make_trainer: Callable[[int], Trainer] | None = None,
    ) -> None:
        self.device = device
        self.precision = precision
        # A run of the user's own module: its trainer (the user's module, optimizer and loop) comes
        # from the process that runs the user's script (p2ptrain.Optimizer), given the run's length.
        self.make_trainer = make_trainer
        self.shared = run = RunState.create(node, content, collective, task, task_cid)
        run.deliver_own = self._deliver_own
        self.data = DataFeed(run)
        self.attesting = Attesting(run, self.data)
        self.spans = Spans(run, self.data, self.attesting)
        self.resync = Resync(run, self.spans.restore_feedback, busy=lambda: self.spans.running, hold=self.spans.hold_trainer)
        self.resume = Resume(run, self.resync)
        self.intake = PlanIntake(run, self.spans, self.resync)
        self.leading = Leading(run, self.spans, self.attesting, self.resync, self.intake)
        self._head_news = Nudge()  # a head arrived: the join's wait for the run's state looks again

    @property
    def task_cid(self) -> str:
        return self.shared.task_cid

    def status(self) -> TaskStatus:
        """What `p2ptrain task status` shows for a task this node takes part in."""
        run = self.shared
        book = run.book
        chain = book.chain if book else None
        plan = book.last_plan if book else None
        last_round, last_step = _progress(run)
        inner = run.trainer.inner_step if isinstance(run.trainer, (LocalSGDTrainer, LocalSGDStagedTrainer)) else None
        stage, stages = stage_status(run)
        return TaskStatus(
            task_cid=run.task_cid,
            name=run.task.name,
            state=run.phase,
            member=True,
            error=run.error,
            cancel_reason=run.cancel_reason,
            waiting_for_peers=run.waiting_for,
            waiting_s=None if run.waiting_since is None else round(trio.current_time() - run.waiting_since, 1),
            synced=run.synced,
            round=plan.round if plan else None,
            step=run.trainer.step if run.trainer else 0,
            total_steps=run.total_steps,
            members=tuple(plan.members) if plan else (),
            coordinator=run.election.coordinator,
            term=run.election.term,
            version=chain.version if chain else 0,
            latest_model_cid=chain.head_cid if chain else None,
            chain=tuple(ChainEntry(version=s.record.version, model_cid=s.record.model_cid, round=s.record.round,
                                   step=s.record.step, metrics=dict(s.record.metrics))
                        for s in (chain.records if chain else [])),
            loss=run.metrics.get("train_loss"),
            accuracy=run.metrics.get("accuracy"),
            test_loss=run.metrics.get("loss"),
            bytes_sent=run.bytes_sent,
            bytes_received=run.bytes_received,
            rounds_done=run.rounds_done,
            compute_s=round(run.timings.compute_s, 4),
            sync_s=round(run.timings.sync_s, 4),
            apply_s=round(run.timings.apply_s, 4),
            rejected=dict(run.rejected),
            resumed_from=run.resumed_from,
            last_round=last_round,
            last_step=last_step,
            # Local-SGD mode: read from the trainer's worker thread (the last int it set); shown 1 to H.
            inner_steps=run.task.training.inner_steps,
            inner_step=None if inner is None else inner + 1,
            is_coordinator=run.election.coordinator == run.me,
            stage=stage,
            stages=stages,
            stage_suspects=stage_suspects(run) if run.task.pipeline else None,
            stage_disagreements=tuple({"stage": s, "peers": [a, b], "times": n}
                                      for (s, a, b), n in sorted(run.stage_disagreements.items()))
            if run.task.pipeline else None,
            stage_recovery=run.stage_recovery,
            arithmetic_left_out=tuple({"peer": p, "arithmetic": a} for p, a in sorted(run.left_out.items())),
            arithmetic_run=run.arithmetic_run,
            arithmetic_barred=tuple({"class": c, "lapses": run.claims.lapses(c)} for c in sorted(run.barred)),
            round_seconds=run.round_seconds.snapshot(),
        )

    # -- lifetime ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Take part in the task until it is done (or the node stops)."""
        run = self.shared
        run.dir.path.mkdir(parents=True, exist_ok=True)
        try:
            await self._prepare()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.leading.run_loop)
                nursery.start_soon(self.spans.run_loop)
                nursery.start_soon(self._resume_then_resync)
                nursery.start_soon(self.data.replicate)
                await run.done.wait()
                nursery.cancel_scope.cancel()
            run.phase = Phase.DONE if run.cancel_reason is None else Phase.CANCELLED
            logger.info("%s: %s; final model %s", run.log_prefix, run.phase,
                        run.book.chain.head_cid if run.book else "-")
        except (ContentUnavailable, TrainerError, RecordError) as exc:
            run.phase, run.error = Phase.FAILED, str(exc)
            logger.error("%s: failed: %s", run.log_prefix, exc)
        except Exception as exc:
            # A bug in one task must not take the node (and its other tasks) down with it.
            run.phase, run.error = Phase.FAILED, f"internal error: {exc!r}"
            logger.exception("%s: failed with an internal error", run.log_prefix)
        finally:
            if run.phase not in FINISHED:
                run.phase = Phase.STOPPED  # the node is stopping (the run was cancelled)
            run.advertise(False)
            if self.spans.stages is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(STOP_TIMEOUT_S):
                    await self.spans.stages.stop()

    async def _prepare(self) -> None:
        """Fetch the manifest, build the initial model (or fetch it) and the first round's state."""
        run = self.shared
        task, content = run.task, run.content
        run.phase = Phase.FETCHING
        # torch's lazy imports, paid by the first run of the process rather than at node start: a
        # node that never trains (a fetcher, a mesh or store peer) saves their 4 s of CPU.
        await trio.to_thread.run_sync(warm_up_torch)
        train_samples = 0
        if task.dataset is not None:
            manifest_cid = task.dataset.manifest
            await content.fetch(manifest_cid, max_bytes=MAX_MANIFEST_BYTES)
            run.manifest = await trio.to_thread.run_sync(Manifest.load, content.store, manifest_cid)
            train_samples = run.manifest.num_samples(task.dataset.train_split)
            if not task.model.user:
                problem = input_problem(task.model.name, task.model.arguments, run.manifest.features.shape)
                if problem is not None:
                    raise TrainerError(f"the task's data set and model do not fit: {problem}")
        run.total_steps = total_steps(task, train_samples, task.peers.max)
        make = self.make_trainer
        if make is not None:
            trainer = make(run.total_steps)
        else:
            if task.model.user:
                raise TrainerError("a run of the members' own model: only a process running its script joins it "
                                   "(p2ptrain.Optimizer)")
            # A pipelined task's member trains one stage of the whole model (run/_stage_trainer.py).
            build = new_trainer if task.pipeline is None else staged_trainer
            trainer = await trio.to_thread.run_sync(
                lambda: build(task, total_steps=run.total_steps, device=self.device, precision=self.precision)
            )
        # The user's module holds the run's initial weights already; a registry model's are fetched
        # and read within what a model of the task's architecture takes.
        data = None
        if task.initial_model and make is None:
            data = await content.read(task.initial_model, max_bytes=trainer.state_limits()[0])
            if not isinstance(trainer, StagedTrainer):
                load_model_bytes(trainer.model, data)
        if isinstance(trainer, StagedTrainer):  # no member holds the whole model: a manifest of the stages'
            run.initial_cid = await trio.to_thread.run_sync(
                lambda: initial_manifest(content.store, trainer, data, scratch=run.dir.path))
        else:  # with the optimizer's state at step 0: a member goes back to both at v0 (Resync.load_root)
            run.initial_cid = await trio.to_thread.run_sync(content.store.add_bytes, trainer.model_bytes())
            run.initial_optimizer_cid = await trio.to_thread.run_sync(content.store.add_bytes, trainer.optimizer_bytes())
        run.trainer = trainer
        # The chain this home confirmed (a RecordError for a file that does not verify: kept as it is).
        rules = ChainRules.of(task, run.task_cid)
        run.chain_file = await trio.to_thread.run_sync(ChainFile.open, run.dir, run.task_cid, run.initial_cid, rules)
        run.book = RoundBook(task, run.task_cid, Chain(run.task_cid, run.initial_cid, rules), run.total_steps,
                             cancelled=run.cancel_reason is not None)
        if run.chain_file.chain.version:
            await self.resume.load_own(run.chain_file.copy())  # then hears the others (run's nursery)
            return
        # A run under way has a coordinator that publishes its head every HEAD_EVERY_S: hear it
        # before claiming to hold the run's state (we hold step 0, which is only right early on).
        # A run that is over has none: ask, and its members answer (services/_head_answers.py), and
        # its publisher repeats its cancel if it cancelled it. Without asking, a joiner of a
        # finished run trained it again from step 0, alone, and forked its history (gossip had
        # handed it the run's first head, v0 with no members). Asked once even with a head in hand.
        with trio.move_on_after(HEAR_HEAD_S):
            await run.node.publish(TASKS_TOPIC, HeadRequest(task_cid=run.task_cid))
            while _fresh(run.heads):
                await self._head_news.wait(ASK_HEAD_EVERY_S)
                if _fresh(run.heads):
                    await run.node.publish(TASKS_TOPIC, HeadRequest(task_cid=run.task_cid))
        heads = run.heads
        fresh = _fresh(heads)
        logger.info("%s: joined; %d steps, initial model %s%s", run.log_prefix, run.total_steps, run.initial_cid,
                    "" if heads is None or fresh else f"; the run is under way (model v{heads.version}): resyncing")
        if run.task.pipeline is not None:
            logger.warning("%s: a pipelined task: its records do not yet prove what a data-parallel record proves "
                           "against a hostile member (`p2ptrain docs security`, 'Pipelined tasks'); run it among members "
                           "you trust, e.g. with [peers] admission = \"allowlist\"", run.log_prefix)
        if fresh:  # step 0 from the task's seed (or initial model): every member holds it
            run.set_synced()
        else:
            run.phase = Phase.RESYNCING

    # -- messages ------------------------------------------------------------------------------

    async def _resume_then_resync(self) -> None:
        """A resuming member hears the others first (run/_resume.py); the resync loop, which loads
        heads and catches up to plans, starts only then: one load at a time changes our state."""
        await self.resume.hear_others()
        await self.resync.run_loop(self.spans.follow)

    async def on_message(self, sender: str, msg: Any) -> None:
        """Called by the task service for every valid message about this task: handed to the part
        whose job it is (:data:`ROUTES`); a type the run has no route for is ignored."""
        route = self.ROUTES.get(type(msg))
        if route is not None:
            await route(self, sender, msg)
            self.resume.nudge()

    async def _on_election_message(self, sender: str, msg: VoteRequest | SignedVote | CoordinatorBeat) -> None:
        await self.leading.on_election_message(sender, msg)

    async def _on_record(self, sender: str, msg: SignedModelRecord) -> None:
        await self.attesting.on_record(msg, sender)

    async def _on_attestation(self, sender: str, msg: SignedAttestation) -> None:
        await self.attesting.on_attestation(msg)

    async def _on_head(self, sender: str, msg: TaskHead) -> None:
        if not self.resume.on_head(sender, msg):
            self.resync.on_head(sender, msg)
        self._head_news.set()

    async def _on_cancel(self, sender: str, msg: TaskCancel) -> None:
        """Obey a cancel only from the publisher the task file names: anyone else is counted."""
        run = self.shared
        publisher = run.task.publisher
        if publisher is None or sender != publisher:
            run.refuse("cancel", f"refused a cancel from {short_id(sender)}: "
                       + ("the task names no publisher" if publisher is None else "not the task's publisher"))
            return
        run.cancel(msg.reason)

    async def _deliver_own(self, msg: Any) -> None:
        await self.on_message(self.shared.me, msg)

    async def _on_failure_report(self, sender: str, report: RoundFailed) -> None:
        run = self.shared
        if run.book is None:
            return
        coordinator = run.election.is_coordinator
        if (problem := refuse_report(run.book, trio.current_time(), report, sender)) is not None:
            run.refuse("failure_report", f"ignored a failure report: {problem}")  # (protocol/_failure_reports.py)
        elif run.book.note_failure_report(trio.current_time(), report, sender, run.me, coordinator=coordinator):
            if self.spans.stages is not None:  # a member that takes no part: leave the step now
                self.spans.stages.window.on_report(run.book.last_plan, sender, report)
            logger.info("%s: %s reports round %d failed: %s", run.log_prefix, short_id(sender), report.round,
                        report.reason)
            if coordinator:
                run.wake_leader.set()  # the last report may be the one the retry waits for

    async def _on_plan(self, sender: str, plan: RoundPlan) -> None:
        await self.intake.on_plan(sender, plan)

    # {message type: the handler}: the one place a task message is routed. The task service
    # subscribes to these types and hands each message of this task here; a new type is one line.
    ROUTES: ClassVar[dict[type, Callable[[TaskRun, str, Any], Awaitable[None]]]] = {
        VoteRequest: _on_election_message,
        SignedVote: _on_election_message,
        CoordinatorBeat: _on_election_message,
        RoundPlan: _on_plan,
        RoundFailed: _on_failure_report,
        SignedModelRecord: _on_record,
        SignedAttestation: _on_attestation,
        TaskHead: _on_head,
        TaskCancel: _on_cancel,
    }


def _progress(run: RunState) -> tuple[int | None, int | None]:
    """``last_round``/``last_step``: the last round this member completed and the step after it
    (round ``plan.round + i`` of a followed plan ends at step ``plan.step + i + 1``; a member that
    loaded a checkpoint instead is at its record's last round); None before the first round."""
    book, trainer = run.book, run.trainer
    step = trainer.step if trainer else 0
    plan = book.last_plan if book else None
    last_round: int | None = None
    if plan is not None and plan.step < step <= plan.step + plan.rounds:
        last_round = plan.round + (step - plan.step) - 1
    elif book is not None and book.chain.records and step == book.head_step:
        last_round = book.chain.records[-1].record.round
    return last_round, step if last_round is not None else None
