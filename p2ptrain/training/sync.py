"""The trainer's ``average`` over the real collective, configured from the task's compression.

One :class:`PlanAverager` per task per member: it owns the :class:`SparseAllReducer` whose residual
(error feedback) must live across rounds, and hands the trainer, for each plan, an ``average``
bound to that plan's ring.

Compression fields map as: ``density`` → the top-k share (1.0 is the exact dense all-reduce);
``error_feedback = true`` → :class:`SparseAllReducer` (what was not sent is added next round);
``false`` → a one-shot sparse round per step (what was not sent is dropped); ``fp16_values`` → values
travel as float16; ``robust = "clip"`` → every contribution's norm is clipped to the round's median
by whoever reduces it (against Byzantine members; dense rounds then use the direct exchange). Either
way the result is the mean (of the clipped contributions), with identical bits on every member,
which is what the trainer's identical step needs.
"""

from __future__ import annotations

import torch
from libp2p.peer.id import ID

from p2ptrain.collective import Collective, SparseAllReducer
from p2ptrain.training.task import Task
from p2ptrain.training.trainer import Average
from p2ptrain.wire.messages import RoundPlan


class PlanAverager:
    """Builds the ``average(flat, round_id)`` of each plan over one host's :class:`Collective`."""

    def __init__(
        self, task: Task, collective: Collective, *, timeout: float = 5.0, start_timeout: float | None = None
    ) -> None:
        self.task = task
        self.collective = collective
        self.timeout = timeout
        # Members start a round at different moments (compute, plan latency): waiting for the
        # neighbours to join may need longer than one hop.
        self.start_timeout = start_timeout
        c = task.compression
        self.value_dtype = torch.float16 if c.fp16_values else torch.float32
        self.reducer = (
            SparseAllReducer(collective, density=c.density, value_dtype=self.value_dtype, robust=c.robust)
            if c.error_feedback
            else None
        )
        self._out: torch.Tensor | None = None

    def for_plan(self, plan: RoundPlan) -> Average:
        """The ``average`` for the rounds of ``plan``: its members, in plan order, form the ring.

        What it returns is valid until its next call (the buffer is reused).
        """
        ring = [ID.from_base58(p) for p in plan.members]

        async def average(flat: torch.Tensor, round_id: int) -> torch.Tensor:
            if self.reducer is not None:
                # One output buffer for every round: the trainer's step reads the average (as
                # views) before the next round, and a fresh model-sized tensor per round costs
                # page faults.
                if self._out is None or self._out.numel() != flat.numel():
                    self._out = torch.empty(flat.numel(), dtype=torch.float32)
                return await self.reducer.allreduce(
                    flat, ring, round_id, out=self._out, timeout=self.timeout, start_timeout=self.start_timeout
                )
            return await self.collective.allreduce(
                flat, ring, round_id, density=self.task.compression.density,
                value_dtype=self.value_dtype, timeout=self.timeout, start_timeout=self.start_timeout,
                robust=self.task.compression.robust,
            )

        return average
