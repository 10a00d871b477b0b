"""The one token-bucket refill both rate gates share (base/_token_bucket.py)."""

from p2ptrain.base import refilled
from p2ptrain.mesh._rates import Rate, SenderRates
from p2ptrain.net._inbound_limits import InboundLimits


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    assert refilled(0.0, at=10.0, now=10.5, per_s=4.0, burst=8.0) == 2.0
    assert refilled(3.0, at=0.0, now=100.0, per_s=4.0, burst=8.0) == 8.0


def test_a_clock_that_went_back_refills_nothing_and_takes_nothing() -> None:
    assert refilled(3.0, at=10.0, now=9.0, per_s=4.0, burst=8.0) == 3.0


def test_both_gates_refill_alike() -> None:
    """Empty each gate's bucket at t=0, then ask at t=0.5 what it gives: the same rate said in
    both places gives the same count."""
    rates = SenderRates({"head": Rate(per_s=10.0, burst=20.0)})
    limits = InboundLimits()
    limits.rate, limits.burst = 10.0, 20.0
    peer = b"peer"
    for _ in range(20):
        assert rates.take(peer, "head", 0.0)
    assert limits.admit(peer, 20, 0.0) == 20
    given_by_rates = 0
    while rates.take(peer, "head", 0.5):
        given_by_rates += 1
    assert given_by_rates == limits.admit(peer, 100, 0.5) == 5
