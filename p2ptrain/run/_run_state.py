"""What the parts of one member's run of a task share: the run's objects, its phase, its counters.

A run is split by job (:mod:`~p2ptrain.run._leading`, :mod:`~p2ptrain.run._spans`,
:mod:`~p2ptrain.run._attesting`, :mod:`~p2ptrain.run._resync`,
:mod:`~p2ptrain.run._datafeed`); each holds only what its job needs and reads the rest here.
What one job tells another goes through :class:`Nudge` (wake a loop now) or a method call, never a
flag another loop polls.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from libp2p.peer.id import ID

from p2ptrain.base import RoundHistograms, arithmetic_of, count_rejection, short_id, write_atomic
from p2ptrain.collective import Collective
from p2ptrain.data import Manifest
from p2ptrain.node import ContentService, Node
from p2ptrain.run._ballots_file import load_voted_through, save_voted_through
from p2ptrain.run._chain_file import ChainFile
from p2ptrain.run._run_dir import RunDir
from p2ptrain.control import Phase
from p2ptrain.protocol import (Attestations, bits_class, ClassClaims, Election, ElectionConfig, HeadAsking, Participation,
                               RecordError, RoundBook)
from p2ptrain.training import RoundTimings, Trainer
from p2ptrain.task import Task, unmet_requirement
from p2ptrain.wire import RoundFailed, RoundPlan, TaskHead, task_topic

logger = logging.getLogger(__name__)

# A peer that never took part and does not vote within this many election timeouts of a vote
# request stops counting (protocol/_participation.py): three, not one, so that votes late on a
# loaded machine (gossip delays of seconds were seen under the test suite) do not strike an honest peer.
ANSWER_TIMEOUTS = 3
# How many peers left out for their arithmetic a member remembers having logged (note_left_out).
MAX_LEFT_OUT_NOTED = 256

class Nudge:
    """Wake one waiting loop now instead of at its next period; a nudge while nobody waits is kept.

    trio's Event cannot be cleared, so each wait that consumed a nudge starts a fresh one: that
    reset lives here, in one place, not in every loop that waits.
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        """Wait for a nudge, at most ``timeout`` seconds (the loop's period); True if nudged."""
        with trio.move_on_after(timeout):
            await self._event.wait()
        nudged = self._event.is_set()
        if nudged:
            self._event = trio.Event()
        return nudged


