"""The rounds of a pipelined plan (docs/pipeline.md): each member serves the stage its plan names.

A round is one step:

1. The members of stage 0 (the *drivers*) take their batch of the step (``sync_interval`` batches
   of their shard: :func:`~p2ptrain.protocol.shard_of` ranks them among the drivers) and drive it,
   ``microbatch_size`` samples at a time, through one replica of every later stage
   (:class:`~p2ptrain.pipeline.Driver`); every other member answers them
   (:class:`~p2ptrain.pipeline.StageReplica`). Each microbatch is weighted by its share of the
   step's samples over all drivers, so the gradients every stage accumulates sum to the gradient of
   the mean loss over the global batch, as one process with that batch would compute it.
2. A *step summary* (run/_step_summary.py): a gather over all the plan's members in which each
   driver signs its own entry (its share of the step's loss, whether its step failed), which is
   also the barrier that tells the replicas the drivers are done. A driver whose step failed (a
   stage without a replica left, a replica that answered no ``HOLDINGS``: its microbatches would be
   missing from that stage's sum) says so there, and every member drops the step alike; no member
   can change another's entry. A driver whose step fails alone (another's goes through) in three
   of the last ten summaries is the step's culprit (:class:`~p2ptrain.protocol.LoneFailures`).
3. Each stage's replicas sum their stage's gradient over the stage's members in the plan
   (:func:`~p2ptrain.pipeline.sum_stage_gradients`, round ids namespaced by stage; under the task's
   ``robust = "clip"``, each replica's contribution clipped to the median norm; under
   ``[pipeline] stage_sum = "sparse"``, top-k with error feedback at the task's ``[compression]``
   density, each member's residual its own: run/_stage_sum.py) and step their optimizer: the
   replicas of a stage stay bitwise identical.

In local-SGD mode a round is one outer step (:meth:`StageRounds._outer_step`): H passes of 1 and 2,
each followed by every member's own inner step of its stage on the microbatches it held (no sum),
then 3 on the pseudo-gradients and the outer step (run/_stage_local_sgd.py). No second opinions in
that mode (the task has ``check_fraction = 0``: replicas differ between outer steps).

Integrity: each driver checks a share of its microbatches with a second replica of every later
stage, and a third when two disagree (:class:`~p2ptrain.pipeline.Driver`); the replicas it outvoted,
and those that stalled its steps again and again (:class:`~p2ptrain.pipeline.Stragglers`), are its
accusations, said in its entry of the step summary. A replica accused by more than half the
drivers (:func:`~p2ptrain.protocol.convicted`) fails the step on every member as
:class:`~p2ptrain.collective.Misbehaved` naming it: the same path as a member a robust round proves
wrong (every book leaves it out of plans for the quarantine; the retry runs without it), and
``task status`` names it (``stage_suspects``).

Any failure (a member gone, a :class:`~p2ptrain.pipeline.PipelineError`) is the run's round failure,
as in a data-parallel round: the coordinator's retry plan goes on without the member that left. A
member of the plan that says it takes no part (it cannot follow the plan) is not waited for at the
summary: every member leaves the step at once naming it, until its summary opens (run/_step_window.py). A
replica that dies mid-step is routed around within the step (nothing is lost), but the step still
fails at the summary (the drivers do not yet agree on smaller rings with the replicas: docs/pipeline.md,
"Next", item 2), and the retry repeats it without that replica.

At a span's checkpoint every member stores its stage's files and the run's record names a manifest
of every stage's (:meth:`StageRounds.checkpoint`, run/_stage_checkpoints.py); a member that does not
hold the stage its plan names loads it from the latest confirmed one (:meth:`StageRounds.take`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import trio
from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.collective import Misbehaved
from p2ptrain.net import Channel, serve_channels
from p2ptrain.pipeline import (ChannelPool, Driver, evaluate_stages, HopDeadlines, MAX_STREAMS_PER_PEER, PipelineError,
                               PROTOCOL, RequestShapes, serve_requests, StageReplica, Stragglers, sum_stage_gradients,
                               Wiring)
from p2ptrain.protocol import (check_key_message, inner_round_id, LoneFailures, owner_seed, round_id, round_seed,
                               shard_of, stage_rings, stage_round_id)
from p2ptrain.run._run_state import RunState
from p2ptrain.run._stage_checkpoints import load_confirmed_stage, store_stage_checkpoint, take_plan_cut
from p2ptrain.run._stage_local_sgd import LocalSGDStagedTrainer
from p2ptrain.run._stage_sum import SparseStageSum
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.run._step_summary import convicted_failure, gather_summary
from p2ptrain.run._step_window import StepWindow
from p2ptrain.training import loss_and_hits, StepResult
from p2ptrain.wire import RoundPlan

logger = logging.getLogger(__name__)

# How long the step summary waits for every member to join: the replicas join at once and wait for
# the drivers' whole step (every microbatch forward and back through every stage).
STEP_TIMEOUT_S = 120.0
# A driver's hop deadlines (pipeline HopDeadlines, from the hops measured; the least is the run's
# hop_timeout): before a stage's hops are measured (the first step's allocations, a loaded machine),
# and the most a hop gets, however slow its replica was measured: half the summary's wait, so a
# hung replica is given up on, and its microbatch rerouted, while the other members still wait.
HOP_INITIAL_S = 20.0
HOP_CEILING_S = STEP_TIMEOUT_S / 2
# Microbatches one driver has in flight at once: within what a replica takes from one peer at once
# (pipeline MAX_STREAMS_PER_PEER), enough to keep every stage busy.
IN_FLIGHT = 4
# The frames carry a step in 32 bits: in local-SGD mode each pass's is the inner step's number, modulo this.
WIRE_STEPS = 1 << 32
# The longest a checkpoint's evaluation through the stages takes (pipeline/_evaluation.py). The
# coordinator evaluates before it joins the next span's first step summary, whose replicas send their
# entries at once: those channels wait at the coordinator at most the collective's 30 s parking
# window (collective/_inbox.py), so the evaluation ends well within it.
EVAL_DEADLINE_S = 20.0


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return loss_and_hits(logits, targets)[0]


def plan_evaluators(plan: RoundPlan, me: str, coordinator: str | None, term: int) -> list[str]:
    """Whose EVALs this member's stage answers under ``plan``: the coordinator that signed it (our
    election's of ``plan.term``, the only one that records, and so evaluates, its span), unless that
    is this member; while it is not known, every other member of the plan."""
    if coordinator is not None and term == plan.term and coordinator in plan.members:
        return [] if coordinator == me else [coordinator]
    return [m for m in plan.members if m != me]


class StageRounds:
    """One member's part in the rounds of a pipelined task, plan after plan."""

    def __init__(self, run: RunState, *, hop_timeout: float, start_timeout: float) -> None:
        self.run = run
        self.hop_timeout, self.start_timeout = hop_timeout, start_timeout
        # One stage protocol per task, so that one node can serve stages of two tasks.
        self.protocol = f"{PROTOCOL}/{run.task_cid}"
        self._plan: RoundPlan | None = None
        self._driver: Driver | None = None
        self._replica: StageReplica | None = None
        # What answers the evaluations of this member's stage (EVAL, pipeline/_evaluation.py): its
        # replica; a driver's, one that answers nothing else (it has no senders).
        self._evaluee: StageReplica | None = None
        self._serving = False
        # As a driver: the channels to the replicas, reused hop after hop, plan after plan.
        self._pool = ChannelPool(run.collective.host, self.protocol, clock=time.monotonic)
        # As a driver: its hops' measured times, and so their deadlines, kept plan after plan (not past a new cut).
        self._deadlines = self._new_deadlines()
        # As a driver: which replicas stalled its steps (pipeline/_stragglers.py), judged plan after plan.
        self._stragglers = Stragglers()
        # Every member: which driver's steps fail while the others' do not, summary after summary.
        self._lone_failures = LoneFailures()
        # Every member: the step it may leave at once for a member that says it takes no part.
        self.window = StepWindow(run)
        # As a driver: the replicas (base58) a third opinion outvoted here, and their stage, kept
        # across plans: this driver's accusations in every step's summary while a plan names them.
        self._accused: dict[str, int] = {}
        # As a driver: the replicas that stalled its steps (pipeline/_stragglers.py), accused in the
        # summaries of the plan it was judged in: not distrusted (slowness is no evidence of who
        # caused it, and routing around it could leave this driver no replica of a stage).
        self._stalled: dict[str, int] = {}
        # Under balance = "measured": the median stage times of the last summary (kept in the book by step, once applied).
        self._micros: tuple[int, ...] = ()
        # Under stage_sum = "sparse": this member's reducer and residual for the stage it holds
        # (run/_stage_sum.py: dropped when its stage or step changes otherwise than by its own steps).
        assert run.task.pipeline is not None
        self._shapes: list[RequestShapes] | None = None  # each stage's requests' (at the first take; [] untraceable)
        self._sparse = SparseStageSum(run.task, run.collective, timeout=hop_timeout) \
            if run.task.pipeline.sparse_sum else None

    def stage_of(self, plan: RoundPlan) -> int:
        assert plan.stages is not None
        return plan.stages[plan.members.index(self.run.me)]

    async def take(self, plan: RoundPlan) -> None:
        """Serve this member's stage of ``plan`` from now on, loaded first from the latest confirmed
        manifest when this member does not hold it (a joiner, one that resumed or resynced, one the
        plan moves); a :class:`TrainerError` when it cannot be (the span then resyncs)."""
        run = self.run
        trainer = self._trainer()
        task = run.task
        assert task.pipeline is not None
        index = self.stage_of(plan)
        if take_plan_cut(run, plan):  # a moved cut: each stage's request shapes and hop times are another stage's
            self._shapes, self._deadlines = None, self._new_deadlines()
        if not trainer.holds(index):
            await load_confirmed_stage(run, index)
        if self._shapes is None and run.manifest is not None:  # what its requests may hold: its frame limits
            self._shapes = await trio.to_thread.run_sync(trainer.request_shapes, run.manifest)
        shapes = self._shapes[index] if self._shapes else None
        stage = await trio.to_thread.run_sync(trainer.take_stage, index)  # at step 0: made from the seed
        self._plan, self._driver, self._replica = plan, None, None
        self._stalled.clear()
        encoding = task.pipeline.activations
        host = run.collective.host
        rings = stage_rings(plan)
        # The plan's coordinator evaluates its span's checkpoint through every stage (EVAL only), and
        # nobody else: any member admitted for EVAL could load a replica at every step, unattributed
        # (docs/security.md, "Pipelined tasks"). Its coordinator unknown here: any member, as before.
        evaluators = [ID.from_base58(m) for m in plan_evaluators(plan, run.me, run.election.coordinator,
                                                                   run.election.term)]
        if index == 0:
            replicas = {s: [ID.from_base58(m) for m in ring] for s, ring in enumerate(rings) if s > 0}
            rank, _ = shard_of(plan, run.me)
            distrusted = [ID.from_base58(peer) for peer in self._accused]  # caught here: sent none of its hops
            self._driver = Driver(host, stage, _loss, Wiring(replicas, random.Random(task.seed + rank), distrusted),
                                  cut=trainer.stages, encoding=encoding, hop_timeout=self.hop_timeout,
                                  protocol=self.protocol, pool=self._pool, deadlines=self._deadlines,
                                  stragglers=self._stragglers,
                                  check_fraction=task.pipeline.check_fraction,
                                  check_key=host.get_private_key().sign(check_key_message(plan)))
        else:
            self._replica = StageReplica(host, stage, _loss, senders=[ID.from_base58(m) for m in rings[0]],
                                         encoding=encoding, protocol=self.protocol, evaluators=evaluators, shapes=shapes)
        self._evaluee = self._replica or StageReplica(host, stage, _loss, senders=(), protocol=self.protocol,
                                                      evaluators=evaluators, shapes=shapes)
        self._evaluee.weights_step = trainer.step
        if not self._serving:
            serve_channels(host, self.protocol, self._answer, max_streams_per_peer=MAX_STREAMS_PER_PEER)
            self._serving = True

    def _new_deadlines(self) -> HopDeadlines:
        return HopDeadlines(self.hop_timeout, ceiling=max(self.hop_timeout, HOP_CEILING_S),
                            initial=max(self.hop_timeout, HOP_INITIAL_S))

    async def stop(self) -> None:
        """The run is over: this host answers no more of its stage requests (each is reset) and
        closes the channels it kept as a driver. The handler stays installed: py-libp2p's multiselect
        looks a protocol up twice around an await, and a handler removed in between raised KeyError
        in the swarm, which took the node down."""
        self._replica = self._evaluee = self._driver = None
        await self._pool.aclose()

    async def _answer(self, channel: Channel) -> None:
        # Each request by the replica of the plan current when it arrives; none (a driver, or
        # between plans): the channel is reset.
        await serve_requests(channel, lambda: self._replica or self._evaluee)

    def _trainer(self) -> StagedTrainer:
        trainer, _ = self.run.require()
        assert isinstance(trainer, StagedTrainer)
        return trainer

    async def step(self, plan: RoundPlan, index: int, batches: Iterator[Any]) -> StepResult:
        """Round ``index`` of ``plan``: the step forward and back, its summary, the stage's sum and
        optimizer step (in local-SGD mode an outer step: :meth:`_outer_step`). Raises
        ``CollectiveError`` (a member gone) or :class:`PipelineError`."""
        trainer = self._trainer()
        timings = self.run.timings
        timings.last_compute_s = timings.last_sync_s = timings.last_apply_s = 0.0
        if isinstance(trainer, LocalSGDStagedTrainer):
            return await self._outer_step(plan, index, batches, trainer)
        stage = self.stage_of(plan)
        loss = await self._pass(plan, index, batches, trainer.step)
        synced = time.perf_counter()
        await self._sum(plan, index, stage)
        applied = time.perf_counter()
        result = await trio.to_thread.run_sync(trainer.apply_stage, stage, loss)
        self._applied(plan)
        self._timed(applied - synced, time.perf_counter() - applied)
        return result

    def _applied(self, plan: RoundPlan) -> None:
        """The round's step applied under ``plan``: EVALs may name it, plans from it weigh the stages by
        its summary's times (of ``plan``'s attempt: a checkpoint's record names the one that counts), and
        the replica answers no request of that step any more: a driver redoing it (a retry planned while
        this member is at its span's checkpoint, not rolled back yet) was given the next step's weights."""
        trainer, book = self.run.require()
        if self._evaluee is not None:
            self._evaluee.weights_step = trainer.step
            self._evaluee.new_step(-1)  # (requests wait for the next step's new_step: pipeline/_replica.py)
        if self._micros:
            book.stage_times.note(trainer.step, self._micros, (plan.term, plan.attempt), plan.cut)

    async def _outer_step(self, plan: RoundPlan, index: int, batches: Iterator[Any],
                          trainer: LocalSGDStagedTrainer) -> StepResult:
        """Round ``index`` of ``plan`` in local-SGD mode (docs/pipeline.md, "Local-SGD mode"): H
        passes of the drivers' batch through the stages, each with its own summary and then this
        member's own inner step of its stage (no sum); then the stage's replicas sum their
        pseudo-gradients and take the outer step, which leaves them bitwise identical. A round that
        fails on the way puts the stage back to its weights at the round's start."""
        training = self.run.task.training
        assert self.run.task.pipeline is not None
        stage, step, inner_steps = self.stage_of(plan), trainer.step, trainer.inner_steps
        micro = self.run.task.pipeline.microbatch_size or training.batch_size
        per_driver = training.sync_interval * (training.batch_size // micro)  # each driver's, every pass
        total = len(stage_rings(plan)[0]) * per_driver
        loss, stepping = 0.0, 0.0
        await trio.to_thread.run_sync(trainer.begin_round, stage)
        try:
            for inner in range(inner_steps):
                # The frames' step (u32): every pass its own, so a late hop of one is never taken for the next.
                loss += await self._pass(plan, index, batches, (step * inner_steps + inner) % WIRE_STEPS, inner)
                held = per_driver if self._replica is None else len(self._replica.held())
                if self._evaluee is not None:
                    # Its weights are its own until the outer step: no EVAL names them. (Not before the
                    # first pass: the coordinator evaluates the last checkpoint before it joins that
                    # pass's summary, which every member's first inner step waits for.)
                    self._evaluee.weights_step = -1
                began = time.perf_counter()
                await trio.to_thread.run_sync(trainer.inner_step_stage, stage, inner, held, total)
                stepping += time.perf_counter() - began
            await trio.to_thread.run_sync(trainer.pseudo_gradient, stage)
            synced = time.perf_counter()
            await self._sum(plan, index, stage)
        except BaseException:
            trainer.end_round(stage)  # a retry repeats the round from the weights it started with
            if self._evaluee is not None:
                self._evaluee.weights_step = trainer.step
            raise
        applied = time.perf_counter()
        result = await trio.to_thread.run_sync(trainer.apply_outer, stage, len(stage_rings(plan)[stage]),
                                               loss / inner_steps)
        self._applied(plan)
        self._timed(applied - synced, stepping + time.perf_counter() - applied)
        return result

    async def _pass(self, plan: RoundPlan, index: int, batches: Iterator[Any], wire_step: int,
                    inner: int | None = None) -> float:
        """The drivers' batch forward and back through the stages (their frames of step
        ``wire_step``), then its summary (in local-SGD mode, inner step ``inner``'s): the pass's mean
        loss. Raises as :meth:`step`: the summary fails it on every member alike."""
        run = self.run
        timings = run.timings
        summary_id = round_id(plan, index) if inner is None else inner_round_id(plan, index, inner)
        step = self._trainer().step
        began = time.perf_counter()
        loss, failed = 0.0, False
        async with self.window.open(plan, index, summary_id):  # left for a member taking no part
            if self._driver is not None:
                # The replicas join the summary now and the drivers after their whole step: their
                # channels wait here for it, however long a (first, slow) step takes within the summary's wait.
                run.collective.announce(summary_id, STEP_TIMEOUT_S)
                self._driver.new_step(wire_step)
                try:
                    loss = await self._drive(plan, batches)
                except PipelineError as exc:
                    logger.warning("%s: step %d failed at this driver: %s", run.log_prefix, step, exc)
                    failed = True
                # Its accusations: the replicas it caught lying, and those that stall its steps.
                self._accused.update((str(peer), s) for peer, s in self._driver.liars.items())
                self._stalled.update((str(peer), s) for peer, s in self._driver.stragglers.items())
                self._driver.liars.clear()
                self._driver.stragglers.clear()
                for (s, a, b), n in self._driver.undecided.items():
                    low, high = sorted((str(a), str(b)))
                    run.stage_disagreements[(s, low, high)] += n
                self._driver.undecided.clear()
            else:
                assert self._replica is not None
                self._replica.new_step(wire_step)
            computed = time.perf_counter() - began
            timings.last_compute_s += computed
            timings.compute_s += computed
            timed = bool(run.task.pipeline and run.task.pipeline.measured_balance)  # local-SGD: the last pass's times count
            micros = self._deadlines.stage_micros(len(stage_rings(plan))) if timed and self._driver is not None else ()
            summary = await gather_summary(run.collective, plan, index, run.me, loss, failed, timeout=self.hop_timeout,
                                           start_timeout=STEP_TIMEOUT_S, accused=(*self._accused, *self._stalled), inner=inner,
                                           timed=timed, micros=micros, joined=self.window.joined)
        self._micros = summary.micros
        if summary.convicted:
            for peer in summary.convicted:  # judged: back after its quarantine, only a new lie accuses it
                self._accused.pop(peer, None)
                self._stalled.pop(peer, None)
            raise convicted_failure(plan, step, summary.convicted, run.stage_suspects, run.log_prefix,
                                    convictions=run.require()[1].convictions, now=trio.current_time(), me=run.me)
        culprit = self._lone_failures.observe(stage_rings(plan)[0], summary.failed)
        if culprit is not None:
            logger.warning("%s: step %d failed at driver %s alone, %d times in %d summaries; left out of the next plans",
                           run.log_prefix, step, short_id(culprit), self._lone_failures.limit, self._lone_failures.window)
            raise Misbehaved(ID.from_base58(culprit), f"its steps failed alone as a driver, {self._lone_failures.limit} "
                                                      f"in {self._lone_failures.window}, the last step {step}")
        if summary.failed:
            raise PipelineError(f"step {step} failed at drivers {', '.join(short_id(d) for d in summary.failed)}")
        return summary.loss

    async def _sum(self, plan: RoundPlan, index: int, stage: int) -> None:
        """The stage's replicas sum their gradients (in local-SGD mode, pseudo-gradients) over its
        ring: dense, or sparse with this member's error feedback (run/_stage_sum.py)."""
        run = self.run
        trainer = self._trainer()
        ring = [ID.from_base58(m) for m in stage_rings(plan)[stage]]
        owners = owner_seed(plan, plan.round + index)
        if self._sparse is not None:
            await self._sparse.sum(trainer.stages[stage], stage, trainer.step, ring, stage_round_id(plan, index, stage),
                                   seed=round_seed(run.task, plan.round + index), owner_seed=owners)
        else:
            await sum_stage_gradients(run.collective, trainer.stages[stage], ring, stage_round_id(plan, index, stage),
                                      timeout=self.hop_timeout, robust=run.task.compression.robust, owner_seed=owners)

    def _timed(self, sync_s: float, apply_s: float) -> None:
        timings = self.run.timings
        timings.last_sync_s, timings.last_apply_s = sync_s, apply_s
        timings.sync_s += sync_s
        timings.apply_s += apply_s

    async def _drive(self, plan: RoundPlan, batches: Iterator[Any]) -> float:
        """This driver's share of the step: its microbatches forward and back, every one held once by
        every stage (:meth:`Driver.finish`); its share of the step's mean loss."""
        driver = self._driver
        assert driver is not None and self.run.task.pipeline is not None
        training = self.run.task.training
        micro = self.run.task.pipeline.microbatch_size or training.batch_size
        rank, drivers = shard_of(plan, self.run.me)
        total = drivers * training.sync_interval * training.batch_size  # the step's samples, all drivers
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(training.sync_interval):
            try:
                x, y = next(batches)
            except StopIteration:
                raise PipelineError("the data ran out") from None
            pieces += [(x[i : i + micro], y[i : i + micro].long()) for i in range(0, x.shape[0], micro)]
        losses: list[float] = []
        failures: list[PipelineError] = []
        limiter = trio.CapacityLimiter(IN_FLIGHT)

        async def one(i: int, x: torch.Tensor, y: torch.Tensor) -> None:
            async with limiter:
                weight = x.shape[0] / total
                try:
                    losses.append(weight * await driver.microbatch((rank << 24) | i, x, y, weight))
                except PipelineError as exc:
                    # The step fails here (a stage without a replica left): the nursery would raise
                    # it inside an ExceptionGroup, which the step's caller does not take as a
                    # PipelineError (the run then failed as an internal error).
                    failures.append(exc)
                    nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for i, (x, y) in enumerate(pieces):
                nursery.start_soon(one, i, x, y)
        if failures:
            raise failures[0]
        answered = await driver.finish()
        for s, ring in enumerate(stage_rings(plan)):
            live = [str(peer) for peer in answered.get(s, ())] if s else list(ring)  # an ID's str is its base58
            if live != list(ring):
                gone = sorted(set(ring) - set(live))
                raise PipelineError(f"stage {s}: replicas {', '.join(short_id(g) for g in gone)} gave no holdings")
        return sum(losses)

    async def evaluate(self, plan: RoundPlan, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """The test metrics of the weights at this checkpoint (``plan``'s span just ended), through a
        replica of every stage and this member's own (pipeline/_evaluation.py); EvaluationFailed
        when no metrics can be had within :data:`EVAL_DEADLINE_S`."""
        trainer = self._trainer()
        own = self.stage_of(plan)
        # Not a replica this member caught lying as a driver (Wiring's distrust): its answers would be the
        # metrics; a stage left with none of another gets no metrics (EvaluationFailed), as its step would fail.
        replicas = {s: [ID.from_base58(m) for m in ring if m != self.run.me and m not in self._accused]
                    for s, ring in enumerate(stage_rings(plan))}
        got = await evaluate_stages(self.run.collective.host, replicas, trainer.stages, _loss, batches, step=trainer.step,
                                    local=own, protocol=self.protocol, pool=self._pool, deadline_s=EVAL_DEADLINE_S)
        return {"accuracy": got.accuracy, "loss": got.loss}

    async def checkpoint(self, plan: RoundPlan) -> str | None:
        """At the end of ``plan``'s span: this member's stage files stored and the manifest of every
        stage's (run/_stage_checkpoints.py); its CID, or None when the gather failed or a stage had
        no quorum of its replicas' signatures."""
        return await store_stage_checkpoint(self.run, plan, self.stage_of(plan), self.window, timeout=self.hop_timeout,
                                            start_timeout=self.start_timeout)
