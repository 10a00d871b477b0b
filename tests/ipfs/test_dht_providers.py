"""Providers found through the Kad-DHT (issue 15): a fetcher not connected to the holder finds it.

A holds a file and announces its root; B bootstraps from A; C bootstraps from B only. C's fetch asks
its connected peers (B refuses: it does not hold the DAG) and, at the same time, the DHT, which names
A (B took A's provider record); A is dialed, joins the fetch, and serves it, every block verified.

Heartbeats would connect everyone of a small mesh to everyone; here every node is at its cap of
kept peers (``MAX_KEPT_PEERS`` = 0: only bootstrap peers are dialed, as on a mesh past 256 peers),
so C hears of A but does not dial it, and A does not dial C: the DHT is how C finds A.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from p2ptrain.mesh import discovery as discovery_module
from p2ptrain.node import Node
from p2ptrain.runtime.peer import Peer, make_peer
from p2ptrain.testing import wait_until

DEADLINE_S = 30.0  # three nodes start, one announcement, one lookup, 1 MiB on loopback
STEP_S = 10.0  # each wait inside it: an announcement (retried every 2 s) or a connection
FILE_BYTES = 1024 * 1024 + 7  # several 256 KiB leaves under a root: a DAG, not one block


async def test_a_fetcher_finds_the_holder_it_is_not_connected_to_through_the_dht(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery_module, "MAX_KEPT_PEERS", 0)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            peers: list[Peer] = []

            async def start(name: str, bootstrap: list[str]) -> Peer:
                peer = make_peer(Node(tmp_path / name, bootstrap=bootstrap, dht=True))
                peers.append(peer)
                await nursery.start(peer.node.run)
                return peer

            try:
                a = await start("a", [])
                data = os.urandom(FILE_BYTES)
                cid = a.content.store.add_bytes(data)
                a.content.announce(cid)
                b = await start("b", a.node.addrs[:1])
                assert a.node.discovery is not None and b.node.discovery is not None
                assert a.content.routing is not None
                await wait_until(lambda: a.content.routing.provides >= 1, STEP_S,  # type: ignore[union-attr]
                                 what="A's announcement taken by B")
                c = await start("c", b.node.addrs[:1])
                assert c.node.discovery is not None
                # C hears A's heartbeat through B (and A hears C's), yet neither dials the other.
                await wait_until(lambda: c.node.membership.get(a.node.peer_id), STEP_S, what="C heard of A")
                assert not c.node.discovery.connected(a.node.peer_id)
                assert not b.content.store.has(cid)

                await c.content.fetch(cid, timeout=STEP_S)

                assert c.content.store.cat(cid) == data
                assert c.content.dht_fetches == 1
                assert c.content.routing is not None and c.content.routing.provider_dials >= 1
            finally:
                for peer in peers:
                    peer.node.stop()
