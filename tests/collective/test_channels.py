"""Round channels outlive rounds: reused after clean rounds, replaced after failed ones."""

from __future__ import annotations

import torch
import trio
from multiaddr import Multiaddr

from p2ptrain.collective import Collective, PeerFailed, RoundSpec
from p2ptrain.net import Relaying, over_relay
from p2ptrain.testing import connected_hosts


def _inputs(n: int, size: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(size)]


def _calls(peers, xs, ring, round_id, spec=RoundSpec()):
    """One all-reduce call per peer, for ``gather``."""
    return [lambda i=i: peers[i].collective.allreduce(xs[i], ring, round_id, spec) for i in range(len(peers))]


async def test_clean_rounds_reuse_their_channels(cluster, gather):
    n = 50_000
    async with cluster(4) as peers:
        ring = [p.id for p in peers]
        xs = _inputs(n, 4)
        expected = torch.stack(xs).sum(0) / 4
        for rid in range(1, 7):
            density = 1.0 if rid % 3 == 0 else 0.01
            outs = await gather(_calls(peers, xs, ring, rid, RoundSpec(density=density)))
            assert all(out.equal(outs[0]) for out in outs), rid
            if density == 1.0:
                assert torch.allclose(outs[0], expected, atol=1e-6)
            else:
                assert outs[0].count_nonzero() == 500
        # A sparse round links every member to every other: 3 channels each, opened once.
        assert [p.collective.hub.channels_opened for p in peers] == [3, 3, 3, 3]


async def test_a_dead_idle_channel_is_replaced_without_failing_the_round(cluster, gather):
    n = 20_000
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        xs = _inputs(n, 3)
        expected = torch.stack(xs).sum(0) / 3
        await gather(_calls(peers, xs, ring, 1))
        hub = peers[0].collective.hub
        opened = hub.channels_opened
        # Reset peer 0's idle channel to peer 1 underneath it, as when peer 1 dropped it.
        (channel, _), = hub.dialer.idle[ring[1]]
        await channel._stream.reset()
        outs = await gather(_calls(peers, xs, ring, 2))
        for out in outs:
            assert torch.allclose(out, expected, atol=1e-6)
        assert hub.channels_opened == opened + 1


async def test_after_a_failed_round_the_next_one_runs_on_fresh_channels(cluster, gather):
    n = 30_000
    async with cluster(3) as peers:
        ring = [p.id for p in peers]
        xs = _inputs(n, 3)
        expected = torch.stack(xs).sum(0) / 3
        await gather(_calls(peers, xs, ring, 1))
        # Peer 2 disagrees on the ring's order: the round fails on everyone, mid-handshake.
        wrong = [ring[0], ring[2], ring[1]]
        outs = await gather([
            lambda i=i: peers[i].collective.allreduce(xs[i], wrong if i == 2 else ring, 2, RoundSpec(timeout=2.0))
            for i in range(3)
        ], deadline=30)
        assert all(isinstance(out, PeerFailed) for out in outs), outs
        outs = await gather(_calls(peers, xs, ring, 3))
        for out in outs:
            assert out.equal(outs[0])
            assert torch.allclose(out, expected, atol=1e-6)
        outs = await gather(_calls(peers, xs, ring, 4, RoundSpec(density=0.05)))
        assert all(out.equal(outs[0]) for out in outs)


async def test_after_a_direct_connection_appears_the_rounds_leave_the_relay(gather):
    # What a hole punch leaves: the relayed connection kept (net.relay) beside a new direct one.
    # The round channels opened over the relay must not be reused then, or every later round would
    # still cross the relay.
    n = 40_000
    async with connected_hosts(3, connected=False) as (a, relay_host, b):
        async with trio.open_nursery() as nursery:
            relays = [Relaying(relay_host.host, serve=True, hole_punch=False),
                      *(Relaying(h.host, serve=False, hole_punch=False) for h in (a, b))]
            for relay in relays:
                await nursery.start(relay.run)
            with trio.fail_after(30):
                await b.host.connect(relay_host.info)
                assert await relays[2].reserve(relay_host.id, relay_host.host.get_addrs()[0])
                await relays[1].dial(Multiaddr(relays[2].addrs[0]))
            peers = [Collective(a.host), Collective(b.host)]
            ring = [a.id, b.id]
            xs = _inputs(n, 2)
            expected = torch.stack(xs).sum(0) / 2

            def idle_channels():
                return [channel for peer, other in zip(peers, reversed(ring))
                        for channel, _ in peer.hub.dialer.idle[other]]

            for rid, direct in ((1, False), (2, True)):
                if direct:
                    with trio.fail_after(30):
                        await a.host.get_network().dial_addr(b.host.get_addrs()[0], b.id)
                outs = await gather([lambda i=i: peers[i].allreduce(xs[i], ring, rid, RoundSpec(density=1.0)) for i in range(2)])
                for out in outs:
                    assert torch.allclose(out, expected, atol=1e-6)
                channels = idle_channels()
                assert len(channels) == 2 and all(over_relay(c.connection) is not direct for c in channels), rid
            forwarded = relays[0].protocol.relayed_bytes
            outs = await gather([lambda i=i: peers[i].allreduce(xs[i], ring, 3, RoundSpec(density=1.0)) for i in range(2)])
            assert relays[0].protocol.relayed_bytes == forwarded  # round 3 reused the direct channels
            nursery.cancel_scope.cancel()
