"""The pure part of pubsub's inbound limits (net/_inbound_limits.py), driven by a hand-fed clock;
the same limits against real hosts and floods: tests/mesh/test_hostile.py, tests/bench_chaos/."""

from __future__ import annotations

from p2ptrain.net._inbound_limits import (FLOODER_BURST, FLOODER_FORGET_S, FLOODER_MAX_PAUSE_S, FLOODER_PAUSE_S,
                                          FLOODER_REFUSALS_PER_S, INBOUND_BURST, MAX_INBOUND_MESSAGES_PER_PEER_PER_S,
                                          InboundLimits, refusal_units)


def test_a_peer_gets_its_burst_then_its_rate_and_others_are_counted_apart() -> None:
    limits = InboundLimits()
    assert limits.admit("a", INBOUND_BURST + 50, now=0.0) == INBOUND_BURST
    assert limits.admit("a", 50, now=0.0) == 0
    assert limits.admit("a", 10_000, now=1.0) == int(MAX_INBOUND_MESSAGES_PER_PEER_PER_S)
    assert limits.admit("b", 10, now=1.0) == 10
    limits.forget("a")
    assert limits.admit("a", 10, now=1.0) == 10  # a new stream starts with a full bucket


def test_a_flooder_is_paused_past_its_allowance_and_each_pause_soon_after_doubles_up_to_the_cap() -> None:
    limits = InboundLimits()
    assert refusal_units(1) == 1 and refusal_units(4096) == 1 and refusal_units(57_000) == 14
    assert limits.refused("f", FLOODER_BURST, now=0.0) is None
    assert limits.take_pause("f") is None
    now, pauses = 0.0, []
    for _ in range(6):
        pause = limits.refused("f", 10 * FLOODER_BURST, now)
        assert pause is not None and limits.take_pause("f") == now + pause
        assert limits.take_pause("f") is None  # taken once
        pauses.append(pause)
        now += pause + 1.0  # it floods again a second after it is read again
    assert pauses == [FLOODER_PAUSE_S, 2, 4, FLOODER_MAX_PAUSE_S, FLOODER_MAX_PAUSE_S, FLOODER_MAX_PAUSE_S]
    # Quiet for longer than FLOODER_FORGET_S after its last pause: the next pause is the first again.
    now += FLOODER_FORGET_S + FLOODER_BURST / FLOODER_REFUSALS_PER_S
    assert limits.refused("f", 10 * FLOODER_BURST, now) == FLOODER_PAUSE_S
