"""Bringing a member to the run's state: heads heard, the confirmed chain loaded by CID, catching up
to a plan that starts from a checkpoint this member lacks.

A member that is not at a confirmed state (a late joiner, one that missed a round or a record)
stops advertising the task, loads the head of the confirmed chain (by CID, verified, every read
bounded) and only then advertises again, so no coordinator puts it into a ring with stale weights.
Before the run's first confirmed record that state is the chain's root, the task's initial model at
step 0, which a member that held the run's state goes back to on its own (:meth:`Resync.load_root`).
Everything a head names comes from the network: a head is heard only from the coordinator our
election accepted, and the chain it names must extend ours, each added record signed by the
coordinator of its term where we know it. A member left behind at the run's end, when no coordinator
publishes heads any more, asks the run's finished members for the head and loads an answer only if
every record it adds is one it would have taken live (protocol/_trailing.py).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager

import trio

from p2ptrain.ipfs import ContentUnavailable, DagError
from p2ptrain.base import short_id
from p2ptrain.run._resync_rules import (after_load, head_wanted, restarts_at_root, slow_step, unsynced_action,
                                        Unsynced, WaitNotes)
from p2ptrain.run._run_state import Nudge, RunState
from p2ptrain.protocol import (Chain, chain_lines, HeadOffers, MAX_CHAIN_BYTES, Misconduct, RecordError,
                               witness_problem, witnessable, witnessed_chain_limits, won_alone)
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.training import check_stage_signatures, is_manifest, ManifestError, read_manifest, TrainerError
from p2ptrain.wire import HeadRequest, RoundPlan, TASKS_TOPIC, TaskHead

logger = logging.getLogger(__name__)

# Fetching a head's chain, model or optimizer state: each is bounded in bytes too (MAX_CHAIN_BYTES,
# Trainer.state_limits), so this only ends a transfer that stalls; 60 s is ContentService's default.
RESYNC_FETCH_TIMEOUT_S = 60.0
# A member listed in a plan from a checkpoint it lacks waits this long for the head that names it
# (the coordinator publishes it next to the plan), then tells the coordinator it cannot follow.
CATCH_UP_WAIT_S = 2.0
# The resync loop looks at the run's head this often (in heartbeats) when nothing wakes it: a synced
# member whose chain stays behind the head for BEHIND_CHECKS looks in a row (no record pending) has
# missed a record, and resyncs. Heads come every HEAD_EVERY_S (2 s), so two looks span one head.
CHECK_EVERY_BEATS = 1.0
BEHIND_CHECKS = 2
# Terms whose coordinator (as our election accepted it) is remembered, to check who signed the
# records a head's chain adds: 256 terms (a few KiB) go back further than any member stays away.
KNOWN_TERMS = 256


class Resync:
    """Heads, the resync loop and catching up to a plan; calls ``follow`` once a plan can be run."""

    def __init__(self, run: RunState, restore_feedback: Callable[[int], None], busy: Callable[[], bool],
                 hold: Callable[[], AbstractAsyncContextManager[None]]) -> None:
        """``restore_feedback(step)``: take back the error feedback this member kept at ``step``
        (:meth:`~p2ptrain.run._spans.Spans.restore_feedback`), once its checkpoint is loaded; ``busy()``:
        whether a span of ours runs (the resync loop loads nothing then: it ends first; a plan that lists us
        is caught up to, which stops it); ``hold()``: the trainer to a load alone (``Spans.hold_trainer``)."""
        self.run, self.restore_feedback, self.busy, self.hold = run, restore_feedback, busy, hold
        # term -> the coordinator our election accepted for it (the last KNOWN_TERMS terms)
        self.coordinators: dict[int, str] = {}
        self._new_head = Nudge()  # a new head was heard (wakes a member waiting to catch up)
        # Heads heard from the run's members while no coordinator is known (protocol/_trailing.py).
        self.offers = HeadOffers()
        self._catch_up_send, self._catch_up_recv = trio.open_memory_channel[tuple[str, RoundPlan]](1)
        self._behind = 0  # looks in a row that found the head ahead of our chain (BEHIND_CHECKS)
        self._waits = WaitNotes()

    # -- heads -----------------------------------------------------------------------------------

    def note_coordinator(self) -> None:
        """Remember who our election accepted for the current term (for checking chains later), but
        not a term this member won by its own vote alone (``protocol.won_alone``): a fresh home that
        stood alone while the run's members resumed refused their chain for good ("record v1 of term
        1 is signed by X, the coordinator of that term was" itself), and the run, one member short
        of peers.min, stalled (tests/runtime/test_whole_run_restart.py, about 1 full suite in 3)."""
        election = self.run.election
        if election.coordinator is not None and not won_alone(election.certificate, self.run.me):
            self.coordinators[election.term] = election.coordinator
            while len(self.coordinators) > KNOWN_TERMS:
                del self.coordinators[min(self.coordinators)]

    def on_head(self, sender: str, head: TaskHead) -> None:
        run = self.run
        if run.election.coordinator is None and run.book is not None and 0 < head.version <= run.book.chain.version:
            # No news from a peer whose head we would refuse anyway (no coordinator known): the
            # members of a run that resumed answer each other's head requests while they start.
            return
        problem = self.head_problem(sender)
        if problem is not None and run.election.coordinator is None and run.book is not None:
            # Between terms, or after the run ended (nobody publishes heads): one of the run's
            # members may be answering our head request. Never acted on as a coordinator's head:
            # the resync loop loads it only if this member witnessed every record it adds.
            now = trio.current_time()
            problem = self.offers.offer(now, sender, head, version=run.book.chain.version, roster=self._members(),
                                        most=witnessable(run.book.span_plans, run.book.head_step),
                                        asked=run.asking.awaiting(now))
            if problem is None:
                return
        if problem is not None:
            run.refuse("head_untrusted", f"ignored a head (model v{head.version}): {problem}")
            return
        if (run.heads is None or sender != run.head_sender
                or (head.version, head.step) >= (run.heads.version, run.heads.step)):
            run.heads, run.head_sender = head, sender
            self._new_head.set()
        if head.done and run.synced and run.book and run.book.chain.version >= head.version:
            run.end_if_over()

    def head_problem(self, sender: str) -> str | None:
        """Why a head from ``sender`` is not to be acted on, or None.

        A head makes a member stop advertising and load a chain, a model and an optimizer state by
        CID, so only the coordinator our election accepted (a quorum of the roster voted for it) is
        heard. A member that knows no coordinator right now (between terms) waits for the next one,
        unless it never held the run's state (a fresh joiner, with no confirmed model): it has no
        other way into a run under way and trusts the head's sender (see docs/training.md, "Heads
        and resync"). One that held it, even at v0, waits too: a stranger's head past v0 made it
        desync between terms, and a member that is not synced does not stand, so nobody was
        elected again (tests/runtime/test_resync_trust.py).
        """
        run = self.run
        coordinator = run.election.coordinator
        if coordinator is not None:
            if sender == coordinator:
                return None
            return f"from {short_id(sender)}, not the coordinator {short_id(coordinator)} of term {run.election.term}"
        if run.book is not None and (run.book.chain.version > 0 or run.was_synced):
            return f"from {short_id(sender)} while no coordinator is known"
        return None

    def _members(self) -> set[str]:
        """The run's members as this member knows them, whose head it may try with no coordinator
        known: those of the latest plan it accepted and of its chain's last record."""
        _, book = self.run.require()
        members = set(book.accepted.members) if book.accepted is not None else set()
        if book.chain.records:
            members.update(book.chain.records[-1].record.members)
        members.discard(self.run.me)
        return members

    async def ask_and_try_offers(self) -> bool:
        """Left behind with no coordinator known (protocol/_trailing.py): ask the mesh for the run's
        head when :class:`~p2ptrain.protocol.HeadAsking` says so, and try a head a member of the
        run offered (True: one was tried). A coordinator known again drops the offers."""
        run = self.run
        _, book = run.require()
        now = trio.current_time()
        known = run.election.coordinator is not None
        if run.was_synced and run.asking.due(now, version=book.chain.version, coordinator_known=known):
            logger.info("%s: no coordinator heard at model v%d%s: asking the run's members for its head",
                        run.log_prefix, book.chain.version,
                        f" (the run confirmed v{run.asking.later})" if run.asking.later > book.chain.version else "")
            await run.node.publish(TASKS_TOPIC, HeadRequest(task_cid=run.task_cid))
        if known:
            self.offers.clear()
            return False
        offer = None if self.busy() else self.offers.take(book.chain.version)  # (kept while a span runs)
        if offer is None:
            return False
        sender, head = offer
        if await self._load_bounded(head.version, self._load_head(head, witnessed=True)) is not None:
            self.offers.failed(trio.current_time(), sender)
        return True

    # -- catching up to a plan ---------------------------------------------------------------

    def catch_up(self, sender: str, plan: RoundPlan) -> None:
        """Listed in ``plan`` from a checkpoint we do not hold: load it, then follow the plan (the newest wins)."""
        try:
            self._catch_up_recv.receive_nowait()
        except trio.WouldBlock:
            pass
        self._catch_up_send.send_nowait((sender, plan))

    async def run_loop(self, follow: Callable[[RoundPlan], None]) -> None:
        """While out of sync: load the run's state by CID (verified) and rejoin; catch up to plans that
        list us from a checkpoint we lack. It says what a member that stays out of sync waits for
        (WaitNotes), and a catch-up or look that took long (slow_step)."""
        run = self.run
        period = run.node.config.heartbeat_interval * CHECK_EVERY_BEATS
        while True:
            caught_up = None
            with trio.move_on_after(period):
                caught_up = await self._catch_up_recv.receive()
            began = trio.current_time()
            if caught_up is not None:
                await self._follow_from_behind(*caught_up, follow)
            waiting = None if caught_up is not None else await self._look()
            now = trio.current_time()
            doing = f"catching up to plan {caught_up[1].round}.{caught_up[1].attempt}" if caught_up else "a look"
            for line in (slow_step(now - began, doing), self._waits.note(now, run.synced, waiting)):
                if line is not None and run.book is not None and run.trainer is not None:
                    logger.warning("%s: %s (at step %d, its chain at model v%d of step %d)", run.log_prefix, line,
                                   run.trainer.step, run.book.chain.version, run.book.head_step)

    async def _look(self) -> str | None:
        """One look of the resync loop: what this member waits for (None: it acted, or needs nothing).
        A synced member whose head stays ahead of its chain for BEHIND_CHECKS looks (no record
        pending) missed a record: it stops advertising. Nothing is loaded under a span of ours."""
        run = self.run
        if run.book is None or run.trainer is None or await self.ask_and_try_offers():
            return None  # (the run is being prepared, or it tried a head a member of the run offered)
        book, head, election = run.book, run.heads, run.election
        if run.synced:
            if head is not None:
                ahead = head.version > book.chain.version and not run.attestations.pending
                self._behind = self._behind + 1 if ahead else 0
                if self._behind >= BEHIND_CHECKS:
                    logger.warning("%s: the run is at model v%d, this member at v%d", run.log_prefix,
                                   head.version, book.chain.version)
                    run.desync(trio.current_time())
            return None
        # Our chain's last checkpoint: the run ended without us, our own state at a confirmed step was
        # not the confirmed one (stale_step), or no head heard names a version past our chain.
        load: Callable[[], Awaitable[str | None]] = self.try_load_last_checkpoint
        if run.end_of_run() == "load":
            return after_load(await load())
        if restarts_at_root(book.chain.version, head, pending=run.attestations.pending, was_synced=run.was_synced):
            load = self.try_load_root
        elif run.stale_step is None:
            action = unsynced_action(book.chain.version, book.head_step, run.trainer.step, head)
            if action is Unsynced.SYNCED:
                run.set_synced()
                return None
            if action is Unsynced.WAIT:
                return head_wanted(head, election.coordinator, election.term)
            if action is Unsynced.LOAD_HEAD and head is not None:
                load = functools.partial(self.try_load_head, head)
        if self.busy():
            return "the span of this member under way to end (nothing is loaded under it)"
        return after_load(await load())

    async def _head_at_least(self, version: int) -> TaskHead | None:
        """The run's head once it names ``version`` or later, waiting at most CATCH_UP_WAIT_S."""
        run = self.run
        deadline = trio.current_time() + CATCH_UP_WAIT_S
        while (run.heads is None or run.heads.version < version) and trio.current_time() < deadline:
            await self._new_head.wait(deadline - trio.current_time())
        return run.heads

    async def _follow_from_behind(self, sender: str, plan: RoundPlan, follow: Callable[[RoundPlan], None]) -> None:
        """Catch up to the checkpoint ``plan`` starts from, by CID from the run's head, then follow
        it; if that cannot be done now, say so at once so the coordinator retries without us.

        The coordinator publishes the head as soon as a checkpoint is confirmed, next to the plan
        that starts from it, so the head is either here or on its way.
        """
        run = self.run
        trainer, book = run.require()
        problem = None
        if plan.step == 0 and plan.version == 0 and book.chain.version == 0:
            # The plan starts at the run's initial state, which every member holds without a head.
            if not trainer.can_align(0) and (failure := await self.try_load_root()) is not None:
                problem = f"could not go back to the run's initial state: {failure}"
        elif (head := await self._head_at_least(plan.version)) is None or head.version != plan.version \
                or head.model_cid != plan.base_cid:
            problem = f"behind the run, and its head is not the plan's base v{plan.version}"
        elif head.version > book.chain.version or not trainer.can_align(plan.step) or run.stale_step is not None:
            # Our state is not the run's (RoundBook.holds_dropped) before any checkpoint: the run's
            # confirmed state is its root (a v0 head names nothing to load).
            root = run.stale_step is not None and head.version == 0
            failure = await (self.try_load_root() if root else self.try_load_head(head))
            if failure is not None:
                problem = f"could not load the plan's base v{plan.version}: {failure}"
        if problem is None and not trainer.can_align(plan.step):
            problem = f"at step {trainer.step}, the plan starts at step {plan.step}"
        if problem is not None:
            logger.warning("%s: cannot follow plan %d.%d: %s", run.log_prefix, plan.round, plan.attempt, problem)
            await run.report_failure(plan, 0, f"cannot follow this plan: {problem}")
            return
        if not run.synced:  # at the plan's base already (e.g. step 0 of a run that just began)
            run.set_synced()
        _, book = run.require()  # a load replaced it
        if book.last_plan is not plan and book.plan_problem(plan, sender, run.election) is not None:
            return  # a newer plan came meanwhile: it is queued or catching up
        logger.info("%s: caught up to model v%d; following plan %d.%d", run.log_prefix, plan.version,
                    plan.round, plan.attempt)
        follow(plan)

    # -- loading a head ----------------------------------------------------------------------

    async def try_load_head(self, head: TaskHead) -> str | None:
        """The resync path's one boundary: load ``head``, or count and log why not (returned).

        Everything a head names comes from the network: any failure to load it (content missing or
        too large, a DAG that is not a file, a chain that forks or is signed by a stranger, a state
        that does not fit) is a refused resync, never an error out of the run.
        """
        return await self._load_bounded(head.version, self._load_head(head))

    async def try_load_last_checkpoint(self) -> str | None:
        """Load the last checkpoint of our own confirmed chain (the run ended without us; see
        :meth:`RunState.end_if_over`), through the same boundary as a head; before any, the run's
        root (our state was not the run's: RoundBook.holds_dropped)."""
        _, book = self.run.require()
        if book.chain.version == 0:
            return await self.try_load_root()
        return await self._load_bounded(book.chain.version, self.load_chain(book.chain))

    async def _load_bounded(self, version: int, loading: Awaitable[None]) -> str | None:
        run = self.run
        try:
            await loading
        except Exception as exc:  # the boundary: trio.Cancelled is a BaseException
            if isinstance(exc, RecordError) and str(exc).startswith("fork"):
                run.rejected["fork"] += 1
            known = isinstance(exc, (ContentUnavailable, RecordError, TrainerError, DagError))
            run.refuse("resync_failed", f"resync from model v{version} failed: {exc if known else repr(exc)}")
            return str(exc)
        return None

    async def try_load_root(self) -> str | None:
        """Go back to the run's initial state (:meth:`load_root`), through the same boundary as a head."""
        return await self._load_bounded(0, self.load_root())

    async def load_root(self) -> None:
        """Hold the run's state at model v0, the task's initial model at step 0, and say so.

        Before its first confirmed record the run's state is the root of its chain, which every
        member has from the task itself: the initial model and optimizer state it stored when it
        prepared the run (a pipelined member holds no stage at step 0 and takes its plan's from the
        seed or the initial manifest), and no error feedback (nothing was left unsent before step 0).
        Without this, members that all fell out of step at v0 had no head to resync from, so none
        could stand for election again: every term passed with nobody standing (docs/training.md,
        "Heads and resync")."""
        run = self.run
        trainer, book = run.require()
        if book.chain.version != 0:
            raise RecordError(f"this member holds model v{book.chain.version}: the run is past its initial state")
        async with self.hold():
            if isinstance(trainer, StagedTrainer):
                trainer.back_to(0)
            else:
                store = run.content.store
                max_model, max_optim = trainer.state_limits()
                model = await trio.to_thread.run_sync(lambda: store.cat(run.initial_cid, max_bytes=max_model))
                optim = await trio.to_thread.run_sync(lambda: store.cat(run.initial_optimizer_cid, max_bytes=max_optim))
                await trio.to_thread.run_sync(trainer.load_state, model, optim)
            if trainer.step != 0:
                raise TrainerError(f"the run's initial state says step {trainer.step}")
            self.restore_feedback(0)
        run.stale_step = None  # our state is the run's root now
        run.book = book.resynced(book.chain)
        run.attestations.clear()
        logger.info("%s: back to the run's initial state (model v0 %s, step 0): no checkpoint is confirmed yet",
                    run.log_prefix, run.initial_cid)
        run.set_synced()

    def _check_signer(self, version: int, term: int, coordinator: str) -> None:
        """A record a head's chain adds must come from the coordinator our election accepted for its
        term (where we know that term), and from no term later than ours (where we know ours)."""
        election = self.run.election
        known = self.coordinators.get(term)
        if known is not None and coordinator != known:
            raise RecordError(f"model record v{version} of term {term} is signed by {short_id(coordinator)}, "
                              f"the coordinator of that term was {short_id(known)}")
        if election.coordinator is not None and term > election.term:
            raise RecordError(f"model record v{version} is of term {term}, after the current term {election.term}")

    async def _load_head(self, head: TaskHead, *, witnessed: bool = False) -> None:
        """Load the chain ``head`` names (it must extend ours), then its head's model and optimizer.

        Every read is bounded: the chain by MAX_CHAIN_BYTES, the state by what this architecture
        takes (Trainer.state_limits). The records it adds must each be signed by the coordinator our
        election accepted for that record's term, where we know that term; with ``witnessed`` (a
        head from no coordinator), each must also be of a span whose plan we accepted, signed by the
        coordinator we accepted for its term (:func:`~p2ptrain.protocol.witness_problem`).
        """
        run = self.run
        _, book = run.require()
        store = run.content.store
        # No coordinator known: no more records (or bytes) than held and witnessable (protocol/_trailing.py).
        most, most_bytes = (witnessed_chain_limits(book.chain.version, witnessable(book.span_plans, book.head_step))
                            if witnessed else (0, MAX_CHAIN_BYTES))
        await run.content.fetch(head.chain_cid, timeout=RESYNC_FETCH_TIMEOUT_S, max_bytes=most_bytes)
        data = await trio.to_thread.run_sync(lambda: store.cat(head.chain_cid, max_bytes=most_bytes))
        if witnessed and len(chain_lines(data)) > most:
            raise RecordError(f"the head's chain holds more than the {most} records this member holds or could witness")
        chain = await trio.to_thread.run_sync(Chain.from_bytes, run.task_cid, run.initial_cid, data, book.chain.rules)
        added = book.chain.extension(chain)  # a fork raises RecordError
        if chain.version < book.chain.version:
            # Loading it would take this member back behind records it confirmed (and a chain
            # file is never cut short): a head from behind is no state to go to.
            raise RecordError(f"the head's chain ends at v{chain.version}, before this member's v{book.chain.version}")
        for signed in added:
            self._check_signer(signed.record.version, signed.record.term, signed.record.coordinator)
        problem = book.lineage_problem(added)
        if problem is not None:
            raise Misconduct(problem)
        if witnessed:
            problem = witness_problem(added, book.span_members, self.coordinators) if added else \
                f"the head's chain adds no record to this member's v{book.chain.version}"
            if problem is not None:
                raise RecordError(problem)
        await self.load_chain(chain)

    async def load_chain(self, chain: Chain, *, sync: bool = True) -> None:
        """Load the model and optimizer state of ``chain``'s last checkpoint (a verified chain that
        extends ours, or ours), by CID and verified, and follow the run from it (``sync``: say so
        at once; a member that resumes after a stop first hears the others, run/_resume.py).

        The chain goes to chain.jsonl only as records appended to the file's: one that does not
        extend the file (a fork) is refused before anything is loaded (RecordError)."""
        run = self.run
        trainer, book = run.require()
        store = run.content.store
        if chain.version == 0:
            return
        if run.chain_file is not None:
            run.chain_file.chain.extension(chain)  # a fork of the file raises RecordError
        last = chain.records[-1].record
        max_model, max_optim = trainer.state_limits()
        await run.content.fetch(last.model_cid, timeout=RESYNC_FETCH_TIMEOUT_S, max_bytes=max_model)
        await run.content.fetch(last.optimizer_cid, timeout=RESYNC_FETCH_TIMEOUT_S, max_bytes=max_optim)
        model = await trio.to_thread.run_sync(lambda: store.cat(last.model_cid, max_bytes=max_model))
        optim = await trio.to_thread.run_sync(lambda: store.cat(last.optimizer_cid, max_bytes=max_optim))
        if is_manifest(model):
            # A pipelined run's checkpoint: the manifest now, the stage a plan names when it names it
            # (run/_stages.py, StageRounds.take).
            if not isinstance(trainer, StagedTrainer):
                raise RecordError(f"checkpoint v{last.version} names a pipelined run's stages; this task has none")
            try:  # each stage's files signed by a quorum of its replicas (run/_stage_checkpoints.py)
                check_stage_signatures(read_manifest(model), last)
            except ManifestError as exc:
                raise RecordError(f"checkpoint v{last.version}: {exc}") from None
        async with self.hold():
            if isinstance(trainer, StagedTrainer) and is_manifest(model):  # (checked above)
                trainer.load_manifest(model, optim, last.step)
            else:
                # In a thread: a user's loop's trainer loads only while it waits in a step (training/_user_trainer.py).
                await trio.to_thread.run_sync(trainer.load_state, model, optim)
            if trainer.step != last.step:
                raise TrainerError(f"checkpoint v{last.version} says step {last.step}, its state says {trainer.step}")
            self.restore_feedback(last.step)
        run.stale_step = None  # our state is a confirmed one now
        run.book = book.resynced(chain)  # the roster we know of stays the roster
        run.attestations.clear()
        run.metrics.update(last.metrics)
        run.save_chain()
        logger.info("%s: %s model v%d %s at step %d", run.log_prefix, "resynced to" if sync else "loaded",
                    last.version, last.model_cid, last.step)
        if sync:
            run.set_synced()
            run.end_if_over()
