"""``stage``, ``stages`` and ``stage_suspects`` of a pipelined task's ``task status`` (docs/training.md,
"Pipelined tasks"): this member's stage, each stage's replicas, parameters and measured time, and the
replicas convicted."""

from __future__ import annotations

from typing import Any

import trio

from p2ptrain.protocol import plan_cut, stage_rings
from p2ptrain.run._run_state import RunState
from p2ptrain.run._stage_trainer import StagedTrainer
from p2ptrain.task import stage_parameters


def stage_status(run: RunState) -> tuple[int | None, tuple[dict[str, Any], ...] | None]:
    """``stage``/``stages`` of a pipelined task's status: this member's stage and each stage's
    replicas in the latest plan, with its parameters and, under ``balance = "measured"``, its
    drivers' median time of the last step this member applied; (None, None) for any other task."""
    book, trainer = run.book, run.trainer
    plan = book.last_plan if book else None
    if not isinstance(trainer, StagedTrainer) or book is None or plan is None or plan.stages is None:
        return None, None
    stage = plan.stages[plan.members.index(run.me)] if run.me in plan.members else None
    times = book.stage_times.at(trainer.step)
    # Under balance = "recut", the stages of the plan's cut (the trainer takes it with the plan's stage).
    recut = run.task.pipeline is not None and run.task.pipeline.recut
    sizes = stage_parameters(run.task, plan_cut(run.task, plan)) if recut else [s.parameter_count() for s in trainer.stages]
    return stage, tuple({"stage": i, "replicas": list(ring), "parameters": sizes[i],
                         **({"microseconds": times[i]} if times else {})} for i, ring in enumerate(stage_rings(plan)))


def stage_suspects(run: RunState) -> tuple[dict[str, Any], ...]:
    """``stage_suspects``: each replica convicted in this run (``{"peer", "stage", "times", "step"}``,
    run/_step_summary.py), ``out_s``, the seconds it is still left out of plans (0: back; the book's
    :class:`~p2ptrain.protocol.Convictions`), so a run of exactly ``peers.min`` members says whom it waits out,
    and ``out_for_s``, how long that latest time out is in all (it doubles at each conviction)."""
    now = trio.current_time()
    convictions = run.book.convictions if run.book is not None else None
    out = convictions.out(now) if convictions is not None else {}
    return tuple({**e, "out_s": round(max(0.0, out.get(e["peer"], now) - now), 1),
                  "out_for_s": convictions.length(e["peer"]) if convictions is not None else 0.0}
                 for e in run.stage_suspects.values())
