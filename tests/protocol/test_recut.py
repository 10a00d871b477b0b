"""Re-cutting a pipelined model by measured time (``[pipeline] balance = "recut"``, protocol/_recut.py):
each stage's measured time spread over its pieces by parameter share, the pieces cut anew by the
exact search, the new cut taken only by a margin and within one member's bound; the cut rides in
the plan (absent: the cut by parameter count, so every plan of today keeps its bytes) and every
member holds the coordinator to it: the previous cut, or exactly the one its own times give, and
that only at a confirmed checkpoint."""

from __future__ import annotations

import hashlib

from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.protocol import measured_cut, piece_costs, plan_cut, RECUT_MARGIN
from p2ptrain.protocol._plans import plan_stages, rule_problem
from p2ptrain.protocol._recut import next_cut, stage_costs
from p2ptrain.task import (cut_problem, load_task, parameter_cut, piece_parameters, stage_parameters, task_bytes,
                           task_from_bytes)
from p2ptrain.wire import decode, encode, RoundPlan
from p2ptrain.wire._schema import to_plain
from tests.protocol._books import CID, lm, task_text

TASK = task_text(lm(6), total_steps=10, min_peers=3, pipeline='stages = 3\n')
RECUT = TASK + 'balance = "recut"\n'
MEMBERS = tuple(f"p{i}" for i in range(6))
HEAD = (5, 1, CID)  # the confirmed head the plans below start from: step 5, version 1
KEY = create_new_key_pair(b"\x05" * 32)


def _plan(cut: tuple[int, ...] | None, stages: tuple[int, ...] = (0, 0, 1, 1, 2, 2), step: int = 5,
          version: int = 1) -> RoundPlan:
    return RoundPlan(task_cid=CID, term=1, round=step, attempt=0, step=step, rounds=5, members=MEMBERS,
                     base_cid=CID, version=version, stages=stages, cut=cut)


def _slow_stage_1(task, factor: float = 4.0) -> tuple[int, ...]:
    """Times proportional to the parameters, stage 1's ``factor`` times slower."""
    p = stage_parameters(task)
    return (p[0], round(p[1] * factor), p[2])


def test_a_stage_time_is_spread_over_its_pieces_by_parameter_share():
    assert piece_costs([1, 3, 2, 2], (0, 2, 4), (400.0, 10.0)) == (100_000, 300_000, 5_000, 5_000)
    assert piece_costs([0, 0, 5], (0, 2, 3), (10.0, 1.0)) == (5_000, 5_000, 1_000)  # no parameters: equal shares


def test_the_cut_moves_only_by_the_margin():
    task = load_task(RECUT)
    cut = parameter_cut(task)
    assert cut == (0, 3, 5, 8) and list(piece_parameters(task))[0] == 1232
    # As the parameters say: nothing to move. Stage 1 three times slower: the best cut is only
    # 1.13 times better (its two blocks cannot be split further), under the margin.
    assert measured_cut(task, cut, stage_parameters(task)) is None
    assert measured_cut(task, cut, _slow_stage_1(task, 3.0)) is None
    moved = measured_cut(task, cut, _slow_stage_1(task, 4.0))
    assert moved == (0, 3, 4, 8)  # stage 1 keeps one of its blocks, stage 2 takes the other
    # The new cut's costliest stage is at least the margin cheaper, by the spread costs.
    costs = stage_costs(task, moved, _slow_stage_1(task, 4.0), cut)
    old = stage_costs(task, cut, _slow_stage_1(task, 4.0), cut)
    assert costs is not None and old is not None and max(costs) * RECUT_MARGIN <= max(old)
    # Measured under the new cut, the same slowness (now all in stage 1's one block) moves nothing back.
    again = tuple(round(c) for c in costs)
    assert measured_cut(task, moved, again) is None
    # A task that only places replicas by time never moves its cut.
    assert measured_cut(load_task(TASK + 'balance = "measured"\n'), cut, _slow_stage_1(task, 4.0)) is None


def test_a_cut_stays_within_the_task():
    task = load_task(RECUT)
    assert cut_problem(task, (0, 3, 5, 8)) is None
    assert "3 stages" in (cut_problem(task, (0, 4, 8)) or "")
    assert "without a piece" in (cut_problem(task, (0, 3, 3, 8)) or "")
    assert "3 stages" in (cut_problem(task, (0, 3, 5, 9)) or "")
    assert stage_parameters(task, (0, 1, 2, 8)) == [1232, 3280, sum(piece_parameters(task)) - 1232 - 3280]


def test_the_option_is_stored_only_when_it_moves_the_cut():
    silent, recut = load_task(TASK), load_task(RECUT)
    assert task_bytes(load_task(TASK + 'balance = "parameters"\n')) == task_bytes(silent)
    assert recut.pipeline is not None and recut.pipeline.recut and recut.pipeline.measured_balance
    assert b'"balance":"recut"' in task_bytes(recut)
    # In local-SGD mode too (the cut moves at a confirmed checkpoint, an outer step's end: a stage file
    # holds the outer state by whole-model index, tests/pipeline/test_recut_loads_local_sgd.py); refused on main.
    local = RECUT.replace("total_steps = 10", 'total_steps = 10\nmode = "local_sgd"\ninner_steps = 2')
    local = local.replace("[pipeline]", "[outer]\nlr = 0.7\n[pipeline]")
    task = load_task(local)
    assert task.training.local_sgd and task.pipeline is not None and task.pipeline.recut
    assert b'"balance":"recut"' in task_bytes(task) and task_from_bytes(task_bytes(task)) == task
    measured = load_task(local.replace('balance = "recut"', 'balance = "measured"'))
    assert task_bytes(measured) == task_bytes(task).replace(b'"balance":"recut"', b'"balance":"measured"')


