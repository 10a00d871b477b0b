"""Which replica stalls a driver's steps (pipeline.Stragglers, red team's H1): the seconds are the
caller's, so these drive it with made-up answer times, no clock; and one driver on real libp2p
hosts with a replica that stalls every answer once its first step went by fast."""

from __future__ import annotations

import math
import random

import pytest
import trio

from p2ptrain.net import Channel
from p2ptrain.pipeline import Driver, HopDeadlines, Stragglers, Wiring
from p2ptrain.pipeline._stragglers import MAX_TRACKED
from p2ptrain.testing import connected_hosts

from .test_slow_replica import lm_loss, SlowReplica, stages, tokens

A, B, C, D = "replica-a", "replica-b", "replica-c", "replica-d"
FAST = 0.05
STALL = 4.5  # just under the runtime's 5 s floor


def steps(stragglers: Stragglers, times: list[dict[str, float]], stage: int = 1) -> list[dict]:
    return [stragglers.observe({stage: t}) for t in times]


def test_a_replica_slowest_of_its_stage_in_three_steps_of_ten_is_a_straggler_with_its_stage():
    stragglers = Stragglers()
    found = steps(stragglers, [{A: FAST, B: FAST, C: STALL}] * 3, stage=2)
    assert found == [{}, {}, {C: 2}]
    # Its record starts again: two more stalls are not three.
    assert steps(stragglers, [{A: FAST, B: FAST, C: STALL}] * 2) == [{}, {}]


def test_a_staller_that_stalls_two_steps_in_ten_is_never_found_and_that_is_the_bound():
    stragglers = Stragglers()
    pattern = [{A: FAST, B: FAST, C: STALL}] * 2 + [{A: FAST, B: FAST, C: FAST}] * 8
    assert steps(stragglers, pattern * 5) == [{}] * 50
    # A third stall within ten steps: found.
    assert steps(stragglers, [{A: FAST, B: FAST, C: STALL}] * 3) == [{}, {}, {C: 1}]


def test_honest_spread_is_no_stall_neither_under_the_factor_nor_under_the_margin():
    stragglers = Stragglers()
    # Four times the others, but by less than the margin (a loaded machine's jitter on fast hops).
    assert steps(stragglers, [{A: 0.01, B: 0.01, C: 0.9}] * 10) == [{}] * 10
    # Over the margin, but within four times the others (a big stage's queued hops).
    assert steps(stragglers, [{A: 2.0, B: 2.5, C: 7.0}] * 10) == [{}] * 10
    assert not stragglers.is_slow(7.0, [2.0, 2.5]) and stragglers.is_slow(11.0, [2.0, 2.5])


def test_a_timeout_counts_as_a_stall_but_a_stage_that_all_timed_out_names_nobody():
    stragglers = Stragglers()
    assert steps(stragglers, [{A: FAST, B: math.inf}] * 3) == [{}, {}, {B: 1}]  # two replicas: each the other's reference
    assert steps(stragglers, [{A: math.inf, B: math.inf, C: math.inf}] * 5) == [{}] * 5


def test_a_stage_of_one_replica_is_never_judged_and_stages_are_judged_apart():
    stragglers = Stragglers()
    assert [stragglers.observe({1: {A: STALL}, 2: {B: FAST, C: FAST, D: STALL}}) for _ in range(3)] == [{}, {}, {D: 2}]


def test_the_steps_answers_are_the_slowest_of_each_replica_and_a_step_that_failed_is_dropped():
    stragglers = Stragglers()
    for _ in range(2):
        stragglers.new_step()
        for peer, seconds in ((A, FAST), (B, FAST), (C, FAST), (C, STALL), (C, FAST)):
            stragglers.took(1, peer, seconds)
        assert stragglers.judge() == {}
    stragglers.new_step()
    stragglers.took(1, A, FAST)
    stragglers.took(1, C, STALL)
    stragglers.new_step()  # that step failed before its end: not judged
    assert stragglers.judge() == {}
    stragglers.took(1, A, FAST)
    stragglers.took(1, C, STALL)
    assert stragglers.judge() == {C: 1}


def test_settings_are_checked():
    with pytest.raises(ValueError):
        Stragglers(strikes=11, window=10)
    with pytest.raises(ValueError):
        Stragglers(factor=0.5)


class StallsAfterFirstStep(SlowReplica):
    """Fast in step 1, so its deadline stays the floor; then every answer waits ``delay``."""

    async def handle(self, channel: Channel, data: bytes) -> bool:
        if self.step <= 1:
            return await super(SlowReplica, self).handle(channel, data)
        return await super().handle(channel, data)


async def test_a_replica_stalling_every_answer_is_accused_by_its_driver():
    """On real hosts: three replicas of stage 1, one of which answers everything (hops and HOLDINGS)
    2 s late from step 2 on, under the hop deadline (floor 2.5 s: never timed out). Before, nothing
    told it from the others; now after three slow steps the driver names it (``Driver.stragglers``,
    its accusation in the step summary). It is not distrusted: slowness is no evidence of who caused
    it, and the wiring already sends it few hops."""
    s0, s1 = stages()
    async with connected_hosts(4) as hosts:
        driver_id = hosts[0].id
        honest = [SlowReplica(h.host, stages()[1], lm_loss, senders=[driver_id], delay=0.0) for h in hosts[1:3]]
        staller = StallsAfterFirstStep(hosts[3].host, s1, lm_loss, senders=[driver_id], delay=2.0)
        for r in (*honest, staller):
            r.serve()
        deadlines = HopDeadlines(2.5, ceiling=10.0)
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [h.id for h in hosts[1:]]}, random.Random(3)),
                        cut=stages(), hop_timeout=2.5, deadlines=deadlines)
        with trio.fail_after(60):
            for step in range(1, 5):
                driver.new_step(step)
                for r in (*honest, staller):
                    r.new_step(step)
                x, y = tokens(8, step)
                async with trio.open_nursery() as nursery:
                    for k in range(4):
                        nursery.start_soon(driver.microbatch, k, x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2], 0.25)
                await driver.finish()
                assert driver.stragglers == ({hosts[3].id: 1} if step == 4 else {})
        assert driver.timeouts == 0  # never past its deadline: only its stalls gave it away
        assert not driver.wiring.is_distrusted(hosts[3].id)


def test_what_it_keeps_is_bounded_however_many_replicas_it_judged():
    stragglers = Stragglers()
    for i in range(MAX_TRACKED + 500):
        stragglers.observe({1: {f"fresh-{i}": STALL, A: FAST, B: FAST}})
    assert len(stragglers._slow) <= MAX_TRACKED
