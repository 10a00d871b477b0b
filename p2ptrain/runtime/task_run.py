"""One task as seen by one member: elections, rounds, checkpoints, attestations, resync.

The protocol logic lives in :mod:`p2ptrain.training` as pure state machines (``Election``,
``RoundBook``, ``Tally``, ``Chain``) and the numerics in ``Trainer`` and the collective's
``SparseAllReducer``. This module only feeds them: messages from the task's topic, the clock, the
membership view, and it carries out what they decide (publish, compute, all-reduce, store).

Three tasks run for a task, all in one nursery:

- the *control loop* ticks the election every fraction of a heartbeat (and at once when a span
  ends or a checkpoint is confirmed), and, while this member is coordinator, issues round plans,
  re-announces the task and publishes the run's head;
- the *round loop* executes plans: local gradient (in a worker thread), sparse ring all-reduce,
  identical optimizer step, and at checkpoints stores the model and attests the coordinator's record;
- the *resync loop* brings a member that is not at a confirmed state (a late joiner, or a member
  that missed a round) to the head of the confirmed chain by CID, and only then advertises the task.

A member advertises a task in its heartbeats only while its state is one that the others hold, so
the coordinator never puts a member into a ring that would compute from different weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import trio
from libp2p.peer.id import ID

from p2ptrain.collective import Collective, CollectiveError, PeerFailed
from p2ptrain.data.dataset import IPFSDataset
from p2ptrain.data.manifest import MAX_MANIFEST_BYTES, Manifest
from p2ptrain.ipfs.store import ContentUnavailable
from p2ptrain.ipfs.unixfs import DagError
from p2ptrain.mesh.router import short
from p2ptrain.net.streams import count_rejection
from p2ptrain.atomic import write_atomic
from p2ptrain.node import Node
from p2ptrain.runtime.content import ContentService
from p2ptrain.training.election import Election, ElectionConfig
from p2ptrain.training.records import MAX_CHAIN_BYTES, Chain, RecordError, Status, Tally, attest, load_model_bytes
from p2ptrain.training.rounds import RoundBook, round_id, shard_of
from p2ptrain.training.task import Task, total_steps, unmet_requirement
from p2ptrain.training.sync import PlanAverager
from p2ptrain.training.trainer import Average, Trainer, TrainerError, batched, batches_forever
from p2ptrain.wire.messages import (
    CoordinatorBeat,
    RoundFailed,
    RoundPlan,
    SignedAttestation,
    SignedModelRecord,
    SignedVote,
    TaskAnnounce,
    TaskHead,
    VoteRequest,
)

logger = logging.getLogger(__name__)

TASKS_TOPIC = "p2ptrain/tasks/v1"
TICK_FRACTION = 0.25  # control-loop period, as a fraction of the heartbeat interval
HEAD_EVERY_S = 2.0  # how often the coordinator publishes the run's head (and re-announces the task)
ATTEST_TIMEOUT_S = 20.0  # a record short of a quorum of attestations by then is rejected
RETRY_BACKOFF_S = 1.5  # after a failed round, before the coordinator plans the retry
FAILED_PEER_QUARANTINE_S = 10.0  # a peer named in a failed round is left out of plans this long
FIRST_ROUND_GRACE_S = 2.0  # the first plan waits this long after election, for peers still joining
CATCH_UP_WAIT_S = 2.0  # a member listed in a plan from a checkpoint it lacks waits this long for its head
HOP_TIMEOUT_S = 5.0
START_TIMEOUT_S = 15.0  # members start a round at different times (compute, plan latency)
# Fetching a head's chain, model or optimizer state: each is bounded in bytes too (MAX_CHAIN_BYTES,
# Trainer.state_limits), so this only ends a transfer that stalls; 60 s is ContentService's default.
RESYNC_FETCH_TIMEOUT_S = 60.0
# Terms whose coordinator (as our election accepted it) is remembered, to check who signed the
# records a head's chain adds: 256 terms (a few KiB) go back further than any member stays away.
KNOWN_TERMS = 256


def task_topic(task_cid: str) -> str:
    return f"p2ptrain/task/{task_cid}"


def _until_later(deadlines: dict[str, float], now: float) -> set[str]:
    """The peers whose entry in ``deadlines`` (peer -> until when) has not run out at ``now``."""
    return {p for p, until in deadlines.items() if until > now}


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
    ) -> None:
        self.node = node
        self.content = content
        self.collective = collective
        self.task = task
        self.task_cid = task_cid
        self.device = device
        self.precision = precision
        self.me = node.peer_id.to_base58()
        self.topic = task_topic(task_cid)
        self.dir = node.home / "tasks" / task_cid
        self.state = "starting"
        self.error: str | None = None
        self.synced = False
        self.trainer: Trainer | None = None
        self.averager: PlanAverager | None = None
        self.book: RoundBook | None = None
        self.election = Election(task_cid, node.key_pair, ElectionConfig(heartbeat_s=node.config.heartbeat_interval))
        self.manifest: Manifest | None = None
        self.total_steps = 0
        self.initial_cid = ""
        self.tally: Tally | None = None
        self.tally_started = 0.0
        self.early_attestations: dict[str, list[SignedAttestation]] = {}
        self.checkpoint_cids: dict[int, tuple[str, str]] = {}  # step -> (model CID, optimizer CID)
        self.heads: TaskHead | None = None
        self._head_sender: str | None = None  # who published self.heads
        # term -> the coordinator our election accepted for it (the last KNOWN_TERMS terms)
        self._coordinators: dict[int, str] = {}
        # Heads and chains refused, resyncs that failed, by kind: shown in `task status` ("rejected").
        self.rejected: Counter[str] = Counter()
        self._chain_cid: tuple[int, str] | None = None  # (chain version, CID of its bytes)
        self.metrics: dict[str, float] = {}
        self.bytes_sent = 0
        self.rounds_done = 0
        self.compute_s = 0.0  # local forward/backward time of completed and failed rounds
        self.sync_s = 0.0  # all-reduce time of completed rounds (waiting for the others included)
        self.apply_s = 0.0  # optimizer step time of completed rounds
        self.failed_peers: dict[str, float] = {}
        # Peers a round found unreachable (a broken channel, a refused dial): the election counts
        # them as dead at once, not when the mesh stops hearing them (5 s) or beats stop (3 s).
        self.gone_peers: dict[str, float] = {}
        self.retry_after = 0.0
        self.elected_at: float | None = None
        self.busy = False
        # Open while this member is in a span's rounds: a newer plan cancels it (see _on_plan).
        self._rounds_scope: trio.CancelScope | None = None
        # A member of the current plan reported that it cannot take part: retry without it now.
        self._culprit_reported = False
        # A plan that lists us but starts from a checkpoint we do not hold: (sender, plan), for the
        # resync loop to catch up to and then follow.
        self._catch_up: tuple[str, RoundPlan] | None = None
        self._catch_up_wake = trio.Event()
        self._plans_send, self._plans_recv = trio.open_memory_channel[RoundPlan](64)
        self._batches: tuple[tuple[int, int], Iterator[Any]] | None = None
        self._done = trio.Event()
        self._head_heard = trio.Event()
        # Set when the coordinator may be able to plan now (a span ended, a checkpoint was
        # confirmed or rejected), so the next plan does not wait for the control loop's next tick.
        self._wake = trio.Event()

    # -- status ------------------------------------------------------------------------------

    @property
    def log_prefix(self) -> str:
        return f"task {self.task.name} ({self.task_cid[:10]}) peer {short(self.node.peer_id)}"

    def status(self) -> dict[str, Any]:
        """What `p2ptrain task status --json` shows for a task this node takes part in."""
        book = self.book
        chain = book.chain if book else None
        plan = book.last_plan if book else None
        return {
            "task_cid": self.task_cid,
            "name": self.task.name,
            "state": self.state,
            "error": self.error,
            "member": True,
            "synced": self.synced,
            "round": plan.round if plan else None,
            "step": self.trainer.step if self.trainer else 0,
            "total_steps": self.total_steps,
            "members": list(plan.members) if plan else [],
            "coordinator": self.election.coordinator,
            "term": self.election.term,
            "version": chain.version if chain else 0,
            "latest_model_cid": chain.head_cid if chain else None,
            "chain": [
                {"version": s.record.version, "model_cid": s.record.model_cid, "round": s.record.round,
                 "step": s.record.step, "metrics": dict(s.record.metrics)}
                for s in (chain.records if chain else [])
            ],
            "loss": self.metrics.get("train_loss"),
            "accuracy": self.metrics.get("accuracy"),
            "test_loss": self.metrics.get("loss"),
            "bytes_sent": self.bytes_sent,
            "rounds_done": self.rounds_done,
            "compute_s": round(self.compute_s, 4),
            "sync_s": round(self.sync_s, 4),
            "apply_s": round(self.apply_s, 4),
            "rejected": dict(self.rejected),
        }

    # -- lifetime ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Take part in the task until it is done (or the node stops)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            await self._prepare()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._control_loop)
                nursery.start_soon(self._round_loop)
                nursery.start_soon(self._resync_loop)
                nursery.start_soon(self._replicate_data)
                await self._done.wait()
                nursery.cancel_scope.cancel()
            self.state = "done"
            logger.info("%s: done; final model %s", self.log_prefix, self.book.chain.head_cid if self.book else "-")
        except (ContentUnavailable, TrainerError, RecordError) as exc:
            self.state, self.error = "failed", str(exc)
            logger.error("%s: failed: %s", self.log_prefix, exc)
        except Exception as exc:
            # A bug in one task must not take the node (and its other tasks) down with it.
            self.state, self.error = "failed", f"internal error: {exc!r}"
            logger.exception("%s: failed with an internal error", self.log_prefix)
        finally:
            self._advertise(False)

    async def _prepare(self) -> None:
        """Fetch the manifest, build the initial model (or fetch it) and the first round's state."""
        self.state = "fetching data"
        await self.content.fetch(self.task.dataset.manifest, max_bytes=MAX_MANIFEST_BYTES)
        self.manifest = await trio.to_thread.run_sync(Manifest.load, self.content.store, self.task.dataset.manifest)
        train_samples = self.manifest.num_samples(self.task.dataset.train_split)
        self.total_steps = total_steps(self.task, train_samples, self.task.peers.max)
        self.trainer = await trio.to_thread.run_sync(
            lambda: Trainer(self.task, total_steps=self.total_steps, device=self.device, precision=self.precision)
        )
        if self.task.initial_model:
            await self.content.fetch(self.task.initial_model)
            data = await trio.to_thread.run_sync(self.content.store.cat, self.task.initial_model)
            load_model_bytes(self.trainer.model, data)
        self.initial_cid = await trio.to_thread.run_sync(self.content.store.add_bytes, self.trainer.model_bytes())
        self.averager = PlanAverager(self.task, self.collective, timeout=HOP_TIMEOUT_S, start_timeout=START_TIMEOUT_S)
        self.book = RoundBook(self.task, self.task_cid, Chain(self.task_cid, self.initial_cid), self.total_steps)
        if self.heads is None:
            # A run under way has a coordinator that publishes its head every HEAD_EVERY_S: hear it
            # before claiming to hold the run's state (we hold step 0, which is only right early on).
            with trio.move_on_after(HEAD_EVERY_S * 1.5):
                await self._head_heard.wait()
        # Step 0 is the run's state only while no span has started: a head at v0 with members may
        # be up to HEAD_EVERY_S old, and the run past its first checkpoint by now.
        fresh = self.heads is None or (self.heads.version == 0 and not self.heads.members)
        logger.info("%s: joined; %d steps, initial model %s%s", self.log_prefix, self.total_steps,
                    self.initial_cid, "" if fresh else f"; the run is under way (model v{self.heads.version}): resyncing")
        if fresh:  # step 0 from the task's seed (or initial model): every member holds it
            self.synced, self.state = True, "training"
            self._advertise(True)
        else:
            self.state = "resyncing"

    def _advertise(self, on: bool) -> None:
        tasks = set(self.node.membership.tasks)
        tasks.add(self.task_cid) if on else tasks.discard(self.task_cid)
        if set(self.node.membership.tasks) != tasks:
            self.node.membership.tasks = tuple(sorted(tasks))
            self.node.membership.poke()

    def _live(self) -> set[str]:
        """Peers that advertise this task (so hold the state the run is at) and meet its requirements."""
        live = {self.me} if self.synced else set()
        for record in self.node.membership.alive():
            if self.task_cid in record.tasks and unmet_requirement(self.task, record.caps) is None:
                live.add(record.peer_id.to_base58())
        return live

    def _behind(self) -> bool:
        """Whether others are known to be past our state: a later confirmed model, or a plan seen
        on the topic that starts after our step."""
        assert self.book is not None and self.trainer is not None
        if self.heads is not None and self.heads.version > self.book.chain.version:
            return True
        seen = self.book.observed
        return seen is not None and seen.step > self.trainer.step

    def _voters_alive(self, roster: tuple[str, ...]) -> set[str]:
        """Who counts as alive for the election: the roster's peers that the mesh hears, plus the
        peers that advertise the task. A roster member that is resyncing is still a voter, or the
        coordinator would step down each time one member catches up."""
        alive = {record.peer_id.to_base58() for record in self.node.membership.alive()}
        now = trio.current_time()
        gone = _until_later(self.gone_peers, now)
        coordinator = self.election.coordinator
        if (
            coordinator is not None and not self.election.is_coordinator
            and now - self.election.heard_at > 1.5 * self.election.config.heartbeat_s
            and self.node.discovery is not None and not self.node.discovery.connected(ID.from_base58(coordinator))
        ):
            # It missed a heartbeat and we hold no connection to it (discovery keeps one to every
            # peer it knows, and members talk directly): it is dead, most likely. Without this a
            # coordinator that died between rounds cost the full heartbeat timeout (3 s). Only
            # while both hold: a connection that comes back, or a beat, makes it live again.
            gone.add(coordinator)
        return ((alive & set(roster)) | self._live() | {self.me}) - gone

    # -- messages ------------------------------------------------------------------------------

    async def on_message(self, sender: str, msg: Any) -> None:
        """Called by the task service for every valid message about this task."""
        now = trio.current_time()
        if isinstance(msg, (VoteRequest, SignedVote, CoordinatorBeat)):
            before = self.election.coordinator
            for out in self.election.receive(now, sender, msg):
                await self.node.publish(self.topic, out)
            self._note_coordinator(before, now)
        elif isinstance(msg, RoundPlan):
            await self._on_plan(sender, msg)
        elif isinstance(msg, RoundFailed):
            if self.book is not None and self.book.report_failure(msg, sender):
                logger.info("%s: %s reports round %d failed: %s", self.log_prefix, short(sender), msg.round, msg.reason)
                if self.election.is_coordinator and sender != self.me and self.book.reporter_out_of_step(msg):
                    self.failed_peers[sender] = now + FAILED_PEER_QUARANTINE_S
                    self._culprit_reported = True
                if self.election.is_coordinator:
                    self._wake.set()  # the last report may be the one the retry waits for
        elif isinstance(msg, SignedModelRecord):
            await self._on_record(msg)
        elif isinstance(msg, SignedAttestation):
            self._on_attestation(msg)
        elif isinstance(msg, TaskHead):
            problem = self._head_problem(sender)
            if problem is not None:
                self._refuse("head_untrusted", f"ignored a head (model v{msg.version}): {problem}")
                return
            if (self.heads is None or sender != self._head_sender
                    or (msg.version, msg.step) >= (self.heads.version, self.heads.step)):
                self.heads, self._head_sender = msg, sender
                self._head_heard.set()
            if msg.done and self.synced and self.book and self.book.chain.version >= msg.version:
                self._done.set()

    def _head_problem(self, sender: str) -> str | None:
        """Why a head from ``sender`` is not to be acted on, or None.

        A head makes a member stop advertising and load a chain, a model and an optimizer state by
        CID, so only the coordinator our election accepted (a quorum of the roster voted for it) is
        heard. A member that knows no coordinator right now (between terms) waits for the next one,
        unless it holds no confirmed model: a fresh joiner has no other way into a run under way and
        trusts the head's sender (see docs/training.md, "Heads and resync").
        """
        coordinator = self.election.coordinator
        if coordinator is not None:
            if sender == coordinator:
                return None
            return f"from {short(sender)}, not the coordinator {short(coordinator)} of term {self.election.term}"
        if self.book is not None and self.book.chain.version > 0:
            return f"from {short(sender)} while no coordinator is known"
        return None

    def _refuse(self, kind: str, why: str) -> None:
        """Count a refusal of ``kind``; log it the 1st, 2nd, 4th, 8th... time (a flood stays a few lines)."""
        count_rejection(self.rejected, kind, logger, logging.WARNING, "%s: %s", self.log_prefix, why)

    def _note_coordinator(self, before: str | None, now: float) -> None:
        if self.election.coordinator is not None:
            self._coordinators[self.election.term] = self.election.coordinator
            while len(self._coordinators) > KNOWN_TERMS:
                del self._coordinators[min(self._coordinators)]
        if self.election.coordinator != before and self.election.coordinator is not None:
            who = "this peer" if self.election.is_coordinator else short(self.election.coordinator)
            logger.info("%s: coordinator of term %d is %s", self.log_prefix, self.election.term, who)
            if self.election.is_coordinator:
                self.elected_at = now

    async def _on_plan(self, sender: str, plan: RoundPlan) -> None:
        # Every plan goes through the book, also when we are not a member: that is how a joiner
        # learns the roster whose votes elected the coordinator.
        if self.book is None or plan.task_cid != self.task_cid:
            return
        last = self.book.last_plan
        new = last is None or (plan.term, plan.round, plan.attempt) > (last.term, last.round, last.attempt)
        problem = self.book.plan_problem(plan, sender, self.election)
        if problem is not None:
            logger.debug("%s: not following plan %d.%d: %s", self.log_prefix, plan.round, plan.attempt, problem)
            if new and self.me in plan.members:
                # Listed in a plan we will not follow (we do not recognise its coordinator yet):
                # the others would wait for us until their start timeout.
                await self._report_failure(plan, 0, f"cannot follow this plan: {problem}")
            return
        self._culprit_reported = False  # it was about the plan this one supersedes
        # Only members of a plan we follow may open round channels to us before the round opens.
        self.collective.hub.expect(ID.from_base58(member) for member in plan.members)
        assert self.trainer is not None
        if not self.synced or not self.trainer.can_align(plan.step):
            # Listed in a plan from a checkpoint we do not hold (a joiner that advertised from a
            # head the run has left, or a member that fell behind): the resync loop loads that
            # checkpoint by CID and then follows the plan, while the others wait for our channels.
            if self.synced:
                self._desync()
            if self._rounds_scope is not None:
                self._rounds_scope.cancel()
            self._catch_up = (sender, plan)
            self._catch_up_wake.set()
            return
        self._follow(plan)

    def _follow(self, plan: RoundPlan) -> None:
        """Hand a plan this member follows to the round loop."""
        try:
            self._plans_send.send_nowait(plan)
        except trio.WouldBlock:
            logger.warning("%s: plan queue full; dropped plan %d.%d", self.log_prefix, plan.round, plan.attempt)
            return
        if self._rounds_scope is not None:
            # A followed plan is always after the one running here (a retry, or a new coordinator
            # taking over): a round of the old one that still waits on a dead or absent peer would
            # hold this member until its start timeout (15 s). Stop it now; its state is kept (the
            # error feedback commits only after a round succeeds, the gradient stays pending).
            self._rounds_scope.cancel()

    async def _on_record(self, signed: SignedModelRecord) -> None:
        if self.book is None or not self.synced:
            return
        try:
            record = self.book.chain.check(signed)
            tally = Tally(signed)
        except RecordError as exc:
            logger.warning("%s: refused model record: %s", self.log_prefix, exc)
            return
        if self.election.coordinator is not None and record.coordinator != self.election.coordinator:
            logger.warning("%s: refused model record v%d from %s, not the coordinator", self.log_prefix,
                           record.version, short(record.coordinator))
            return
        if self.tally is not None and self.tally.status is Status.PENDING and self.tally.id != tally.id:
            logger.warning("%s: a second model record v%d while v%d is pending; keeping the first",
                           self.log_prefix, record.version, self.tally.record.version)
            return
        if self.tally is None or self.tally.id != tally.id:
            self.tally, self.tally_started = tally, trio.current_time()
            for early in self.early_attestations.pop(tally.id, []):
                self._count(early)
        await self._attest_if_ready()

    async def _attest_if_ready(self) -> None:
        """Attest the pending record once our own state is at its step (we hashed our weights)."""
        tally = self.tally
        if tally is None or tally.status is not Status.PENDING or self.me not in tally.record.members:
            return
        if self.me in tally.matching or self.me in tally.differing:
            return
        cids = self.checkpoint_cids.get(tally.record.step)
        if cids is None:
            return  # our round is still running; _checkpoint calls us again
        signed = attest(tally.record, cids[0], cids[1], self.node.key_pair)
        await self.node.publish(self.topic, signed)
        self._count(signed)

    def _on_attestation(self, signed: SignedAttestation) -> None:
        if self.tally is None or signed.attestation.record_id != self.tally.id:
            pending = self.early_attestations.setdefault(signed.attestation.record_id, [])
            if len(self.early_attestations) <= 8 and len(pending) < 1024:
                pending.append(signed)
            return
        self._count(signed)

    def _count(self, signed: SignedAttestation) -> None:
        tally = self.tally
        assert tally is not None and self.book is not None
        try:
            status = tally.add(signed)
        except RecordError as exc:
            logger.warning("%s: refused attestation: %s", self.log_prefix, exc)
            return
        if status is Status.CONFIRMED and self.book.chain.version < tally.record.version:
            self._confirm(tally)
        elif status is Status.REJECTED:
            self.book.rejected_step = tally.record.step
            self._wake.set()

    def _confirm(self, tally: Tally) -> None:
        assert self.book is not None
        self.book.chain.append(tally.signed)
        record = tally.record
        self.metrics.update(record.metrics)
        write_atomic(self.dir / "chain.jsonl", self.book.chain.to_bytes(), mode=0o600)
        logger.info(
            "%s: model v%d confirmed by %d/%d members: %s (round %d, step %d, accuracy %s)",
            self.log_prefix, record.version, len(tally.matching), len(record.members), record.model_cid,
            record.round, record.step, _fmt(record.metrics.get("accuracy")),
        )
        if record.step >= self.total_steps:
            self._done.set()
        self._wake.set()

    # -- the control loop (election, planning, head) ---------------------------------------------

    async def _control_loop(self) -> None:
        period = self.node.config.heartbeat_interval * TICK_FRACTION
        last_head, head_version = -math.inf, -1
        while True:
            now = trio.current_time()
            roster = self.book.roster(self.me) if self.book else ()
            if not roster and self.heads is not None:
                # A joiner that has seen no plan yet: the run's members, from its head. With the
                # live peers instead it refused the coordinator's certificate (2 votes, a quorum of
                # its 4 live peers is 3) and stood for the term itself.
                roster = self.heads.members
            before = self.election.coordinator
            for out in self.election.tick(now, self._voters_alive(roster), roster):
                if not self.synced and isinstance(out, (VoteRequest, CoordinatorBeat)):
                    continue  # a member that is not at the run's state must not lead it; it still votes
                await self.node.publish(self.topic, out)
            if before is not None and self.election.coordinator is None and before in self.election.suspects:
                # A coordinator that fell silent is most likely dead: a plan listing it would fail
                # on it (the mesh drops it only after 5 s). Left out like a peer a round named.
                self.failed_peers[before] = now + FAILED_PEER_QUARANTINE_S
            self._note_coordinator(before, now)
            if self.tally is not None and self.tally.status is Status.PENDING and now - self.tally_started > ATTEST_TIMEOUT_S:
                if self.tally.expire() is Status.REJECTED and self.book is not None:
                    self.book.rejected_step = self.tally.record.step
            if self.election.is_coordinator and self.synced:
                await self._maybe_plan(now)
                # Also at once when a checkpoint was confirmed: a member that the next plan lists
                # without its state catches up from this head (_follow_from_behind).
                if now - last_head >= HEAD_EVERY_S or self.book.chain.version != head_version:
                    last_head, head_version = now, self.book.chain.version
                    await self._publish_head()
            with trio.move_on_after(period):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _maybe_plan(self, now: float) -> None:
        assert self.book is not None and self.trainer is not None
        last = self.book.last_plan
        # The coordinator's own round may be waiting (up to START_TIMEOUT_S) on a peer that will not
        # come: one of the old term's plan, when it was just elected, or one that reported it cannot
        # take part. It plans at once; the new plan stops that round everywhere (_on_plan).
        stuck = self._rounds_scope is not None and (
            (last is not None and last.term != self.election.term) or self._culprit_reported
        )
        if self.busy and not stuck:
            return
        quarantined = _until_later(self.failed_peers, now)
        if now < self.retry_after and self.book.failed_round is not None and not self.book.all_reported(quarantined):
            # A retry: give the other members time to leave the failed round, unless all have said
            # so. (Only a retry: the next span after a successful one waited here too, ~1 s.)
            return
        if self._behind():
            # Elected while behind the run (e.g. it joined at step 0 and missed the records): it
            # must not plan from its own stale state. Resync first; the next term picks another.
            logger.warning("%s: coordinator but behind the run; resyncing instead of planning", self.log_prefix)
            self._desync()
            return
        if self.book.last_plan is None and self.elected_at is not None and now - self.elected_at < FIRST_ROUND_GRACE_S:
            return
        live = self._live() - quarantined
        plan = self.book.next_plan(self.election, self.trainer.step, live, self.trainer.can_roll_back)
        if plan is None:
            return
        logger.info("%s: plan rounds %d-%d (attempt %d) from step %d with %d members", self.log_prefix,
                    plan.round, plan.round + plan.rounds - 1, plan.attempt, plan.step, len(plan.members))
        await self.node.publish(self.topic, plan)
        await self._on_plan(self.me, plan)

    async def _publish_head(self) -> None:
        assert self.book is not None
        chain = self.book.chain
        if self._chain_cid is None or self._chain_cid[0] != chain.version:
            # Stored once per confirmed version, not at every head (every HEAD_EVERY_S).
            cid = await trio.to_thread.run_sync(self.content.store.add_bytes, chain.to_bytes())
            self._chain_cid = (chain.version, cid)
        chain_cid = self._chain_cid[1]
        head = chain.records[-1].record if chain.records else None
        plan = self.book.last_plan
        msg = TaskHead(
            task_cid=self.task_cid, term=self.election.term, version=chain.version,
            step=head.step if head else 0, round=plan.round if plan else 0, total_steps=self.total_steps,
            chain_cid=chain_cid, model_cid=chain.head_cid,
            optimizer_cid=head.optimizer_cid if head else chain.head_cid,
            members=plan.members if plan else (), done=bool(head and head.step >= self.total_steps),
        )
        await self.node.publish(TASKS_TOPIC, msg)
        await self.node.publish(TASKS_TOPIC, TaskAnnounce(task_cid=self.task_cid, name=self.task.name))
        self.heads, self._head_sender = msg, self.me

    # -- the round loop ------------------------------------------------------------------------

    async def _round_loop(self) -> None:
        async for plan in self._plans_recv:
            while True:  # a newer plan supersedes queued older ones
                try:
                    plan = self._plans_recv.receive_nowait()
                except trio.WouldBlock:
                    break
            self.busy = True
            try:
                await self._run_span(plan)
            finally:
                self.busy = False
                self._wake.set()

    async def _run_span(self, plan: RoundPlan) -> None:
        """The plan's rounds back to back, then its checkpoint; a newer plan or a failure ends it."""
        trainer = self.trainer
        assert trainer is not None and self.book is not None
        try:
            trainer.align(plan.step)
        except TrainerError as exc:
            logger.warning("%s: out of step (%s); resyncing from the latest confirmed model", self.log_prefix, exc)
            self._desync()
            # The other members would wait for us until their start timeout: say so at once.
            await self._report_failure(plan, 0, f"out of step: {exc}")
            return
        rank, world = shard_of(plan, self.me)
        try:
            batches = await self._training_batches(rank, world)
        except ContentUnavailable as exc:
            logger.warning("%s: cannot get my shards for rank %d of %d: %s", self.log_prefix, rank, world, exc)
            await self._report_failure(plan, 0, f"no training data: {exc}")
            return
        assert self.averager is not None
        average = self.averager.for_plan(plan)
        index = 0
        scope = self._rounds_scope = trio.CancelScope()
        try:
            with scope:
                for index in range(plan.rounds):
                    if self.book.last_plan is not plan:
                        return  # superseded (a retry, or a new coordinator's plan): the loop takes it up
                    if not await self._run_round(plan, index, batches, average):
                        return
        finally:
            self._rounds_scope = None
        if scope.cancelled_caught:
            logger.info("%s: round %d (attempt %d) stopped: a newer plan supersedes it", self.log_prefix,
                        plan.round + index, plan.attempt)
            return
        await self._checkpoint(plan)

    async def _run_round(self, plan: RoundPlan, index: int, batches: Iterator[Any], average: Average) -> bool:
        trainer = self.trainer
        assert trainer is not None
        compute = 0.0
        if trainer.pending is None:
            began = time.perf_counter()
            await trio.to_thread.run_sync(trainer.compute_gradient, batches)
            compute = time.perf_counter() - began
            self.compute_s += compute
        assert trainer.pending is not None
        started = time.perf_counter()
        try:
            averaged = await average(trainer.pending, round_id(plan, index))
        except CollectiveError as exc:
            if isinstance(exc, PeerFailed) and exc.peer_id != self.node.peer_id:
                culprit, until = exc.peer_id.to_base58(), trio.current_time() + FAILED_PEER_QUARANTINE_S
                self.failed_peers[culprit] = until
                if exc.gone:
                    self.gone_peers[culprit] = until
                    self._wake.set()  # the election may act on it now (a dead coordinator)
            self.retry_after = trio.current_time() + RETRY_BACKOFF_S
            logger.warning("%s: round %d (attempt %d) failed: %s", self.log_prefix, plan.round + index,
                           plan.attempt, exc)
            await self._report_failure(plan, index, str(exc))
            return False
        synced = time.perf_counter()
        self.sync_s += synced - started
        result = await trio.to_thread.run_sync(trainer.apply, averaged)
        applied = time.perf_counter()
        self.apply_s += applied - synced
        stats = self.collective.last_round
        self.bytes_sent += stats.bytes_sent if stats else 0
        self.rounds_done += 1
        self.metrics["train_loss"] = result.local_loss
        logger.info(
            "%s: round %d step %d done with %d peers: compute %.0f ms, sync %.0f ms, apply %.0f ms "
            "(loss %.4f, %s sent)",
            self.log_prefix, plan.round + index, result.step, len(plan.members), 1e3 * compute,
            1e3 * (synced - started), 1e3 * (applied - synced), result.local_loss,
            _fmt_bytes(stats.bytes_sent if stats else 0),
        )
        return True

    async def _report_failure(self, plan: RoundPlan, index: int, reason: str) -> None:
        """Tell the coordinator (and ourselves, when we are it) that round ``index`` of ``plan`` failed here."""
        assert self.trainer is not None and self.book is not None
        report = RoundFailed(task_cid=self.task_cid, term=plan.term, round=plan.round + index,
                             attempt=plan.attempt, step=self.trainer.step, reason=reason[:256])
        await self.node.publish(self.topic, report)
        self.book.report_failure(report, self.me)

    async def _replicate_data(self) -> None:
        """Hold every shard (training, then test), after our own: if the peer that published the
        dataset dies, whichever shards a new ring assigns us, and the test split a new coordinator
        evaluates on, can still be had from the other members."""
        assert self.manifest is not None
        await trio.sleep(self.node.config.heartbeat_interval * 2)  # own shards first
        test = self.manifest.shards(self.task.dataset.test_split) if self.task.dataset.test_split in self.manifest.splits else ()
        for ref in (*self.manifest.shards(self.task.dataset.train_split), *test):
            try:
                await self.content.fetch(ref.cid)
            except ContentUnavailable as exc:
                logger.debug("%s: could not replicate shard %s yet: %s", self.log_prefix, ref.cid, exc)

    async def _training_batches(self, rank: int, world: int) -> Iterator[Any]:
        """This member's batches for its place in the ring; shards are fetched (only these) first."""
        if self._batches is not None and self._batches[0] == (rank, world):
            return self._batches[1]
        assert self.manifest is not None
        split = self.task.dataset.train_split
        shards = self.manifest.shards(split)
        for index in range(rank, len(shards), world):
            await self.content.fetch(shards[index].cid)
        dataset = IPFSDataset(
            self.task.dataset.manifest, split=split, rank=rank, world_size=world,
            store=self.content.store, seed=self.task.seed + rank,
        )
        batches = batches_forever(dataset, self.task.training.batch_size)
        self._batches = ((rank, world), batches)
        logger.info("%s: training on shards %s of %d (rank %d of %d)", self.log_prefix,
                    list(range(rank, len(shards), world)), len(shards), rank, world)
        return batches

    async def _checkpoint(self, plan: RoundPlan) -> None:
        """Store our weights and optimizer state by CID; as coordinator, publish the signed record."""
        trainer, book = self.trainer, self.book
        assert trainer is not None and book is not None
        # In a thread: serializing a model and its optimizer state copies every tensor (60 ms at 4.3M
        # parameters with Adam), long enough to stall this host's part in the others' traffic.
        model_data, optim_data = await trio.to_thread.run_sync(
            lambda: (trainer.model_bytes(), trainer.optimizer_bytes())
        )
        store = self.content.store
        model_cid = await trio.to_thread.run_sync(store.add_bytes, model_data)
        optim_cid = await trio.to_thread.run_sync(store.add_bytes, optim_data)
        self.checkpoint_cids = {trainer.step: (model_cid, optim_cid)}
        if self.election.is_coordinator and plan.term == self.election.term:
            assert self.manifest is not None
            try:
                for ref in self.manifest.shards(self.task.dataset.test_split):
                    await self.content.fetch(ref.cid)
                metrics = await trio.to_thread.run_sync(self._evaluate)
            except ContentUnavailable as exc:
                # Metrics are a report, not part of the model: publish without them rather than stall.
                logger.warning("%s: cannot evaluate (test data unavailable: %s)", self.log_prefix, exc)
                metrics = {}
            metrics["train_loss"] = self.metrics.get("train_loss", math.nan)
            signed = book.checkpoint_record(plan, trainer.step, model_cid, optim_cid, metrics, self.node.key_pair)
            logger.info("%s: publishing model v%d %s (accuracy %s)", self.log_prefix, signed.record.version,
                        model_cid, _fmt(metrics.get("accuracy")))
            await self.node.publish(self.topic, signed)
            await self._on_record(signed)
        await self._attest_if_ready()

    def _evaluate(self) -> dict[str, float]:
        """Loss and accuracy of the current weights on the task's test split (coordinator only)."""
        assert self.trainer is not None
        split = self.task.dataset.test_split
        dataset = IPFSDataset(self.task.dataset.manifest, split=split, store=self.content.store, shuffle=False)
        metrics = self.trainer.evaluate(batched(dataset, self.task.training.eval_batch_size))
        return {"accuracy": metrics.accuracy, "loss": metrics.loss}

    # -- resync --------------------------------------------------------------------------------

    def _desync(self) -> None:
        self.election.step_down(trio.current_time())
        self.synced = False
        self.state = "resyncing"
        self._advertise(False)

    async def _resync_loop(self) -> None:
        """While out of sync: load the head of the confirmed chain (by CID, verified) and rejoin.

        A member also notices on its own that it fell behind: when the published head stays ahead
        of its chain for two checks in a row (it missed a record, or its attestations), it stops
        advertising the task, so no coordinator puts it into a ring with a stale state.
        """
        behind = 0
        while True:
            with trio.move_on_after(self.node.config.heartbeat_interval):
                await self._catch_up_wake.wait()
            if self._catch_up is not None:
                self._catch_up_wake = trio.Event()
                (sender, plan), self._catch_up = self._catch_up, None
                await self._follow_from_behind(sender, plan)
                continue
            head = self.heads
            if self.book is None or head is None:
                continue
            if self.synced:
                pending = self.tally is not None and self.tally.status is Status.PENDING
                behind = behind + 1 if head.version > self.book.chain.version and not pending else 0
                if behind >= 2:
                    logger.warning("%s: the run is at model v%d, this member at v%d", self.log_prefix,
                                   head.version, self.book.chain.version)
                    self._desync()
                continue
            if head.version == 0:
                continue
            if head.version <= self.book.chain.version and self.trainer and self.trainer.step == self.book.head_step:
                self.synced, self.state = True, "training"
                self._advertise(True)
                continue
            await self._try_load_head(head)

    def _check_signer(self, version: int, term: int, coordinator: str) -> None:
        """A record a head's chain adds must come from the coordinator our election accepted for its
        term (where we know that term), and from no term later than ours (where we know ours)."""
        known = self._coordinators.get(term)
        if known is not None and coordinator != known:
            raise RecordError(f"model record v{version} of term {term} is signed by {short(coordinator)}, "
                              f"the coordinator of that term was {short(known)}")
        if self.election.coordinator is not None and term > self.election.term:
            raise RecordError(f"model record v{version} is of term {term}, after the current term {self.election.term}")

    async def _follow_from_behind(self, sender: str, plan: RoundPlan) -> None:
        """Catch up to the checkpoint ``plan`` starts from, by CID from the run's head, then follow
        it; if that cannot be done now, say so at once so the coordinator retries without us.

        The coordinator publishes the head as soon as a checkpoint is confirmed, next to the plan
        that starts from it, so the head is either here or on its way.
        """
        assert self.trainer is not None and self.book is not None
        with trio.move_on_after(CATCH_UP_WAIT_S):
            while self.heads is None or self.heads.version < plan.version:
                await trio.sleep(0.05)
        head = self.heads
        problem = None
        if head is None or head.version != plan.version or head.model_cid != plan.base_cid:
            problem = f"behind the run, and its head is not the plan's base v{plan.version}"
        elif head.version > self.book.chain.version or not self.trainer.can_align(plan.step):
            failure = await self._try_load_head(head)
            if failure is not None:
                problem = f"could not load the plan's base v{plan.version}: {failure}"
        if problem is None and not self.trainer.can_align(plan.step):
            problem = f"at step {self.trainer.step}, the plan starts at step {plan.step}"
        if problem is not None:
            logger.warning("%s: cannot follow plan %d.%d: %s", self.log_prefix, plan.round, plan.attempt, problem)
            await self._report_failure(plan, 0, f"cannot follow this plan: {problem}")
            return
        if not self.synced:  # at the plan's base already (e.g. step 0 of a run that just began)
            self.synced, self.state = True, "training"
            self._advertise(True)
        if self.book.last_plan is not plan and self.book.plan_problem(plan, sender, self.election) is not None:
            return  # a newer plan came meanwhile: it is queued or catching up
        logger.info("%s: caught up to model v%d; following plan %d.%d", self.log_prefix, plan.version,
                    plan.round, plan.attempt)
        self._follow(plan)

    async def _try_load_head(self, head: TaskHead) -> str | None:
        """The resync path's one boundary: load ``head``, or count and log why not (returned).

        Everything a head names comes from the network: any failure to load it (content missing or
        too large, a DAG that is not a file, a chain that forks or is signed by a stranger, a state
        that does not fit) is a refused resync, never an error out of the run.
        """
        try:
            await self._load_head(head)
        except Exception as exc:  # noqa: BLE001 - the boundary: trio.Cancelled is a BaseException
            if isinstance(exc, RecordError) and str(exc).startswith("fork"):
                self.rejected["fork"] += 1
            known = isinstance(exc, (ContentUnavailable, RecordError, TrainerError, DagError))
            self._refuse("resync_failed", f"resync from model v{head.version} failed: "
                                          f"{exc if known else repr(exc)}")
            return str(exc)
        return None

    async def _load_head(self, head: TaskHead) -> None:
        """Load the chain ``head`` names (it must extend ours), then its head's model and optimizer.

        Every read is bounded: the chain by MAX_CHAIN_BYTES, the state by what this architecture
        takes (Trainer.state_limits). The records it adds must each be signed by the coordinator our
        election accepted for that record's term, where we know that term.
        """
        assert self.trainer is not None and self.book is not None
        store = self.content.store
        await self.content.fetch(head.chain_cid, timeout=RESYNC_FETCH_TIMEOUT_S, max_bytes=MAX_CHAIN_BYTES)
        data = await trio.to_thread.run_sync(lambda: store.cat(head.chain_cid, max_bytes=MAX_CHAIN_BYTES))
        chain = await trio.to_thread.run_sync(Chain.from_bytes, self.task_cid, self.initial_cid, data)
        for signed in self.book.chain.extension(chain):  # a fork raises RecordError
            self._check_signer(signed.record.version, signed.record.term, signed.record.coordinator)
        if chain.version == 0:
            return
        last = chain.records[-1].record
        max_model, max_optim = self.trainer.state_limits()
        await self.content.fetch(last.model_cid, timeout=RESYNC_FETCH_TIMEOUT_S, max_bytes=max_model)
        await self.content.fetch(last.optimizer_cid, timeout=RESYNC_FETCH_TIMEOUT_S, max_bytes=max_optim)
        model = await trio.to_thread.run_sync(lambda: store.cat(last.model_cid, max_bytes=max_model))
        optim = await trio.to_thread.run_sync(lambda: store.cat(last.optimizer_cid, max_bytes=max_optim))
        self.trainer.load_state(model, optim)
        if self.trainer.step != last.step:
            raise TrainerError(f"checkpoint v{last.version} says step {last.step}, its state says {self.trainer.step}")
        observed = self.book.observed if self.book else None
        self.book = RoundBook(self.task, self.task_cid, chain, self.total_steps)
        self.book.observed = observed  # the roster we know of stays the roster
        self.tally = None
        self.metrics.update(last.metrics)
        write_atomic(self.dir / "chain.jsonl", chain.to_bytes(), mode=0o600)
        self.synced, self.state = True, "training"
        self._advertise(True)
        logger.info("%s: resynced to model v%d %s at step %d", self.log_prefix, last.version, last.model_cid, last.step)
        if last.step >= self.total_steps:
            self._done.set()


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
