"""Stochastic wiring without a network: hops spread by throughput and queue, failed replicas left out."""

from __future__ import annotations

import collections
import random

from p2ptrain.pipeline import Wiring


def test_faster_replicas_get_more_hops_and_slower_ones_still_some():
    wiring = Wiring({1: ["fast", "slow"]}, random.Random(0))
    seconds = {"fast": 0.1, "slow": 0.4}
    picks = collections.Counter()
    for _ in range(2000):
        peer = wiring.choose(1)
        picks[peer] += 1
        wiring.started(peer)
        wiring.finished(peer, seconds[peer])
    # 10 hops/s against 2.5 hops/s: about 4 to 1.
    assert 3.0 < picks["fast"] / picks["slow"] < 5.5, picks


def test_hops_in_flight_steer_new_hops_away():
    wiring = Wiring({1: ["a", "b"]}, random.Random(1))
    for peer in ("a", "b"):
        wiring.started(peer)
        wiring.finished(peer, 0.1)
    for _ in range(3):
        wiring.started("a")  # three hops queued at a, none at b
    picks = collections.Counter(wiring.choose(1) for _ in range(1000))
    assert picks["b"] > 3 * picks["a"], picks


def test_an_unmeasured_replica_is_tried_at_the_stages_mean():
    wiring = Wiring({2: ["old", "new"]}, random.Random(2))
    wiring.started("old")
    wiring.finished("old", 0.5)
    assert wiring.weight("new") == wiring.weight("old") == 2.0


def test_a_failed_replica_is_out_until_the_next_step():
    wiring = Wiring({1: ["a", "b"], 2: ["c"]}, random.Random(3))
    wiring.started("a")
    wiring.failed("a")
    assert {wiring.choose(1) for _ in range(50)} == {"b"}
    wiring.started("b")
    wiring.failed("b")
    assert wiring.choose(1) is None
    assert wiring.choose(2) == "c"
    assert wiring.usable(1) == [] and wiring.replicas(1) == ["a", "b"]
    wiring.new_step()
    assert wiring.usable(1) == ["a", "b"]


def test_a_replica_left_out_by_another_sender_is_out_for_the_step():
    wiring = Wiring({1: ["a", "b"]}, random.Random(4))
    wiring.leave_out("a")
    wiring.leave_out("z")  # not in the plan: nothing to do
    assert wiring.is_left_out("a") and not wiring.is_left_out("b")
    assert {wiring.choose(1) for _ in range(20)} == {"b"}
    wiring.new_step()
    assert not wiring.is_left_out("a") and wiring.usable(1) == ["a", "b"]


def test_a_distrusted_replica_gets_no_hops_step_after_step_and_stays_in_the_ring():
    wiring = Wiring({1: ["liar", "b"], 2: ["c"]}, random.Random(5), distrusted=["c", "unknown"])
    wiring.distrust("liar")
    for _ in range(2):
        assert {wiring.choose(1) for _ in range(50)} == {"b"}
        assert wiring.choose(1, besides=["b"]) is None  # no other opinion to ask it for
        assert wiring.choose(2) is None  # the last of its stage: the stage is unavailable to this sender
        assert wiring.replicas(1) == ["liar", "b"] and not wiring.is_left_out("liar")  # still asked its holdings
        assert wiring.is_distrusted("liar") and wiring.is_distrusted("c") and not wiring.is_distrusted("b")
        wiring.new_step()  # a step does not clear what this sender saw