@dataclass
class RunState:
    """One member's run of one task: set up by :class:`~p2ptrain.run.TaskRun`."""

    node: Node
    content: ContentService
    collective: Collective
    task: Task
    task_cid: str
    election: Election
    me: str = ""
    topic: str = ""
    dir: RunDir = RunDir(Path())
    phase: Phase = Phase.STARTING  # `task status` "state"
    error: str | None = None
    # Whether this member holds the state the run is at (so it advertises the task and may lead).
    synced: bool = False
    # Whether it ever did in this run: only such a member goes back to the run's initial state when
    # it falls out of step before the first confirmed checkpoint (run/_resync.py, restarts_at_root).
    was_synced: bool = False
    # The step of a confirmed checkpoint that this member's own state at that step is not (its
    # steps rounded differently: run/_attesting.py), or the step it holds past steps a retry redid
    # without it (RoundBook.holds_dropped), or of a record whose span's last round failed here while
    # the others completed it (Attesting.lost_span): until it loads a confirmed state by CID it is not
    # synced, and the run does not end for it (run/_resync.py). None: its state is the run's.
    stale_step: int | None = None
    manifest: Manifest | None = None
    total_steps: int = 0
    initial_cid: str = ""
    # The optimizer state at step 0 (data-parallel runs; stored when the run was prepared): with the
    # initial model, what a member goes back to while no checkpoint is confirmed (run/_resync.py).
    initial_optimizer_cid: str = ""
    trainer: Trainer | None = None
    book: RoundBook | None = None
    # The confirmed chain on disk (chain.jsonl): read when the run starts, only ever extended.
    chain_file: ChainFile | None = None
    # The confirmed record this run resumed from when it started with a chain on its home (or took
    # a longer one from the run's other members then): {"version", "step"}; None for a fresh start.
    resumed_from: dict[str, int] | None = None
    heads: TaskHead | None = None  # the latest head of the run heard from its coordinator
    head_sender: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    timings: RoundTimings = field(default_factory=RoundTimings)
    # Every completed round's compute / sync / apply time, bucketed (for `node start --metrics`).
    round_seconds: RoundHistograms = field(default_factory=RoundHistograms)
    # The pending record's count of attestations (and those that came before their record).
    attestations: Attestations = field(default_factory=Attestations)
    bytes_sent: int = 0
    bytes_received: int = 0  # collective frames taken off the wire (the metrics' collective/received)
    rounds_done: int = 0
    # Heads and chains refused, resyncs that failed, by kind: shown in `task status` ("rejected").
    rejected: Counter[str] = field(default_factory=Counter)
    # A pipelined task: replicas convicted of altered activations (run/_stages.py), peer ->
    # {"peer", "stage", "times", "step"} (the last); shown in `task status` ("stage_suspects").
    stage_suspects: dict[str, dict[str, Any]] = field(default_factory=dict)
    # As a driver: disagreements of two replicas nobody could decide, (stage, a, b) -> times
    # (`task status`'s "stage_disagreements"; nobody is left out on them).
    stage_disagreements: Counter[tuple[int, str, str]] = field(default_factory=Counter)
    # The coordinator may be able to plan now (a span ended, a checkpoint was confirmed or
    # rejected, a failure was reported): its control loop wakes at once, not at its next tick.
    wake_leader: Nudge = field(default_factory=Nudge)
    done: trio.Event = field(default_factory=trio.Event)
    # How many more peers the run waits for (a quorum of its roster to elect a coordinator, or
    # peers.min to plan a span), and since when (trio time); 0 and None while it does not wait.
    waiting_for: int = 0
    waiting_since: float | None = None
    # The publisher's reason, once it cancelled the run (see cancel), and when that was heard.
    cancel_reason: str | None = None
    cancelled_at: float = 0.0
    # Set by TaskRun: hands a message this member sent to its own handlers, as a peer's would be.
    deliver_own: Callable[[Any], Awaitable[None]] | None = None
    # The election's voted_through as this home keeps it (run/_ballots_file.py).
    voted_saved: int = -1
    # A pipelined run that went back to its last confirmed checkpoint because a stage lost every
    # replica, as this member last followed it: {"stages", "moved", "step", "version", "redone"}
    # (`task status`'s stage_recovery; run/_plan_intake.py).
    stage_recovery: dict[str, Any] | None = None
    # Who of the peers advertising the task takes part in it (votes, rounds): only they count.
    participation: Participation = field(default_factory=Participation)
    # The live peers the run's plans leave out for their arithmetic, as this member sees them now
    # (protocol/_arithmetics.py): peer -> what it advertises (None: nothing); `task status`'s
    # arithmetic_left_out, with the run's class (arithmetic_run).
    left_out: dict[str, str | None] = field(default_factory=dict)
    arithmetic_run: str | None = None
    # The arithmetic each peer was last logged and counted as left out with (note_left_out): once each.
    left_out_noted: dict[str, str | None] = field(default_factory=dict)
    # The terms each class of arithmetic failed to lead this fresh run in: until a plan is taken, the
    # peers of a class that failed more often than another that could plan do not count
    # (protocol/_class_claims.py); the classes barred at the latest count of the live peers.
    claims: ClassClaims = field(default_factory=ClassClaims)
    barred: frozenset[str] = frozenset()
    # When to ask the mesh for the run's head, left behind at its end (run/_resync.py): the later
    # version the coordinator's records named is noted where they are refused (run/_attesting.py).
    asking: HeadAsking = field(default_factory=HeadAsking)

    @classmethod
    def create(cls, node: Node, content: ContentService, collective: Collective, task: Task, task_cid: str) -> RunState:
        run_dir = RunDir.of(node.home, task_cid)
        election = Election(task_cid, node.key_pair, ElectionConfig(heartbeat_s=node.config.heartbeat_interval),
                            voted_through=load_voted_through(run_dir), max_members=task.peers.max)
        return cls(node=node, content=content, collective=collective, task=task, task_cid=task_cid,
                   election=election, me=node.peer_id.to_base58(), topic=task_topic(task_cid),
                   dir=run_dir, voted_saved=election.voted_through,
                   participation=Participation(answer_s=ANSWER_TIMEOUTS * election.config.timeout_s),
                   claims=ClassClaims(min_term_s=election.config.timeout_s / 2))

    @property
    def log_prefix(self) -> str:
        return f"task {self.task.name} ({self.task_cid[:10]}) peer {short_id(self.node.peer_id)}"

    def require(self) -> tuple[Trainer, RoundBook]:
        """The trainer and the book, which exist from the end of the run's preparation on."""
        if self.trainer is None or self.book is None:
            raise RuntimeError("the run is not prepared yet")
        return self.trainer, self.book

    # -- what every job does -----------------------------------------------------------------

    async def broadcast(self, msg: Any) -> None:
        """Publish ``msg`` on the task's topic and handle it here too, as every other member does.

        Pubsub does not deliver a peer's own messages back to it: this is the one place where a
        member's plans, records, attestations and failure reports reach its own handlers.
        """
        await self.node.publish(self.topic, msg)
        if self.deliver_own is not None:
            await self.deliver_own(msg)

    async def report_failure(self, plan: RoundPlan, index: int, reason: str) -> None:
        """Tell the coordinator (and ourselves, when we are it) that round ``index`` of ``plan`` failed here."""
        trainer, _ = self.require()
        await self.broadcast(RoundFailed(task_cid=self.task_cid, term=plan.term, round=plan.round + index,
                                         attempt=plan.attempt, step=trainer.step, reason=reason[:256]))

    def advertise(self, on: bool) -> None:
        """Say (in our heartbeats) whether we hold the run's state: only advertising peers are planned."""
        tasks = set(self.node.membership.tasks)
        tasks.add(self.task_cid) if on else tasks.discard(self.task_cid)
        if set(self.node.membership.tasks) != tasks:
            self.node.membership.tasks = tuple(sorted(tasks))
            self.node.membership.poke()

    def save_ballots(self) -> None:
        """Keep the election's ``voted_through`` on disk if it grew: call it after a tick or a
        receive and before publishing what it returned (run/_ballots_file.py says why)."""
        voted = self.election.voted_through
        if voted > self.voted_saved:
            save_voted_through(self.dir, voted)
            self.voted_saved = voted

    def save_chain(self) -> None:
        """Append to chain.jsonl the records the book's chain adds to it (run/_chain_file.py).
        A chain that does not extend the file (a fork) is refused, counted and logged there; the
        file is kept as it was and the run goes on."""
        if self.book is None or self.chain_file is None:
            return
        try:
            self.chain_file.extend(self.book.chain)
        except RecordError as exc:
            self.rejected["fork"] += 1
            self.refuse("chain_file", f"chain.jsonl not extended: {exc}")

    def set_synced(self) -> None:
        self.synced, self.was_synced, self.phase = True, True, Phase.TRAINING
        self.advertise(True)

    def desync(self, now: float) -> None:
        """Our state is not the run's: stop leading and advertising until the resync loop loads it."""
        self.election.step_down(now)
        self.synced, self.phase = False, Phase.RESYNCING
        self.advertise(False)

    def mark_stale(self, step: int, now: float) -> None:
        """This member's state at ``step`` is not the run's (:attr:`stale_step`: its own steps rounded
        differently, the run redid them without it, or its last round failed here): it desyncs, and
        the resync loop loads a confirmed state by CID before it trains on or ends."""
        self.stale_step = step
        if self.synced:
            self.desync(now)

    def end_of_run(self) -> str | None:
        """:meth:`RoundBook.end_of_run` for this member: "load", not "done", while its own state at
        a confirmed step was not the confirmed one (:attr:`stale_step`): it ends holding the run's
        last checkpoint, not weights of its own that happen to be at the same step (or a step
        before: its last round failed here, Attesting.lost_span)."""
        trainer, book = self.require()
        verdict = book.end_of_run(self.me, trainer.step)
        over = book.head_step >= self.total_steps
        return "load" if over and self.stale_step is not None else verdict

    def end_if_over(self) -> None:
        """Done once the confirmed chain ends the run and this member holds its last checkpoint.
        A member that does not (:meth:`RoundBook.end_of_run` says "load": the last span ran without
        it) resyncs first: the resync loop loads that checkpoint by CID, then ends the run. Done at
        once, it ended naming a model whose weights it did not hold."""
        trainer, book = self.require()
        verdict = self.end_of_run()
        if verdict == "done":
            self.done.set()
        elif verdict == "load" and self.synced:
            how = "not with this member's state" if self.stale_step is not None else \
                f"without this member (at step {trainer.step})"
            logger.info("%s: the run ended at step %d %s: loading its last checkpoint", self.log_prefix,
                        book.head_step, how)
            self.desync(trio.current_time())

    def note_waiting(self, short: int, now: float, convicted: Mapping[str, float] | None = None) -> None:
        """Record (and log, once per wait) that the run needs ``short`` more peers (0: it does not);
        ``convicted``: the replicas left out of plans for now by a conviction, with until when (the
        reason a run of exactly ``peers.min`` members waits: protocol/_quarantine.py)."""
        if short and self.waiting_since is None:
            self.waiting_since = now
            out = "".join(f"; replica {short_id(p)} convicted, left out for {until - now:.0f} s more"
                          for p, until in sorted((convicted or {}).items()))
            logger.info("%s: waiting for %d more peer(s) (peers.min %d%s); not electing or planning until then",
                        self.log_prefix, short, self.task.peers.min, out)
        elif not short and self.waiting_since is not None:
            logger.info("%s: enough peers again after waiting %.0f s", self.log_prefix, now - self.waiting_since)
            self.waiting_since = None
        self.waiting_for = short

    def cancel(self, reason: str) -> None:
        """The publisher cancelled the run: plan no more; the control loop ends the run at the next
        span boundary (:meth:`~p2ptrain.run._leading.Leading.cancel_settled`)."""
        if self.cancel_reason is not None:
            return
        self.cancel_reason, self.cancelled_at = reason or "cancelled by the publisher", trio.current_time()
        if self.book is not None:
            self.book.cancelled = True
        self.dir.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.dir.cancelled, self.cancel_reason.encode(), mode=0o600)
        logger.info("%s: cancelled by the task's publisher (%s); stopping at the end of the span under way",
                    self.log_prefix, self.cancel_reason)
        self.wake_leader.set()

    def uncancel(self) -> None:
        """The publisher resumed the run before its cancel settled (task resume): plan again."""
        if self.cancel_reason is None:
            return
        self.cancel_reason = None
        if self.book is not None:
            self.book.cancelled = False
        self.dir.cancelled.unlink(missing_ok=True)
        logger.info("%s: resumed by the task's publisher before the cancel settled", self.log_prefix)
        self.wake_leader.set()

    def advertising(self) -> set[str]:
        """Peers that advertise this task (so hold the state the run is at), meet its requirements,
        where the task has an allowlist are on it, take part in the run or are new to it
        (:class:`~p2ptrain.protocol.Participation`), and in a fresh run are of no class barred
        from it (:attr:`barred`, updated here): only these are planned and vote."""
        others = set()
        for record in self.node.membership.alive():
            peer = record.peer_id.to_base58()
            if (peer != self.me and self.task_cid in record.tasks and unmet_requirement(self.task, record.caps) is None
                    and self.task.peers.admits(peer)):
                others.add(peer)
        mine = 1 if self.synced else 0
        live = set(self.participation.counted(trio.current_time(), others, needed=self.task.peers.min - mine))
        if mine:
            live.add(self.me)
        self.barred = self._barred_classes(live)
        return {p for p in live if self.class_of(p) not in self.barred} if self.barred else live

    def class_of(self, peer: str) -> str | None:
        """``peer``'s class of arithmetic (:func:`~p2ptrain.protocol.bits_class`; None: unknown)."""
        return bits_class(self.arithmetic(peer))

    def _barred_classes(self, live: set[str]) -> frozenset[str]:
        """The classes whose peers count for nothing in this run now, of the ``live`` peers: none
        once a plan was taken or a record confirmed; before, those that failed to lead the run more
        often than another that could plan (protocol/_class_claims.py). Counted, such Sybils were a
        majority of the first election's voters and held its class for as long as they voted."""
        if not self.claims.has_lapses or self.book is None or self.book.history():
            return frozenset()
        present = Counter(c for c in map(self.class_of, live) if c is not None)
        return self.claims.barred(present, self.task.peers.min)

    def arithmetic(self, peer: str) -> str | None:
        """The arithmetic ``peer``'s steps use: this member's own from its trainer, another's as its
        heartbeats advertise it (None until its torch probe ran, or from an older version)."""
        if peer == self.me:
            return arithmetic_of(self.trainer.device) if self.trainer is not None else None
        record = self.node.membership.get(ID.from_base58(peer))
        return record.caps.arithmetic if record is not None else None

    def note_left_out(self, peer: str, why: str) -> None:
        """Log and count (``arithmetic_left_out`` under ``rejected``) that the run's plans leave
        ``peer`` out for its arithmetic: once per peer and arithmetic it advertises, not at every plan.
        At most MAX_LEFT_OUT_NOTED peers are remembered (the oldest forgotten), so heartbeats from
        ever new peer IDs cannot grow it."""
        arithmetic = self.left_out.get(peer)
        if peer in self.left_out_noted and self.left_out_noted[peer] == arithmetic:
            return
        self.left_out_noted.pop(peer, None)
        if len(self.left_out_noted) >= MAX_LEFT_OUT_NOTED:
            del self.left_out_noted[next(iter(self.left_out_noted))]
        self.left_out_noted[peer] = arithmetic
        self.rejected["arithmetic_left_out"] += 1
        logger.warning("%s: %s [arithmetic_left_out: %d so far]", self.log_prefix, why, self.rejected["arithmetic_left_out"])

    def accuse(self, coordinator: str, why: str) -> None:
        """``coordinator`` signed a plan or record that breaks the run's rules: stop following it
        (the election moves on and never votes for it again) and leave it out of plans we make."""
        now = trio.current_time()
        logger.warning("%s: coordinator %s broke the run's rules (%s); no longer following it",
                       self.log_prefix, short_id(coordinator), why)
        self.election.give_up(now, coordinator)
        if self.book is not None:
            self.book.note_silent_coordinator(now, coordinator)
        self.wake_leader.set()

    def refuse(self, kind: str, why: str) -> None:
        """Count a refusal of ``kind``; log it the 1st, 2nd, 4th, 8th... time (a flood stays a few lines)."""
        count_rejection(self.rejected, kind, logger, logging.WARNING, "%s: %s", self.log_prefix, why)
