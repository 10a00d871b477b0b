"""One round (compute -> average -> apply), and the trainer's ``average`` over the real collective.

:func:`run_round` is the one way a round runs, in the node and in the tests alike, so what the tests
check (identical bits on every member, a failed round keeping its gradient) is what the node does.

One :class:`PlanAverager` per task per member: it owns the :class:`SparseAllReducer` whose residual
(error feedback) must live across rounds, and hands the trainer, for each plan, an ``average``
bound to that plan's ring.

Compression fields map as: ``density`` → the top-k share (1.0 is the exact dense all-reduce);
``error_feedback = true`` → :class:`SparseAllReducer` (what was not sent is added next round);
``false`` → a one-shot sparse round per step (what was not sent is dropped); ``fp16_values`` → values
travel as float16; ``values = "int8"|"2bit"`` → values travel quantized with a scale per chunk and
all-gathered (the residual keeps the rounding); ``robust = "clip"`` → every contribution's norm is clipped to the round's median
by whoever reduces it (against Byzantine members; dense rounds then use the direct exchange). Either
way the result is the mean (of the clipped contributions), with identical bits on every member,
which is what the trainer's identical step needs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import trio
from libp2p.peer.id import ID

from p2ptrain.collective import Collective, ErrorFeedback, RoundSpec, SparseAllReducer
from p2ptrain.base import large_empty
from p2ptrain.protocol import owner_seed, round_id, round_seed
from p2ptrain.task import CompressionSpec, Task
from p2ptrain.training._trainer import Average, StepResult, Trainer
from p2ptrain.wire import RoundPlan


@dataclass
class RoundTimings:
    """Where a member's round time goes, for `task status` (totals) and the per-round log line
    (``last_*``). Compute counts also for rounds whose all-reduce failed (the gradient was computed
    and is kept for the retry); sync and apply count for completed rounds only."""

    compute_s: float = 0.0
    sync_s: float = 0.0
    apply_s: float = 0.0
    last_compute_s: float = 0.0
    last_sync_s: float = 0.0
    last_apply_s: float = 0.0


async def run_round(
    trainer: Trainer, batches: Iterator[Any], average: Average, round_id: int, timings: RoundTimings
) -> StepResult:
    """One synchronised step: the local gradient, its average over the round's members, the
    identical optimizer step.

    The gradient is computed only when none is pending: a round whose all-reduce failed keeps its
    gradient, and the retry averages the same one (the others still hold the step it is for).
    Compute and apply run in a worker thread, so this host keeps serving its part of the others'
    traffic meanwhile. Errors from ``average`` (``CollectiveError``) propagate; the gradient stays
    pending.
    """
    timings.last_compute_s = timings.last_sync_s = timings.last_apply_s = 0.0
    if trainer.pending is None:
        began = time.perf_counter()
        await trio.to_thread.run_sync(trainer.compute_gradient, batches)
        timings.last_compute_s = time.perf_counter() - began
        timings.compute_s += timings.last_compute_s
    pending = trainer.pending
    assert pending is not None  # compute_gradient sets it
    started = time.perf_counter()
    averaged = await average(pending, round_id)
    synced = time.perf_counter()
    result = await trio.to_thread.run_sync(trainer.apply, averaged)
    applied = time.perf_counter()
    timings.last_sync_s, timings.last_apply_s = synced - started, applied - synced
    timings.sync_s += timings.last_sync_s
    timings.apply_s += timings.last_apply_s
    return result


class PlanAverager:
    """Builds the ``average(flat, round_id)`` of each plan over one host's :class:`Collective`."""

    def __init__(
        self, task: Task, collective: Collective, *, timeout: float = 5.0, start_timeout: float | None = None
    ) -> None:
        self.task = task
        self.collective = collective
        # Members start a round at different moments (compute, plan latency): waiting for the
        # neighbours to join may need longer than one hop (start_timeout).
        self.spec = round_spec(task.compression, timeout=timeout, start_timeout=start_timeout)
        self.reducer = SparseAllReducer(collective, self.spec) if task.compression.error_feedback else None
        self._out: torch.Tensor | None = None

    def feedback_state(self) -> torch.Tensor | None:
        """A copy of this member's error-feedback residual now (what it has not sent yet), to keep
        with a checkpoint; None without error feedback or before the first round."""
        feedback = self.reducer.feedback if self.reducer is not None else None
        return None if feedback is None else feedback.residual.clone()

    def restore_feedback(self, residual: torch.Tensor) -> None:
        """Take ``residual`` (a :meth:`feedback_state` kept at the step the trainer was loaded at) as
        this member's error feedback, so its next rounds send what it would have sent had it not
        stopped. Without error feedback there is nothing to restore."""
        if self.reducer is None:
            return
        if residual.dtype != torch.float32 or residual.dim() != 1:
            raise ValueError(f"an error-feedback residual is flat float32, not {residual.dtype} {tuple(residual.shape)}")
        feedback = ErrorFeedback(residual.numel(), momentum=self.reducer.momentum, clip_norm=self.reducer.clip_norm)
        feedback.residual.copy_(residual)
        self.reducer.feedback = feedback

    def drop_feedback(self) -> None:
        """Forget this member's error-feedback residual, as before its first round (the trainer went
        back to the run's initial state)."""
        if self.reducer is not None:
            self.reducer.feedback = None

    def for_plan(self, plan: RoundPlan) -> Average:
        """The ``average`` for the rounds of ``plan``: its members, in plan order, form the ring.

        What it returns is valid until its next call (the buffer is reused). Each round's top-k
        choices are drawn from :func:`~p2ptrain.protocol.round_seed` (the task's seed and the
        round's number), not from its round id, which names the term and attempt too: a run that
        stopped and resumed under a new term makes the very choices it would have made. A robust
        round's owners are drawn from :func:`~p2ptrain.protocol.owner_seed` (the plan's base
        model and the round's number), which no member chooses.
        """
        ring = [ID.from_base58(p) for p in plan.members]
        seeds: dict[int, tuple[int, int]] = {}  # round id -> its two seeds, for the rounds drawn so far
        undrawn = iter(range(plan.rounds))

        def seeds_of(rid: int) -> tuple[int, int]:
            # Drawn as the rounds come, in order, not all at the plan: a span runs to the next
            # checkpoint, which may be thousands of rounds away, and three hashes a round for every
            # round of every plan (retries too) were a quarter of an in-process run test's CPU.
            while rid not in seeds:
                i = next(undrawn, None)
                if i is None:
                    return rid, rid  # not a round of this plan
                seeds[round_id(plan, i)] = (round_seed(self.task, plan.round + i), owner_seed(plan, plan.round + i))
            return seeds[rid]

        async def average(flat: torch.Tensor, round_id: int) -> torch.Tensor:
            seed, owner_seed = seeds_of(round_id)
            if self.reducer is not None:
                # One output buffer for every round: the trainer's step reads the average (as
                # views) before the next round, and a fresh model-sized tensor per round costs
                # page faults (huge pages: the round's fill and scatter into it are cheaper).
                if self._out is None or self._out.numel() != flat.numel():
                    self._out = large_empty(flat.numel())
                return await self.reducer.allreduce(flat, ring, round_id, out=self._out, seed=seed, owner_seed=owner_seed)
            return await self.collective.allreduce(flat, ring, round_id, self.spec, seed=seed, owner_seed=owner_seed)

        return average


def round_spec(c: CompressionSpec, *, timeout: float = 5.0, start_timeout: float | None = None) -> RoundSpec:
    """The rounds a task's ``[compression]`` asks for (already checked when the task was parsed).

    ``fp16_values`` (or ``values = "fp16"``) sends float16 values, else float32; ``values = "int8"``
    or ``"2bit"`` quantizes them (``c.values``). Without error feedback the one-shot sparse round of
    :meth:`Collective.allreduce` quantizes nothing (the task parser refuses that combination).
    """
    return RoundSpec(density=c.density, value_dtype=torch.float16 if c.fp16_values else torch.float32,
                     robust=c.robust, quantize=c.values if c.error_feedback else None,
                     check_fraction=1.0 if c.check_fraction is None else c.check_fraction, timeout=timeout,
                     start_timeout=start_timeout)
