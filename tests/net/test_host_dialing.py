"""Only p2ptrain's discovery dials: py-libp2p's background dialer is never started on our hosts.

py-libp2p 0.8.1's swarm runs an AutoConnector (network/auto_connector.py): at start, every 10 s
while the host has fewer than 50 connections (so always, on our meshes) and after every
disconnect, it dials peers of the peerstore it is not connected to, up to half-way between its
watermarks (150), 16 at a time. The peerstore holds addresses that DHT answers and heartbeats
named, so that dialer went around every bound of p2ptrain.mesh._discovery (kept peers, dials at
once, backoff of peers never reached: issue 13), and around a test's choice of who dials whom.
"""

from __future__ import annotations

import trio

from p2ptrain.testing import connected_hosts


async def test_a_host_does_not_dial_peers_of_its_peerstore_on_its_own() -> None:
    async with connected_hosts(2, connected=False) as (a, x):
        a.host.get_peerstore().add_addrs(x.id, x.host.get_addrs(), 3600)
        # What the swarm runs at start, every 10 s below 50 connections and after each disconnect;
        # it returns once its dials are done (before: connected to x here).
        with trio.fail_after(15):
            await a.host.get_network().auto_connector.maybe_connect()
        assert x.id not in a.host.get_connected_peers()
        assert a.id not in x.host.get_connected_peers()
