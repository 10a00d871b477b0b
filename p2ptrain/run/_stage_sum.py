"""A member's sparse stage sum (``[pipeline] stage_sum = "sparse"``): its reducer and residual.

The replicas of a stage sum their gradients at the end of each step; in the sparse sum each sends
the top ``density`` share of its gradient plus what it did not send before (its residual: the
data-parallel rounds' top-k with error feedback, :class:`~p2ptrain.collective.SparseAllReducer`
with op ``"sum"``), and every replica receives the same summed entries, so the replicas stay
bitwise identical whatever their residuals hold.

A residual belongs to one stage at one step: it is what this member's gradients of that stage
have not sent yet, on top of that stage's weights at that step. So a member keeps one reducer for
the stage it holds, at the step its trainer is at, and drops it whenever that changes otherwise
than by its own sum and step: a plan that moves it to another stage, the run going back to a
checkpoint, a resync, a resume (a new process starts with none: the stage's files do not hold
it). What is dropped is at most ``1 / density`` steps' worth of that member's small entries, which
the stage's other replicas still carry in theirs. A step that is undone (the sum done here, the
step failed elsewhere, the trainer rolled back by one step for the retry) takes the residual back
to what it was before that sum, so the retry does not count the step's unsent entries twice.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

import torch

from p2ptrain.collective import Collective, ErrorFeedback, SparseAllReducer
from p2ptrain.pipeline import Stage, sum_stage_gradients
from p2ptrain.task import Task
from p2ptrain.training import round_spec


class SparseStageSum:
    """One member's reducer for the stage it holds (``task.pipeline.stage_sum == "sparse"``)."""

    def __init__(self, task: Task, collective: Collective, *, timeout: float) -> None:
        self.spec = replace(round_spec(task.compression, timeout=timeout), op="sum")
        self.collective = collective
        self._reducer: SparseAllReducer | None = None
        # ((stage, its first and last piece), step) the reducer's residual is on top of: a cut moved by a plan is another stage.
        self._at: tuple[tuple[int, int, int], int] | None = None
        # The residual before the last sum, and the (stage, step) it was on top of: a rolled-back step's.
        self._before: tuple[tuple[tuple[int, int, int], int], torch.Tensor | None] | None = None

    def residual(self) -> torch.Tensor | None:
        """What this member has not sent yet (None before its first sum on the stage it holds)."""
        feedback = None if self._reducer is None else self._reducer.feedback
        return None if feedback is None else feedback.residual

    def _reducer_at(self, stage: tuple[int, int, int], step: int) -> SparseAllReducer:
        """The reducer whose residual is on top of ``stage`` at ``step``: the one kept, the one from
        before the last sum when the trainer rolled that step back, else a new, empty one."""
        if self._at != (stage, step) or self._reducer is None:
            self._reducer = SparseAllReducer(self.collective, self.spec)
            if self._before is not None and self._before[0] == (stage, step) and self._before[1] is not None:
                kept = self._before[1]
                self._reducer.feedback = ErrorFeedback(kept.numel())
                self._reducer.feedback.residual.copy_(kept)
            self._at, self._before = (stage, step), None
        return self._reducer

    async def sum(
        self, stage: Stage, index: int, step: int, ring: Sequence[Hashable], round_id: int, *, seed: int,
        owner_seed: int,
    ) -> None:
        """Replace ``stage``'s gradients (stage ``index`` at trainer step ``step``) by their sparse sum
        over ``ring``; the residual is then on top of ``step + 1``, which the stage's optimizer step
        makes the trainer's. A round that fails leaves the residual as it was (the reducer's rule)."""
        key = (index, stage.first, stage.last)
        reducer = self._reducer_at(key, step)
        residual = self.residual()
        before = None if residual is None else residual.clone()
        await sum_stage_gradients(self.collective, stage, ring, round_id, reducer=reducer, seed=seed,
                                  owner_seed=owner_seed)
        self._before, self._at = ((key, step), before), (key, step + 1)
