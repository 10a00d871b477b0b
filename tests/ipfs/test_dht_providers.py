"""Providers and heads found through the Kad-DHT (issue 15): a fetcher not connected to the holder finds it.

H is a full peer that holds a file and a finished run's chain (``tasks/<task>/chain.jsonl``, as
every member keeps it); B is a bare node (mesh and DHT only: no content or task service, so it
forwards no head request and serves no block); C and D are full peers that bootstrap from B only.

- C fetches H's file: its connected peer B cannot serve it, so the DHT lookup that runs beside the
  fetch names H (B took H's provider record), H is dialed, joins the fetch and serves it.
- D runs ``model fetch --latest``'s finder: its head requests reach nobody who holds the chain
  (B does not relay the tasks topic) until the DHT names H under the task's head key; once dialed,
  H answers and D verifies the chain, as from any other answer.

Heartbeats would connect everyone of a small mesh to everyone; here every node is at its cap of
kept peers (``MAX_KEPT_PEERS`` = 0: only bootstrap peers are dialed, as on a mesh past 256 peers),
so C and D hear of H but do not dial it, and H does not dial them: the DHT is how they find H. The
periodic walks of the DHT (which would dial whoever they meet) wait an hour, and py-libp2p's own
refresh of the routing table is left out (KadDHT's main loop runs one at the DHT's start: C's
own-key lookup through B met H and dialed it ~1.5 s after C started, so the check below passed
only when H's heartbeat reached C first; under load it did not, and a full suite failed on it).
So no connection comes from anywhere but the lookups under test (a lookup's own walk may dial the
peers it meets: on a mesh this small, H; so the head part checks that the head key names H, then
the whole find).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from libp2p.kad_dht.kad_dht import KadDHT

from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.mesh import _discovery as discovery_module
from p2ptrain.node import Node, NodeConfig
from p2ptrain.services import LatestFinder, make_peer
from p2ptrain.services._latest import head_key
from p2ptrain.testing import proven_chain, rules_task, wait_until

DEADLINE_S = 60.0  # four nodes start, two announcements, two lookups, 1 MiB and a chain on loopback
STEP_S = 15.0  # each wait inside it: an announcement (retried every 2 s), a lookup and its dial
FILE_BYTES = 1024 * 1024 + 7  # several 256 KiB leaves under a root: a DAG, not one block


async def test_a_fetcher_finds_the_holder_of_content_and_of_a_runs_head_through_the_dht(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(discovery_module, "MAX_KEPT_PEERS", 0)
    monkeypatch.setattr(discovery_module, "DHT_WALK_INTERVALS_S", (3600.0,))

    async def no_refresh(dht: KadDHT) -> None:
        """KadDHT's main loop refreshes at start, then every 10 min: no walk within the test."""

    monkeypatch.setattr(KadDHT, "refresh_routing_table", no_refresh)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nodes: list[Node] = []

            async def start(node: Node) -> Node:
                nodes.append(node)
                await nursery.start(node.run)
                return node

            try:
                h = make_peer(Node(tmp_path / "h", NodeConfig(dht=True)))
                store = h.content.store
                data = os.urandom(FILE_BYTES)
                cid = store.add_bytes(data)
                store.pin_add(cid)  # announced when H starts
                task_cid, rules = rules_task(store)
                initial, v1 = store.add_bytes(b"model 0"), store.add_bytes(b"model 1")
                chain = proven_chain(task_cid, initial, [v1], [h.node.key_pair], rules=rules)
                (tmp_path / "h" / "tasks" / task_cid).mkdir(parents=True)
                (tmp_path / "h" / "tasks" / task_cid / "chain.jsonl").write_bytes(chain.to_bytes())
                await start(h.node)
                b = await start(Node(tmp_path / "b", NodeConfig(bootstrap=h.node.addrs[:1], dht=True)))
                routing = h.content.routing
                assert routing is not None
                await wait_until(lambda: routing.provides >= 2, STEP_S, what="H's two announcements taken by B")
                c = make_peer(Node(tmp_path / "c", NodeConfig(bootstrap=b.addrs[:1], dht=True)))
                d = make_peer(Node(tmp_path / "d", NodeConfig(bootstrap=b.addrs[:1], dht=True)))
                await start(c.node)
                await start(d.node)
                # C and D hear H's heartbeat through B, yet do not dial it.
                await wait_until(lambda: c.node.membership.get(h.node.peer_id) and d.node.membership.get(h.node.peer_id),
                                 STEP_S, what="C and D heard of H")
                assert c.node.discovery is not None and not c.node.discovery.connected(h.node.peer_id)
                assert d.node.discovery is not None and not d.node.discovery.connected(h.node.peer_id)

                await c.content.fetch(cid, timeout=STEP_S)
                assert c.content.store.cat(cid) == data
                assert c.content.dht_fetches == 1
                # Nobody holds this one: the fetch fails (one clear error) once the lookup is over too.
                missing = "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH"  # the empty file's CID
                with pytest.raises(ContentUnavailable):
                    await c.content.fetch(missing, timeout=STEP_S)

                # The task's head key names H (what D's finder looks up and dials), and the finder
                # verifies the head H then answers, as from any other answer.
                assert d.content.routing is not None
                holders = await d.content.routing.find(head_key(task_cid))
                assert [info.peer_id for info in holders] == [h.node.peer_id]
                finder = LatestFinder(d.node, d.content, task_cid)
                with trio.fail_after(STEP_S):
                    head, got = await finder.find()
                assert (head.model_cid, got.head_cid, got.version) == (v1, v1, 1)
            finally:
                for node in nodes:
                    node.stop()
