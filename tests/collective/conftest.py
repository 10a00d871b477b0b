"""Real libp2p hosts on 127.0.0.1, each with a Collective, fully connected, in this trio process."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from p2ptrain.collective import Collective
from p2ptrain.net.host import make_host

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _addr(host) -> Multiaddr:
    addr = host.get_addrs()[0]
    if "/p2p/" not in str(addr):
        addr = Multiaddr(f"{addr}/p2p/{host.get_id().to_base58()}")
    return addr


@asynccontextmanager
async def start_cluster(n: int, **collective_options):
    """``n`` running hosts, every pair connected, and a Collective on each (ring = list order)."""
    async with AsyncExitStack() as stack:
        hosts = []
        for _ in range(n):
            host = make_host(create_new_key_pair(), [LOOPBACK])
            await stack.enter_async_context(host.run(listen_addrs=[Multiaddr(LOOPBACK)]))
            hosts.append(host)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i, a in enumerate(hosts):
                    for b in hosts[i + 1 :]:
                        nursery.start_soon(a.connect, info_from_p2p_addr(_addr(b)))
        yield [Collective(h, **collective_options) for h in hosts]


@pytest.fixture
def cluster():
    return start_cluster
