"""Where a plan cuts a pipelined model, under ``[pipeline] balance = "recut"`` (docs/pipeline.md,
"Re-cutting by measured time"): pure functions of the task and of what every member of a step
received alike, so that every member computes the same cut and holds the coordinator to it.

A cut wrong for the hardware (a stage with twice the others' arithmetic) costs a replica per plan
for as long as the run lasts; replica placement (protocol/_stage_costs.py) only corrects around
it. So at a checkpoint a plan may move the cut itself: each stage's measured cost (the median over
the drivers of their signed times, clamped by ``SPREAD``: :func:`measured_costs`) is spread over its
pieces by parameter share (:func:`piece_costs`), and the pieces are cut anew by the exact search the
parameter cut uses (``task.cost_cut``). The new cut is taken only when its costliest stage costs
:data:`RECUT_MARGIN` times less than the current cut's (a cut moves every replica of at least two
stages: noise must not), and only when each of its stages stays within what one member holds
(``task.cut_problem``).

The cut rides in the plan (``RoundPlan.cut``, absent for the cut by parameter count), and a member
accepts a plan's cut only when it is the cut of the plan before it, or the cut its own times of the
plan's start step were measured under, or, in a plan whose base is the confirmed checkpoint of its
start step (where every member loads its new stage by CID from the old stages' files), exactly the
cut :func:`measured_cut` computes from those times (:func:`cut_problem`)."""

from __future__ import annotations

from collections.abc import Sequence

from p2ptrain.protocol._stage_costs import measured_costs
from p2ptrain.task import cost_cut, cut_problem as shape_problem, parameter_cut, piece_parameters, stage_parameters, Task
from p2ptrain.wire import RoundPlan

# A new cut is taken only when its costliest stage costs this many times less than the current cut's.
RECUT_MARGIN = 1.25


def plan_cut(task: Task, plan: RoundPlan | None) -> tuple[int, ...]:
    """The bounds of ``plan``'s cut (its ``cut``, or the task's cut by parameter count)."""
    return plan.cut if plan is not None and plan.cut is not None else parameter_cut(task)


def piece_costs(pieces: Sequence[int], cut: Sequence[int], costs: Sequence[float]) -> tuple[int, ...]:
    """Each piece's cost in nanoseconds: its stage's cost ``costs[s]`` (microseconds, stages cut at
    ``cut``) times the piece's share of the stage's ``pieces`` parameters (a stage with none: an
    equal share each). Integers, so that the cut's search compares exact sums on every member."""
    out: list[int] = []
    for stage, (a, b) in enumerate(zip(cut, cut[1:], strict=False)):
        total = sum(pieces[a:b])
        out += [round(costs[stage] * 1000 * (pieces[i] / total if total else 1 / (b - a))) for i in range(a, b)]
    return tuple(out)


def measured_cut(task: Task, cut: Sequence[int], micros: Sequence[int]) -> tuple[int, ...] | None:
    """The cut the median stage times ``micros`` (measured with the stages cut at ``cut``) give, or
    None when it keeps ``cut``: the same cut, a costliest stage not :data:`RECUT_MARGIN` times
    cheaper, a stage over what one member holds, or nothing measured."""
    if task.pipeline is None or not task.pipeline.recut:
        return None
    costs = measured_costs(stage_parameters(task, cut), micros)
    if costs is None:
        return None
    per_piece = piece_costs(piece_parameters(task), cut, costs)
    new = cost_cut(task, per_piece)
    if new == tuple(cut):
        return None

    def costliest(bounds: Sequence[int]) -> int:
        return max(sum(per_piece[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))

    if costliest(new) * RECUT_MARGIN > costliest(cut) or shape_problem(task, new) is not None:
        return None
    return new


def next_cut(task: Task, before: RoundPlan | None, checkpoint: bool, micros: Sequence[int] | None,
             times_cut: Sequence[int] | None) -> tuple[int, ...] | None:
    """The ``cut`` field of a coordinator's next plan (None: the cut by parameter count): at a
    confirmed checkpoint, with the times ``micros`` of its start step (measured under ``times_cut``),
    :func:`measured_cut`'s when it moves the cut; otherwise the cut of ``before``, the latest plan taken."""
    if task.pipeline is None or not task.pipeline.recut:
        return None
    current = plan_cut(task, before)
    moved = measured_cut(task, times_cut or parameter_cut(task), micros) if checkpoint and micros else None
    chosen = moved or current
    return None if chosen == parameter_cut(task) else chosen


def cut_problem(task: Task, plan: RoundPlan, before: RoundPlan | None, micros: Sequence[int] | None,
                checkpoint: bool | None, times_cut: Sequence[int] | None) -> str | None:
    """Why ``plan``'s cut breaks the run's rules, or None. A task that does not move its cut names
    none; one that does names a cut of its pieces in ``stages`` stages, each within one member's
    bound, and never the cut by parameter count (that is no field: one plan, one encoding). After
    ``before`` (the latest plan taken), the cut is ``before``'s, the cut the times of the plan's
    start step were measured under (``times_cut``), or, where ``plan`` starts at the confirmed
    checkpoint of its step (``checkpoint``; None: its base is ahead of this member's chain, which
    it cannot tell), exactly :func:`measured_cut` of this member's times ``micros`` of that step;
    without those times (it resynced there) any cut of the right shape there: the members that have
    them check it. A joiner (no ``before``) checks the shape only."""
    if task.pipeline is None or not task.pipeline.recut:
        return None if plan.cut is None else 'it names a cut, the task does not move its cut (balance = "recut")'
    if plan.cut is not None:
        if plan.cut == parameter_cut(task):
            return "it names the cut by parameter count, which a plan names by no cut"
        shape = shape_problem(task, plan.cut)
        if shape is not None:
            return shape
    cut = plan_cut(task, plan)
    under = (tuple(times_cut) if times_cut else parameter_cut(task)) if micros else None
    if before is None or cut in (plan_cut(task, before), under):
        return None
    if checkpoint is False:
        return (f"it moves the cut to {list(cut)} at step {plan.step}, which is not the step of its base, the "
                "confirmed checkpoint")
    if not micros:
        return None
    expected = measured_cut(task, times_cut or parameter_cut(task), micros)
    if cut != expected:
        return f"it cuts the model at {list(cut)}; the times of step {plan.step} give {list(expected or plan_cut(task, before))}"
    return None


def stage_costs(task: Task, cut: Sequence[int] | None, micros: Sequence[int] | None,
                times_cut: Sequence[int] | None) -> tuple[float, ...] | None:
    """Each stage's measured cost (microseconds) under the cut ``cut`` (None: by parameter count)
    from the median times ``micros`` measured under ``times_cut``; None when the task does not
    measure or nothing was measured. Under the same cut, :func:`measured_costs`; under a new one,
    each new stage's pieces' costs (:func:`piece_costs`) summed."""
    if not micros or task.pipeline is None or not task.pipeline.measured_balance:
        return None
    if not task.pipeline.recut or (cut or parameter_cut(task)) == (times_cut or parameter_cut(task)):
        return measured_costs(stage_parameters(task, cut), micros)
    under = times_cut or parameter_cut(task)
    costs = measured_costs(stage_parameters(task, under), micros)
    if costs is None:
        return None
    per_piece = piece_costs(piece_parameters(task), under, costs)
    bounds = cut or parameter_cut(task)
    return tuple(sum(per_piece[a:b]) / 1000 for a, b in zip(bounds, bounds[1:], strict=False))
