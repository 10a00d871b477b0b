"""Members to stages: replicas where the pipeline is slowest, kept where they were, one move a plan."""

from __future__ import annotations

import pytest

from p2ptrain.protocol import assign, AssignmentError, throughput


def _replicas(assignment, stages):
    return [sorted(m for m, s in assignment.items() if s == stage) for stage in range(stages)]


def test_equal_stages_get_equal_replicas():
    members = [f"p{i}" for i in range(8)]
    out = assign(members, [1.0] * 4)
    assert [len(r) for r in _replicas(out, 4)] == [2, 2, 2, 2]
    assert assign(list(reversed(members)), [1.0] * 4) == out  # the order members are listed in does not matter


def test_a_costlier_stage_gets_more_replicas():
    out = assign([f"p{i}" for i in range(8)], [1.0, 1.0, 3.0, 1.0])
    counts = [len(r) for r in _replicas(out, 4)]
    assert counts[2] == max(counts) and counts[2] >= 3
    assert throughput(out, [1.0, 1.0, 3.0, 1.0]) == 1.0


def test_members_stay_where_they_were_and_newcomers_fill_the_slowest_stage():
    previous = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 0}
    out = assign(["a", "b", "c", "d", "e", "f"], [1.0] * 4, previous)
    assert {m: out[m] for m in previous} == previous
    assert out["f"] == 1  # stages 1..3 have one replica each; the first of them takes it


def test_a_stage_left_empty_takes_a_member_from_the_most_replicated():
    # Stage 2's only replica is gone; stage 0 has three.
    previous = {"a": 0, "b": 0, "c": 0, "d": 1, "f": 3}
    out = assign(list(previous), [1.0] * 4, previous)
    assert [len(r) for r in _replicas(out, 4)] == [2, 1, 1, 1]
    assert out["c"] == 2  # the last of stage 0 in sort order moves; the others stay
    assert {m: out[m] for m in ("a", "b", "d", "f")} == {m: previous[m] for m in ("a", "b", "d", "f")}


def test_rebalancing_moves_one_member_a_plan_toward_the_slowest_stage():
    previous = {f"p{i}": i % 4 for i in range(8)}  # 2, 2, 2, 2
    costs = [1.0, 1.0, 4.0, 1.0]  # stage 2 turned out 4x slower
    first = assign(list(previous), costs, previous)
    assert sum(first[m] != previous[m] for m in previous) == 1
    assert [len(r) for r in _replicas(first, 4)].count(3) == 1 and len(_replicas(first, 4)[2]) == 3
    second = assign(list(first), costs, first)
    assert len(_replicas(second, 4)[2]) == 4
    # Balanced: a further move would slow the donor stage below the slowest: nothing moves.
    settled = assign(list(second), costs, second)
    assert assign(list(settled), costs, settled) == settled


def test_too_few_members_is_refused():
    with pytest.raises(AssignmentError, match="3 members cannot serve 4 stages"):
        assign(["a", "b", "c"], [1.0] * 4)
