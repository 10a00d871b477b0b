"""Channels of the stage protocol kept open and reused (``/p2ptrain/pipeline/1.1.0``,
pipeline/_channels.py): a driver opens one channel per replica and reuses it hop after hop and step
after step, a replica answers requests in turn on one channel and still refuses (and counts) a bad
one, a hop cut short never leaves its channel to the next hop, and idle channels are closed on both
sides before either reuses a dead one. Real libp2p hosts on 127.0.0.1.

Before this change every hop opened a channel of its own (``/p2ptrain/pipeline/1.0.0``: one request
per channel), a cost of every request that the profile of a pipelined step put at 5% of its time
(docs/benchmarks.md); these tests fail there (no ``ChannelPool``, a replica answering one request
per channel).
"""

from __future__ import annotations

import random

import pytest
import torch
import trio

from p2ptrain.net import Channel, ChannelClosed, open_channel, serve_channels
from p2ptrain.pipeline import ChannelPool, Driver, PROTOCOL, serve_requests, StageReplica, Wiring
from p2ptrain.pipeline import _replica
from p2ptrain.testing import connected_hosts
from p2ptrain.wire.activations import decode_frame, encode_frame, Frame, Kind

from .test_hostile_stages import DEADLINE_S, LM, lm_loss, stages, tokens


def forward(step: int, mb: int, size: int = 2) -> bytes:
    return encode_frame(Frame(Kind.FORWARD, step, mb, 1, tensors=(torch.randn(size, LM["context"], LM["width"]),)))


async def ask(channel: Channel, request: bytes) -> Frame:
    await channel.send(request)
    return decode_frame(await channel.recv(1 << 24))


async def test_a_driver_reuses_one_channel_per_replica_across_microbatches_and_steps():
    s0, s1 = stages(2)
    async with connected_hosts(2) as hosts:
        replica = StageReplica(hosts[1].host, s1, lm_loss, senders=[hosts[0].id])
        guard = replica.serve()
        driver = Driver(hosts[0].host, s0, lm_loss, Wiring({1: [hosts[1].id]}, random.Random(1)), cut=stages(2))
        x, y = tokens(12)
        with trio.fail_after(DEADLINE_S):
            for step in (0, 1):
                driver.new_step(step)
                replica.new_step(step)
                for mb in range(6):
                    await driver.microbatch(mb, x[2 * mb : 2 * mb + 2], y[2 * mb : 2 * mb + 2], 1 / 6)
                assert await driver.finish() == {1: [hosts[1].id]}
                assert replica.held() == set(range(6))
            assert guard.open_streams(hosts[0].id) == 1  # the one channel, idle in the driver's pool
            await driver.aclose()
        # 7 hops a step (6 LOSS, 1 HOLDINGS), 2 steps: one channel opened, reused for the 13 others.
        assert (driver.pool.opened, driver.pool.reused) == (1, 13)
        assert replica.requests == 14 and not replica.refused


async def test_a_replica_answers_requests_in_turn_and_refuses_a_bad_one_after_good_ones():
    async with connected_hosts(2) as hosts:
        replica = StageReplica(hosts[1].host, stages(2)[1], lm_loss, senders=[hosts[0].id])
        replica.serve()
        with trio.fail_after(DEADLINE_S):
            async with await open_channel(hosts[0].host, hosts[1].id, PROTOCOL) as channel:
                assert (await ask(channel, forward(0, 1))).kind == Kind.OUTPUT
                held = await ask(channel, encode_frame(Frame(Kind.HOLDINGS, 0, 0, 1)))
                assert held.kind == Kind.HELD
                assert (await ask(channel, forward(0, 2))).microbatch == 2
                with pytest.raises(ChannelClosed):  # garbage on a channel that answered: reset, counted
                    await ask(channel, b"PP garbage")
            async with await open_channel(hosts[0].host, hosts[1].id, PROTOCOL) as channel:
                assert (await ask(channel, forward(0, 3))).kind == Kind.OUTPUT
                with pytest.raises(ChannelClosed):  # a request for another stage, on a channel in use
                    await ask(channel, encode_frame(Frame(Kind.FORWARD, 0, 4, 2, tensors=decode_frame(forward(0, 4)).tensors)))
        assert replica.refused == {"malformed": 2}
        assert replica.requests == 4


