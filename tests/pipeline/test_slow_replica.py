"""A replica slower than the hop deadline's floor, and one that hangs (issue 31, under load): hop
deadlines come from the hops measured (pipeline.HopDeadlines), so a slow but alive replica is timed
out a few times at most, then waited for, while a hung one is still given up on and rerouted."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
import trio

from p2ptrain.models._registry import build_model
from p2ptrain.net import Channel
from p2ptrain.pipeline import Driver, HopDeadlines, partition, StageReplica, StageUnavailable, Wiring
from p2ptrain.testing import connected_hosts

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}
SEED = 5
DEADLINE_S = 60
FLOOR_S = 0.25  # the configured hop deadline: the least a hop gets
SLOW_S = 1.0  # what the slow replica takes per request: four times the floor


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stages():
    return partition(build_model("transformer_lm", LM, seed=SEED), 2)


def tokens(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, LM["vocab_size"], (size, LM["context"] + 1), generator=g)
    return t[:, :-1], t[:, 1:]


class SlowReplica(StageReplica):
    """An honest replica on a loaded machine: every request waits ``delay`` seconds (trio's clock)
    before it is computed; ``None``: it never answers (a hung process, its connection still up)."""

    def __init__(self, *args, delay: float | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    async def handle(self, channel: Channel, data: bytes) -> bool:
        if self.delay is None:
            await trio.sleep_forever()
        await trio.sleep(self.delay)
        return await super().handle(channel, data)


async def test_a_slow_replica_is_timed_out_a_few_times_then_waited_for():
    """The stage's only replica takes four times the floor: with a fixed deadline every step failed
    (StageUnavailable, the run's retry, the work thrown away); now the deadline doubles after each
    timeout until one hop is measured, and from then on the steps complete with no timeout."""
    s0, s1 = stages()
    async with connected_hosts(2) as hosts:
        slow = SlowReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id], delay=SLOW_S)
        slow.serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id]}, random.Random(1)), cut=stages(),
                        hop_timeout=FLOOR_S)
        outcomes = []
        with trio.fail_after(DEADLINE_S):
            for step in range(1, 8):
                driver.new_step(step)
                slow.new_step(step)
                timeouts = driver.timeouts
                x, y = tokens(2, step)
                try:
                    await driver.microbatch(step, x, y, 1.0)
                except StageUnavailable:
                    outcomes.append("failed")
                    continue
                assert await driver.finish() == {1: [hosts[1].id]}
                outcomes.append("done" if driver.timeouts == timeouts else "timed out")
        # 0.25 s, 0.5 s, 1 s: each timed out (1 s of sleep and the compute); 2 s is enough, and then
        # the deadline is three times the hop measured.
        assert outcomes == ["failed"] * 3 + ["done"] * 4
        assert slow.held() == {7}


async def test_a_hung_replica_is_still_rerouted_within_the_ceiling():
    """A replica whose connection stays up and that never answers: each of its hops is given up on
    within the deadlines' ceiling however long it backs off, its microbatches are served by the other
    replica, and it is out of the stage's ring (its HOLDINGS bounded the same way)."""
    s0, s1 = stages()
    async with connected_hosts(3) as hosts:
        honest = StageReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id])
        honest.serve()
        hung = SlowReplica(hosts[2].host, stages()[1], lm_loss, senders=[hosts[0].id], delay=None)
        hung.serve()
        deadlines = HopDeadlines(FLOOR_S, ceiling=4 * FLOOR_S)
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id, hosts[2].id]}, random.Random(2)),
                        cut=stages(), hop_timeout=FLOOR_S, deadlines=deadlines)
        ids = list(range(6))
        with trio.fail_after(DEADLINE_S):
            for step in range(1, 5):
                driver.new_step(step)
                honest.new_step(step)
                hung.new_step(step)
                x, y = tokens(2 * len(ids), step)
                async with trio.open_nursery() as nursery:
                    for k in ids:
                        nursery.start_soon(driver.microbatch, k, x[2 * k : 2 * k + 2], y[2 * k : 2 * k + 2], 1 / len(ids))
                assert await driver.finish() == {1: [hosts[1].id]}
                assert honest.held() == set(ids)
                assert deadlines.deadline(1, hosts[2].id, 0) <= 4 * FLOOR_S
        assert driver.timeouts >= 4  # it was tried again every step, and timed out each time
