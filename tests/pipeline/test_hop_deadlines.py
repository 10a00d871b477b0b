"""A hop's deadline from the measured times of recent hops (pipeline.HopDeadlines): the seconds
are the caller's, so these drive it with made-up hop times, no clock."""

from __future__ import annotations

import pytest

from p2ptrain.pipeline import HopDeadlines

A, B = "replica-a", "replica-b"
SIZE = 1000


def test_before_any_hop_is_measured_a_hop_gets_the_initial_deadline_within_floor_and_ceiling():
    assert HopDeadlines(5.0, ceiling=60.0).deadline(1, A, SIZE) == 5.0
    assert HopDeadlines(5.0, ceiling=60.0, initial=20.0).deadline(1, A, SIZE) == 20.0
    assert HopDeadlines(5.0, ceiling=60.0, initial=600.0).deadline(1, A, SIZE) == 60.0
    with pytest.raises(ValueError):
        HopDeadlines(5.0, ceiling=1.0)


def test_the_deadline_follows_a_high_quantile_of_the_replicas_hops_never_below_the_floor():
    deadlines = HopDeadlines(1.0, ceiling=60.0, initial=20.0)
    for _ in range(16):
        deadlines.answered(1, A, 0.1, SIZE)
    assert deadlines.deadline(1, A, SIZE) == 1.0  # 3 x 0.1 s is under the floor
    for _ in range(14):
        deadlines.answered(1, A, 2.0, SIZE)
    assert deadlines.deadline(1, A, SIZE) == pytest.approx(6.0)  # 3 x its 0.9 quantile
    # One outlier among the last 16 hops does not move the 0.9 quantile; two do.
    deadlines.answered(1, A, 10.0, SIZE)
    assert deadlines.deadline(1, A, SIZE) == pytest.approx(6.0)
    deadlines.answered(1, A, 10.0, SIZE)
    assert deadlines.deadline(1, A, SIZE) == pytest.approx(30.0)
    # Hops measured slower than the ceiling allows: the ceiling.
    for _ in range(16):
        deadlines.answered(1, A, 50.0, SIZE)
    assert deadlines.deadline(1, A, SIZE) == 60.0


def test_a_larger_request_gets_a_deadline_scaled_by_its_size_a_smaller_one_not_shortened():
    deadlines = HopDeadlines(0.5, ceiling=60.0)
    deadlines.answered(1, A, 1.0, SIZE)
    assert deadlines.deadline(1, A, 4 * SIZE) == pytest.approx(12.0)
    assert deadlines.deadline(1, A, SIZE // 10) == pytest.approx(3.0)
    assert deadlines.deadline(1, A, 0) == pytest.approx(3.0)  # a HOLDINGS: as long as a hop there


def test_a_replica_not_measured_yet_counts_with_its_stages_hops_not_another_stages():
    deadlines = HopDeadlines(0.5, ceiling=60.0, initial=20.0)
    deadlines.answered(1, A, 2.0, SIZE)
    assert deadlines.deadline(1, B, SIZE) == pytest.approx(6.0)
    assert deadlines.deadline(2, B, SIZE) == 20.0
    deadlines.answered(1, B, 0.5, SIZE)
    assert deadlines.deadline(1, B, SIZE) == pytest.approx(1.5)  # its own hops once it has some


def test_a_hop_past_its_deadline_doubles_the_replicas_next_up_to_the_ceiling_until_it_answers():
    deadlines = HopDeadlines(0.25, ceiling=1.5)
    seen = []
    for _ in range(5):
        deadline = deadlines.deadline(1, A, SIZE)
        seen.append(deadline)
        deadlines.timed_out(1, A, deadline)
    assert seen == [0.25, 0.5, 1.0, 1.5, 1.5]  # a hung replica is still given up on within the ceiling
    assert deadlines.deadline(1, B, SIZE) == 0.25  # the other replica of the stage is not slowed
    deadlines.answered(1, A, 0.2, SIZE)  # it answers once: its hops decide again
    assert deadlines.deadline(1, A, SIZE) == pytest.approx(0.6)


def test_a_replica_cannot_grow_its_deadline_far_past_its_stages_others_by_stalling():
    """Red team's H1: a replica answering each hop 0.9 of its deadline raised its own deadline 3 x
    each time, to the ceiling (60 s), while the others of its stage answered in 10 ms. Now its
    deadline stays within PEER_CAP (4) times theirs, never below the floor; a stage's only replica
    is still waited for as measured."""
    deadlines = HopDeadlines(1.0, ceiling=60.0)
    for _ in range(16):
        deadlines.answered(1, A, 0.01, SIZE)
    for _ in range(8):
        deadlines.answered(1, B, 0.9 * deadlines.deadline(1, B, SIZE), SIZE)
    assert deadlines.deadline(1, B, SIZE) == 1.0  # 4 x 3 x 0.01 s is under the floor
    for _ in range(16):
        deadlines.answered(1, A, 2.0, SIZE)
    for _ in range(8):
        deadlines.answered(1, B, 0.9 * deadlines.deadline(1, B, SIZE), SIZE)
    assert deadlines.deadline(1, B, SIZE) == pytest.approx(24.0)  # 4 x A's 6 s, where B's own grew past it
    alone = HopDeadlines(1.0, ceiling=60.0)
    for _ in range(8):
        alone.answered(2, A, 0.9 * alone.deadline(2, A, SIZE), SIZE)
    assert alone.deadline(2, A, SIZE) == 60.0
    with pytest.raises(ValueError):
        HopDeadlines(1.0, ceiling=60.0, peer_cap=0.5)