async def test_a_hop_cut_short_never_leaves_its_late_answer_to_the_next_request():
    """The driver gives up on a slow replica's answer (its hop's deadline): the channel is reset,
    not pooled, and the next request to that replica goes on a new channel and gets its own answer,
    never the late one."""
    release = trio.Event()

    class Slow(StageReplica):
        async def handle(self, channel, data):
            await release.wait()
            return await super().handle(channel, data)

    async with connected_hosts(2) as hosts:
        replica = Slow(hosts[1].host, stages(2)[1], lm_loss, senders=[hosts[0].id])
        replica.serve()
        pool = ChannelPool(hosts[0].host, PROTOCOL, clock=trio.current_time)
        with trio.fail_after(DEADLINE_S):
            with trio.move_on_after(0.5) as late:
                async with pool.channel(hosts[1].id) as channel:
                    await ask(channel, forward(0, 1))
            assert late.cancelled_caught and pool.idle(hosts[1].id) == 0
            release.set()
            async with pool.channel(hosts[1].id) as channel:
                answer = await ask(channel, forward(0, 2))
        assert (answer.kind, answer.microbatch) == (Kind.OUTPUT, 2)
        assert (pool.opened, pool.reused) == (2, 0)


async def test_channels_idle_too_long_are_closed_by_the_replica_and_not_reused_by_the_sender(monkeypatch):
    monkeypatch.setattr(_replica, "IDLE_TIMEOUT_S", 0.3)
    async with connected_hosts(2) as hosts:
        replica = StageReplica(hosts[1].host, stages(2)[1], lm_loss, senders=[hosts[0].id])
        replica.serve()
        now = [0.0]
        pool = ChannelPool(hosts[0].host, PROTOCOL, clock=lambda: now[0], idle_s=10.0)
        with trio.fail_after(DEADLINE_S):
            async with await open_channel(hosts[0].host, hosts[1].id, PROTOCOL) as channel:
                assert (await ask(channel, forward(0, 1))).kind == Kind.OUTPUT
                with pytest.raises(ChannelClosed):  # no next request: the replica closes it
                    await channel.recv(1 << 24)
            assert not replica.refused  # an idle sender is not a slow one
            for mb, clock in enumerate([0.0, 9.0, 20.0]):  # reused within idle_s, replaced after
                now[0] = clock
                async with pool.channel(hosts[1].id) as channel:
                    assert (await ask(channel, forward(0, mb))).microbatch == mb
            await pool.aclose()
        assert (pool.opened, pool.reused) == (2, 1)


async def test_each_request_on_a_channel_goes_to_the_replica_current_when_it_arrives():
    """A runtime replaces its replica with each plan, while a driver's channel stays open: the
    request of the next step is the next replica's, and a host that serves no stage resets."""
    async with connected_hosts(3) as hosts:
        first = StageReplica(hosts[1].host, stages(2)[1], lm_loss, senders=[hosts[0].id])
        second = StageReplica(hosts[1].host, stages(2)[1], lm_loss, senders=[hosts[0].id])
        second.new_step(1)
        current: list[StageReplica | None] = [first]
        serve_channels(hosts[1].host, PROTOCOL, lambda channel: serve_requests(channel, lambda: current[0]))
        with trio.fail_after(DEADLINE_S):
            async with await open_channel(hosts[0].host, hosts[1].id, PROTOCOL) as channel:
                assert (await ask(channel, forward(0, 1))).kind == Kind.OUTPUT
                current[0] = second
                assert (await ask(channel, forward(1, 2))).kind == Kind.OUTPUT
                current[0] = None
                with pytest.raises(ChannelClosed):
                    await ask(channel, forward(1, 3))
            current[0] = second
            async with await open_channel(hosts[2].host, hosts[1].id, PROTOCOL) as channel:
                with pytest.raises(ChannelClosed):  # no sender of the plan: reset before a byte is read
                    await ask(channel, forward(1, 4))
        assert (first.requests, second.requests) == (1, 1)
        assert second.refused == {"outsider": 1} and not first.refused