def test_a_plan_names_its_cut_only_when_it_is_not_by_parameters():
    plan = _plan(None)
    assert "cut" not in to_plain(plan)  # every plan of today: the same bytes (test_plan_stages pins them)
    cut = _plan((0, 3, 4, 8))
    got = decode(encode(cut, KEY, seq=1, ts=1700000000.5), now=1700000000.5).msg
    assert got == cut and got.cut == (0, 3, 4, 8)
    assert hashlib.sha256(encode(plan, KEY, seq=1, ts=1.5)).digest() != hashlib.sha256(
        encode(cut, KEY, seq=1, ts=1.5)).digest()


def test_the_coordinator_moves_the_cut_at_a_checkpoint_only():
    task = load_task(RECUT)
    before = _plan(None, step=0)
    micros = _slow_stage_1(task)
    assert next_cut(task, before, True, micros, None) == (0, 3, 4, 8)
    assert next_cut(task, before, False, micros, None) is None  # between checkpoints: the cut held
    assert next_cut(task, _plan((0, 3, 4, 8)), True, None, None) == (0, 3, 4, 8)  # no times: the previous cut
    # Measured under the new cut as the parameters say (the slowness gone): back to the cut by parameters.
    assert next_cut(task, _plan((0, 3, 4, 8)), True, stage_parameters(task, (0, 3, 4, 8)), (0, 3, 4, 8)) is None
    assert next_cut(load_task(TASK + 'balance = "measured"\n'), before, True, micros, None) is None


def test_members_hold_the_plan_to_the_cut_their_times_give():
    task = load_task(RECUT)
    before = _plan(None, step=0)
    micros = _slow_stage_1(task)
    new = (0, 3, 4, 8)
    stages = plan_stages(task, MEMBERS, before, micros, new, None)
    assert stages is not None
    good = _plan(new, stages)
    assert rule_problem(task, 100, good, before, micros, head=HEAD) is None
    # The previous cut is always accepted (a coordinator without times plans by it)...
    kept = plan_stages(task, MEMBERS, before, micros, None, None)
    assert kept is not None and rule_problem(task, 100, _plan(None, kept), before, micros, head=HEAD) is None
    # ...any other cut is refused, and the moved one only at the confirmed checkpoint of its step.
    other = (0, 2, 4, 8)
    problem = rule_problem(task, 100, _plan(other, plan_stages(task, MEMBERS, before, micros, other, None) or ()),
                           before, micros, head=HEAD)
    assert problem is not None and "the times of step 5 give [0, 3, 4, 8]" in problem
    behind = _plan(new, stages, step=6)  # starts a step past its base
    assert "not the step of its base" in (rule_problem(task, 100, behind, before, micros, head=HEAD) or "")
    # A member whose chain is behind the plan's base cannot tell: it checks the cut against its times.
    ahead = _plan(new, stages, version=2)
    assert rule_problem(task, 100, ahead, before, micros, head=HEAD) is None
    # Without the step's times (resynced to it), any cut of the task's shape at the checkpoint.
    assert rule_problem(task, 100, _plan(other, plan_stages(task, MEMBERS, before, None, other) or ()), before, None,
                        head=HEAD) is None
    # A joiner checks the shape only; nobody accepts a malformed cut or the parameter cut spelled out.
    assert rule_problem(task, 100, good, None, None, head=HEAD) is None
    assert "leaves a stage" in (rule_problem(task, 100, _plan((0, 3, 3, 8)), before, micros, head=HEAD) or "")
    spelled = _plan(parameter_cut(task), kept)
    assert "by no cut" in (rule_problem(task, 100, spelled, before, micros, head=HEAD) or "")
    # A task that does not re-cut: no plan of it names a cut.
    measured = load_task(TASK + 'balance = "measured"\n')
    assert "does not move its cut" in (rule_problem(measured, 100, good, before, micros, head=HEAD) or "")


def test_after_a_recut_the_new_cut_is_the_previous_one():
    task = load_task(RECUT)
    new = (0, 3, 4, 8)
    recut = _plan(new, step=5)
    assert plan_cut(task, recut) == new and plan_cut(task, None) == parameter_cut(task)
    # The next span's plan (not at a checkpoint) keeps it; going back to the parameter cut there is refused.
    later = _plan(new, step=7)
    assert rule_problem(task, 100, later, recut, None, head=HEAD) is None
    back = _plan(None, step=7)
    assert "not the step of its base" in (rule_problem(task, 100, back, recut, None, head=HEAD) or "")
    # The stages' assignment is weighed under the plan's cut: parameters of the new stages.
    assert plan_stages(task, MEMBERS, recut, None, new) == plan_stages(task, MEMBERS, recut, None, new, new)
