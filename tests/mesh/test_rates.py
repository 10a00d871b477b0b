"""Token buckets per (sender, message type): the bookkeeping of mesh.router's per-sender rates,
driven by an injected clock."""

from __future__ import annotations

from p2ptrain.mesh import Rate
from p2ptrain.mesh._rates import SenderRates


def test_a_sender_gets_its_burst_then_its_rate_and_others_are_untouched():
    rates = SenderRates({"task_head": Rate(per_s=2.0, burst=4.0)})
    taken = sum(rates.take(b"a", "task_head", now=0.0) for _ in range(10))
    assert taken == 4
    assert not rates.has_token(b"a", "task_head", now=0.0)
    assert rates.take(b"b", "task_head", now=0.0)  # another sender: its own bucket
    assert rates.take(b"a", "heartbeat", now=0.0)  # a type without a limit: always
    assert rates.has_token(b"a", "task_head", now=0.5)  # 2/s: one token back after 0.5 s
    assert rates.take(b"a", "task_head", now=0.5) and not rates.take(b"a", "task_head", now=0.5)
    assert sum(rates.take(b"a", "task_head", now=100.0) for _ in range(10)) == 4  # refilled to the burst, no more


def test_looking_charges_nothing_and_buckets_are_bounded():
    rates = SenderRates({"x": Rate(per_s=1.0, burst=1.0)}, max_buckets=8)
    assert all(rates.has_token(b"a", "x", now=0.0) for _ in range(5))
    assert rates.take(b"a", "x", now=0.0)
    for i in range(100):
        rates.take(bytes([i]) * 4, "x", now=0.0)
    assert len(rates._buckets) == 8
    assert rates.take(b"a", "x", now=0.0)  # forgotten: refilled (memory is bounded, not any one rate)
