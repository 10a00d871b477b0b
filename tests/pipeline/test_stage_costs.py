"""Replicas placed by measured stage times (``[pipeline] balance = "measured"``): the drivers' times
are weighed by their median, bounded against the stages' parameters, and the plan every member
checks is ``assign`` over the costs it computes itself from the same summary, or over parameters:
any other assignment is a rule break against the coordinator."""

from __future__ import annotations

from dataclasses import replace

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.pipeline import HopDeadlines
from p2ptrain.protocol import (assign, Chain, Election, ElectionConfig, measured_costs, median_micros, RoundBook, signing,
                               StageTimes, View)
from p2ptrain.protocol._plans import plan_stages, rule_problem
from p2ptrain.protocol._stage_costs import KEPT_STEPS, SPREAD
from p2ptrain.task import load_task, stage_parameters
from p2ptrain.wire import RoundPlan

from .conftest import CID, LM_TASK

MEASURED = LM_TASK.replace("min = 4", "min = 3") + '[pipeline]\nstages = 3\nbalance = "measured"\n'
MEMBERS = tuple(f"p{i}" for i in range(6))


def _plan(stages: tuple[int, ...] | None, step: int = 5) -> RoundPlan:
    return RoundPlan(task_cid=CID, term=1, round=step, attempt=0, step=step, rounds=5, members=MEMBERS,
                     base_cid=CID, version=1, stages=stages)


def test_one_lying_driver_does_not_move_the_median():
    honest = [(0, 1000, 5000), (0, 1100, 5200)]
    assert median_micros(honest + [(0, 10**9, 1)], 3) == (0, 1100, 5000)  # the liar is outside both honest values
    assert median_micros(honest + [(0, 0, 0)], 3) == (0, 1000, 5000)  # "not measured" is no vote
    assert median_micros([(0, 7, 7, 7)], 3) == (0, 0, 0)  # another stage count than the plan's: ignored
    assert median_micros([], 3) == (0, 0, 0)


def test_costs_come_from_the_times_and_stay_near_the_parameters():
    parameters = [100, 100, 200]
    assert measured_costs(parameters, (0, 0, 0)) is None
    # Stage 0 is not measured: it costs its parameters at the measured stages' median rate (10 us each).
    assert measured_costs(parameters, (0, 1000, 2000)) == (1000.0, 1000.0, 2000.0)
    # A time far from what the parameters say at the median stage's rate stays within SPREAD of it, either way.
    four = [100, 100, 100, 200]
    high = measured_costs(four, (0, 1000, 1000, 10**9))
    low = measured_costs(four, (0, 1000, 1000, 1))
    assert high == (1000.0, 1000.0, 1000.0, 2000.0 * SPREAD) and low == (1000.0, 1000.0, 1000.0, 2000.0 / SPREAD)
    with pytest.raises(ValueError):
        measured_costs(parameters, (0, 1000))


def test_a_move_needs_the_margin():
    previous = {"a": 0, "b": 0, "c": 0, "d": 1, "e": 2, "f": 2}  # 3, 1, 2
    slightly = [1.0, 0.4, 1.1]  # c to stage 2 raises the throughput from 2 / 1.1 to 2: 1.1x
    assert assign(list(previous), slightly, previous) == {**previous, "c": 2}
    assert assign(list(previous), slightly, previous, margin=1.25) == previous
    clearly = [1.0, 0.4, 2.0]  # from 2 / 2 to 3 / 2: 1.5x
    assert assign(list(previous), clearly, previous, margin=1.25) == {**previous, "c": 2}


def test_members_hold_the_plan_to_the_times_they_received():
    task = load_task(MEASURED)
    parameters = stage_parameters(task)
    before = _plan((0, 1, 2, 2, 1, 2), step=0)  # what the parameters settle on: 1, 2 and 3 replicas
    # Stage 1 measured 10x what its parameters say of stage 2's: a member of stage 2 moves there.
    micros = (0, round(parameters[1] * 20.0), round(parameters[2] * 2.0))
    by_parameters = plan_stages(task, MEMBERS, before)
    by_times = plan_stages(task, MEMBERS, before, micros)
    assert by_parameters == before.stages  # parameters alone: nothing to move
    assert by_times is not None and by_times.count(1) == 3 and by_times != by_parameters
    # A member with the same times accepts the measured plan, and the plan by parameters (a
    # coordinator that did not apply the step has no times), and nothing else.
    assert rule_problem(task, 100, _plan(by_times), before, micros) is None
    assert rule_problem(task, 100, _plan(by_parameters), before, micros) is None
    wrong = list(by_times)
    wrong[wrong.index(1)] = 2  # a move toward stage 2, which no times here justify
    problem = rule_problem(task, 100, _plan(tuple(wrong)), before, micros)
    assert problem is not None and "the assignment from plan" in problem
    # Other times (another member's summary would be the same; these are not) give another plan.
    assert rule_problem(task, 100, _plan(by_times), before, (0, micros[1], micros[1])) is not None
    # Without the times (it resynced to the plan's step) a member checks only the shape.
    assert rule_problem(task, 100, _plan(tuple(wrong)), before, None) is None
    # Through a member's book: the times it kept for the plan's start step (mid-span, on its chain's v0).
    book = RoundBook(task, CID, Chain(CID, CID), 100, accepted=before)
    book.stage_times.note(5, micros, (1, 0))
    on_v0 = [replace(_plan(stages), version=0) for stages in (by_times, tuple(wrong))]
    assert book.rule_problem(on_v0[0]) is None and book.rule_problem(on_v0[1]) is not None
    assert book.rule_problem(replace(on_v0[1], step=6)) is None  # no times of step 6 here: the shape only
    assert book.rule_problem(_plan(tuple(wrong))) is None  # from v1, which it has not confirmed: the shape only
    # A task that balances by parameters ignores times: only the plan by parameters.
    default = load_task(MEASURED.replace('balance = "measured"\n', ""))
    assert plan_stages(default, MEMBERS, before, micros) == by_parameters
    assert rule_problem(default, 100, _plan(by_times), before, micros) is not None


