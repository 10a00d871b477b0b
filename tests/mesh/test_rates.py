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


def test_a_big_message_costs_a_token_per_started_unit_so_its_sender_gets_fewer():
    # Issue 27: forged heads of 1,024 members (57 KB) at 8/s held a node's event loop for 0.4-0.7 s
    # at a time; with a token per started 4 KiB, one sender of such heads gets ~0.6/s through.
    rate = Rate(per_s=8.0, burst=32.0, unit_bytes=4096)
    assert rate.cost(0) == rate.cost(300) == rate.cost(4096) == 1.0
    assert rate.cost(4097) == 2.0 and rate.cost(56_880) == 14.0
    rates = SenderRates({"task_head": rate})
    big = sum(rates.take(b"flooder", "task_head", now=0.0, nbytes=56_880) for _ in range(100))
    small = sum(rates.take(b"honest", "task_head", now=0.0, nbytes=600) for _ in range(100))
    assert (big, small) == (2, 32)  # the burst, in tokens: 2 big heads, 32 small ones
    assert not rates.has_token(b"flooder", "task_head", now=1.0, nbytes=56_880)  # 8 tokens back: < 14
    assert rates.has_token(b"flooder", "task_head", now=1.0, nbytes=600)
    over_ten_s = sum(rates.take(b"flooder", "task_head", now=t / 10, nbytes=56_880) for t in range(1, 101))
    assert over_ten_s == 6  # (4 left of the burst + 80 over 10 s) / 14 a head; 8/s before
