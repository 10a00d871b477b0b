"""AutoNAT dial-back (p2ptrain.net._reachability) between real hosts on 127.0.0.1, and the verdict rule."""

from __future__ import annotations

import socket

import trio
from libp2p.host.autonat.pb.autonat_pb2 import Message
from multiaddr import Multiaddr

from p2ptrain.net._reachability import DialBackService, decide
from p2ptrain.net import Reachability
from p2ptrain.testing import connected_hosts

TIMEOUT_S = 30.0


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_dial_back_opens_a_fresh_connection_so_an_address_nobody_listens_on_is_unreached():
    async with connected_hosts(2) as (a, b):
        DialBackService(b.host)  # b serves dial-backs
        asker = DialBackService(a.host)
        with trio.fail_after(TIMEOUT_S):
            listening = [addr.to_bytes() for addr in a.host.get_addrs()]
            assert (await asker.query_server(b.id, listening))[0] == Message.OK
            # a and b are connected already: py-libp2p's own dial-back (host.connect) would say OK
            # here without dialing anything. Ours connects to the address and is refused.
            dead = Multiaddr(f"/ip4/127.0.0.1/tcp/{closed_port()}").to_bytes()
            assert (await asker.query_server(b.id, [dead]))[0] == Message.E_DIAL_ERROR
            # An address at another IP than the one b sees us at is never dialed (no amplification).
            other = Multiaddr("/ip4/10.9.9.9/tcp/4001").to_bytes()
            assert (await asker.query_server(b.id, [other]))[0] == Message.E_DIAL_REFUSED


async def test_loopback_peers_are_public_to_each_other():
    async with connected_hosts(3) as peers:
        for p in peers[1:]:
            DialBackService(p.host)
        reach = Reachability(peers[0].host, lambda: [p.id for p in peers[1:]])
        with trio.fail_after(TIMEOUT_S):
            assert await reach.check() == "public"
        assert reach.last == {"reached": 2, "unreached": 0}


def test_the_verdict_needs_two_agreeing_peers_and_one_neighbour_cannot_make_a_private_peer_public():
    assert decide(0, 0) == "unknown"
    assert decide(1, 0) == "unknown" and decide(0, 1) == "unknown"  # one answer: a LAN neighbour may be all we see
    assert decide(1, 2) == "private"  # one LAN neighbour reached us, two public peers did not
    assert decide(2, 3) == "public" and decide(1, 1) == "unknown"