def test_a_member_keeps_the_times_of_the_last_steps_it_applied():
    times = StageTimes()
    times.note(3, (0, 0, 0), (1, 0))
    assert times.at(3) is None  # nothing measured is no times
    for step in range(4, 4 + KEPT_STEPS + 1):
        times.note(step, (0, step, step), (1, 0))
    assert times.at(4) is None and times.at(5) == (0, 5, 5)
    times.note(5, (0, 9, 9), (1, 1))  # applied again (a retry): its new summary's times
    assert times.at(5) == (0, 9, 9)
    # Asked for the attempt a checkpoint's record names: only times applied under that plan.
    assert times.at(5, (1, 1)) == (0, 9, 9) and times.at(5, (1, 0)) is None and times.at(6, (1, 0)) == (0, 6, 6)


def test_a_driver_times_each_stage_per_microbatch():
    deadlines = HopDeadlines(1.0, ceiling=10.0)
    assert deadlines.stage_micros(3) == (0, 0, 0)
    for seconds in (0.010, 0.012, 0.011):
        deadlines.answered(1, "r1", seconds, 100)
    deadlines.answered(2, "r2", 0.060, 100, queued=2)  # a hop queued behind two others: its third of the wait
    assert deadlines.stage_micros(3) == (0, 22000, 20000)  # stage 1's FORWARD and BACKWARD, stage 2's LOSS
    deadlines.answered(0, None, 0.004, 0)  # the driver's own forward and backward of stage 0
    deadlines.answered(0, None, 0.004, 0)
    assert deadlines.stage_micros(3) == (8000, 22000, 20000)


def test_times_of_a_dropped_attempt_do_not_refuse_an_honest_plan():
    """A member that applied a step alone (its stage's sum completed, another's did not) kept that
    attempt's times; left out of the retry, it came back in a plan from that step which the
    coordinator made from the times of the attempt that went through. It held that honest plan to
    the dropped attempt's times and refused it as a rule break (it then stops following the
    coordinator for good). The retry's plan, from the step before, now drops them: no times of that
    step here, so it checks the plan's shape only, as a member that resynced does."""
    task = load_task(MEASURED)
    parameters = stage_parameters(task)
    key = create_new_key_pair(b"\x03" * 32)
    election = Election("QmTask", key, ElectionConfig(heartbeat_s=1.0, timeout_beats=3))
    now = 0.0
    while not election.is_coordinator:  # a lone peer elected: the plans below are signed by the term's coordinator
        now += 0.25
        assert now < 30, "no coordinator"
        election.tick(now, View(advertising=frozenset()))
    me = election.me
    members = tuple(sorted([me, *(signing.peer_str(create_new_key_pair(bytes([i]) * 32)) for i in range(10, 15))]))
    others = tuple(m for m in members if m != me)

    def plan(first_round: int, attempt: int, names: tuple[str, ...], stages: tuple[int, ...] | None,
             rounds: int = 5) -> RoundPlan:
        return RoundPlan(task_cid="QmTask", term=election.term, round=first_round, attempt=attempt, step=first_round,
                         rounds=rounds, members=names, base_cid=CID, version=1, stages=stages)

    even = tuple(2 * p for p in parameters)  # step 4's times, every member's alike
    dropped = (even[0], parameters[1], even[2])  # round 4's times in attempt 0, applied here alone
    through = (even[0], even[1], parameters[2])  # round 4's times in attempt 1, which went through without this member
    book = RoundBook(task, "QmTask", Chain("QmTask", CID), 100)
    first = plan(0, 0, members, plan_stages(task, members, None), rounds=10)
    assert book.plan_problem(first, me, election) is None
    book.stage_times.note(4, even, (first.term, first.attempt))
    book.stage_times.note(5, dropped, (first.term, first.attempt))
    retry = plan(4, 1, others, plan_stages(task, others, first, even), rounds=6)
    assert book.plan_problem(retry, me, election) == "not a member of this span"  # it checked the plan, not in it
    honest = plan(5, 2, members, plan_stages(task, members, retry, through))
    assert honest.stages not in (plan_stages(task, members, retry, dropped), plan_stages(task, members, retry))
    assert book.plan_problem(honest, me, election) is None  # on main: a RuleBreak against an honest coordinator
    assert book.stage_times.at(5) is None and book.stage_times.at(4) == even


def test_half_the_drivers_skew_the_costs_within_spread_squared():
    """The red team's bound on lying drivers: the median is the lower one, so one driver of two (half,
    not a minority) sets any stage's time downward. Lowering one stage's time by SPREAD sets the rate
    that the others are clamped around, and lowering another's to nothing puts it at the floor: a
    stage honestly measured at the common rate then costs SPREAD squared (64) times another, against
    their parameters, and never more."""
    parameters = [1000, 1000, 1000]
    honest = (10_000, 10_000, 10_000)  # every stage 10 us a parameter
    liar = (10_000, 1_000 // int(SPREAD) or 1, 1)  # stage 1 at under 1/SPREAD of that, stage 2 at nothing
    micros = median_micros([honest, liar], 3)
    assert micros == (10_000, liar[1], 1)  # the liar's values are the median of two
    costs = measured_costs(parameters, micros)
    assert costs is not None and costs[0] / costs[2] == pytest.approx(SPREAD * SPREAD)
    # A third, honest driver takes it back: the liar is a minority.
    assert median_micros([honest, honest, liar], 3) == honest
