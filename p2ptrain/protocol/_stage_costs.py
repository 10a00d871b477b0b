"""What each stage costs per microbatch, measured, for the plans of a task with ``[pipeline] balance
= "measured"``: pure functions of what every member of a step received alike, so that every member
computes the same costs and holds the coordinator's assignment to them (protocol/_plans.py).

Where the times come from: each driver puts, in its own signed entry of the step summary
(wire/_summary_entries.py, a gather every member of the step compares before reading it), the
microseconds a microbatch took at each stage as it measured them (its recent hops there, each over
the hops it had queued there, and its own computations of stage 0: pipeline.HopDeadlines.stage_micros).
No driver's word is taken alone: per stage, the *median* over the drivers that measured it
(:func:`median_micros`), so a minority of lying drivers moves it no further than the honest drivers'
own spread. A stage no driver measured (before its first hop) is estimated from its parameters at
the measured stages' median microseconds per parameter, and every measured cost stays within
:data:`SPREAD` times that estimate either way (:func:`measured_costs`): even a majority of lying
drivers skews a stage's weight by a bounded factor.

A member keeps the times of the summary of each step it applied (:class:`StageTimes`, a few steps
back, each with the plan it applied the step under): a plan from step ``t`` is checked with the
times of the step that ended at ``t``, which every member that applied that step received alike
(the gather's confirmation), and so did the coordinator if it applied it too; from a confirmed
checkpoint, only if this member applied it in the attempt the record names (:meth:`StageTimes.for_plan`). Costs that change
with every measure would move a member every plan, so a move under measured costs is made only
when it raises the pipeline's throughput by :data:`MOVE_MARGIN` (hysteresis: protocol/_assignment.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.protocol._lineage import Chain

# A measured stage's cost stays within this factor of its estimate from parameters (either way).
SPREAD = 8.0
# Under measured costs, a plan moves a member only when that raises the pipeline's throughput by this factor.
MOVE_MARGIN = 1.25
# The steps whose measured times a member keeps (the plans check the times of their start step).
KEPT_STEPS = 4


def median_micros(entries: Sequence[Sequence[int]], stages: int) -> tuple[int, ...]:
    """Per stage, the median (the lower one: one of the values, never an interpolation) of the
    drivers' measured microseconds per microbatch, 0 (not measured) left out; 0 where no driver
    measured it. ``entries``: each timing driver's times, ``stages`` of them (others are ignored)."""
    out = []
    for stage in range(stages):
        values = sorted(e[stage] for e in entries if len(e) == stages and e[stage] > 0)
        out.append(values[(len(values) - 1) // 2] if values else 0)
    return tuple(out)


def measured_costs(parameters: Sequence[int], micros: Sequence[int]) -> tuple[float, ...] | None:
    """Each stage's cost per microbatch (microseconds) from the median times ``micros`` (0: not
    measured) and the stages' ``parameters``, or None when no stage was measured. An unmeasured
    stage costs its parameters at the measured stages' median microseconds per parameter; a measured
    one what was measured, kept within :data:`SPREAD` times that estimate."""
    if len(parameters) != len(micros):
        raise ValueError(f"{len(micros)} stages' times for {len(parameters)} stages")
    rates = sorted(m / max(p, 1) for p, m in zip(parameters, micros, strict=True) if m > 0)
    if not rates:
        return None
    rate = rates[(len(rates) - 1) // 2]
    costs = []
    for p, m in zip(parameters, micros, strict=True):
        estimate = max(p, 1) * rate
        costs.append(min(estimate * SPREAD, max(estimate / SPREAD, float(m or estimate))))
    return tuple(costs)


class StageTimes:
    """The median stage times of the last :data:`KEPT_STEPS` steps this member applied, by the step
    each ended at, each with the (term, attempt) of the plan it was applied under (a step applied
    again after a retry replaces its times)."""

    def __init__(self) -> None:
        # step -> ((term, attempt) of the plan it was applied under, its times, the cut they were measured under)
        self._by_step: dict[int, tuple[tuple[int, int], tuple[int, ...], tuple[int, ...] | None]] = {}

    def note(self, step: int, micros: tuple[int, ...], attempt: tuple[int, int],
             cut: tuple[int, ...] | None = None) -> None:
        """The step that ended at ``step`` was applied here under the plan of ``attempt`` (its term
        and attempt); its summary's median times ``micros``, measured with the stages cut at ``cut``
        (its plan's, None: by parameter count)."""
        self._by_step[step] = (attempt, micros, cut)
        for old in sorted(self._by_step)[:-KEPT_STEPS]:
            del self._by_step[old]

    def cut_at(self, step: int) -> tuple[int, ...] | None:
        """The cut the times of the step that ended at ``step`` were measured under (None: by
        parameter count, or no times)."""
        kept = self._by_step.get(step)
        return kept[2] if kept is not None else None

    def forget_after(self, step: int) -> None:
        """A plan from ``step`` was accepted: the run redoes the steps after it, so the times this
        member kept of those are of an attempt the others dropped (it applied that step alone, a
        stage sum that completed here only). Kept, they would be checked against a later plan that
        the coordinator made from the times of the attempt that went through, and an honest plan
        refused as a rule break. (A member that never took that plan keeps them: a plan from a
        checkpoint weighs only the times of the attempt its record names: :meth:`for_plan`.)"""
        for later in [s for s in self._by_step if s > step]:
            del self._by_step[later]

    def at(self, step: int, attempt: tuple[int, int] | None = None) -> tuple[int, ...] | None:
        """The times of the step that ended at ``step``, or None when this member did not apply it
        (or measured nothing: a run before its first hop, or a task that does not measure), or,
        given ``attempt`` (the term and attempt of the plan the run confirmed that step under),
        applied it under another plan: a dropped attempt's times."""
        kept = self._by_step.get(step)
        if kept is None or (attempt is not None and kept[0] != attempt):
            return None
        micros = kept[1]
        return micros if any(micros) else None

    def for_plan(self, chain: Chain, step: int, version: int) -> tuple[int, ...] | None:
        """The times a plan from ``step`` on ``chain``'s ``version`` (this member's chain) is made and
        checked with, or None (then by parameters, and checked by shape only).

        From a confirmed checkpoint (the chain's head), only times of the attempt its record names:
        a member that applied that step in an attempt the others dropped and never took the retry's
        plan (it did not know that term's coordinator yet) kept that attempt's times, which
        :meth:`forget_after` drops only on taking the retry. Weighed, they made it refuse the honest
        plan that admitted it back at the checkpoint, and plan, if elected, a placement the others
        refuse. From a version this member has not confirmed, none: the attempt that went through
        is in a record it does not hold. Elsewhere (mid-span) the times kept."""
        if version > chain.version:
            return None
        if version == chain.version and chain.records and step == chain.records[-1].record.step:
            record = chain.records[-1].record
            return self.at(step, (record.term, record.attempt))
        return self.at(step)
