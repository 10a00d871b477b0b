"""Which member serves which stage: the coordinator's assignment, pure and deterministic.

A pipeline runs as fast as its slowest stage, and a stage's speed is its replicas' count over the
time one replica takes per microbatch. The assignment keeps every member where it was (moving one
costs it a download of the new stage's weights and optimizer state by CID), places newcomers where
they raise the slowest stage's throughput, fills a stage left with no replica from the most
replicated stage, and then moves at most ``max_moves`` members per plan from the fastest stage to the
slowest while that raises the pipeline's throughput (Petals' rebalancing; one move a plan keeps a
noisy measure from making members flap between stages).

A stage's time per microbatch is measured (the drivers' hop times under ``[pipeline] balance =
"measured"``: protocol/_stage_costs.py) or, before any measure and in any other task, its parameter
count (a stage twice the size takes about twice as long). Peers are compared by their sort order
only, so every member computing the plan from the same inputs gets the same plan.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any


class AssignmentError(ValueError):
    """Members that cannot serve the stages (fewer members than stages)."""


def throughput(assignment: Mapping[Any, int], costs: Sequence[float]) -> float:
    """Microbatches per unit of cost the pipeline passes: its slowest stage's replicas over its cost."""
    counts = _counts(assignment, len(costs))
    return min(counts[s] / costs[s] for s in range(len(costs)))


def _counts(assignment: Mapping[Any, int], stages: int) -> list[int]:
    counts = [0] * stages
    for stage in assignment.values():
        counts[stage] += 1
    return counts


def assign(
    members: Sequence[Hashable], costs: Sequence[float], previous: Mapping[Any, int] | None = None,
    *, max_moves: int = 1, margin: float = 1.0,
) -> dict[Hashable, int]:
    """{member: stage} for ``members`` over ``len(costs)`` stages whose time per microbatch on one
    replica is ``costs[s]`` (measured, or parameters before any measure). A move is made only when
    it raises the pipeline's throughput more than ``margin`` times (measured costs vary from plan to
    plan: a margin keeps members from moving back and forth on noise)."""
    stages = len(costs)
    if len(members) < stages:
        raise AssignmentError(f"{len(members)} members cannot serve {stages} stages")
    if any(not c > 0 for c in costs):
        raise AssignmentError("every stage's cost is positive")
    ordered = sorted(members, key=str)
    out = {m: s for m in ordered if (s := (previous or {}).get(m)) is not None and 0 <= s < stages}
    for member in ordered:
        if member not in out:
            counts = _counts(out, stages)
            out[member] = min(range(stages), key=lambda s: (counts[s] / costs[s], s))
    # A stage with no replica takes one from the stage that can best spare it.
    while 0 in (counts := _counts(out, stages)):
        empty = counts.index(0)
        donor = max((s for s in range(stages) if counts[s] > 1), key=lambda s: ((counts[s] - 1) / costs[s], -s))
        out[_last_of(out, donor)] = empty
    for _ in range(max_moves):
        counts = _counts(out, stages)
        slowest = min(range(stages), key=lambda s: (counts[s] / costs[s], s))
        spare = [s for s in range(stages) if counts[s] > 1 and s != slowest]
        if not spare:
            break
        donor = max(spare, key=lambda s: ((counts[s] - 1) / costs[s], -s))
        moved = dict(out)
        moved[_last_of(out, donor)] = slowest
        if throughput(moved, costs) <= margin * throughput(out, costs):
            break
        out = moved
    return out


def _last_of(assignment: Mapping[Hashable, int], stage: int) -> Hashable:
    """The member of ``stage`` that moves: the last in sort order (the same on every member)."""
    return max((m for m, s in assignment.items() if s == stage), key=str)
