"""A real in-process mesh: typed dispatch, bad input through the mesh, goodbye, transitive discovery."""

from __future__ import annotations

import json
import struct
import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.wire import MAX_MESSAGE_BYTES, MESH_TOPIC, _codec as codec, encode
from p2ptrain.net import PubsubMessageTooLarge as MessageTooLarge
from p2ptrain.node import Node, NodeConfig
from p2ptrain.testing import local_mesh, subscribed
from p2ptrain.wire._limits import WIRE_VERSION

from .conftest import TEST_MESSAGES, Blob, Note

TOPIC = "test/notes"


async def join_all(nodes: list[Node], topic: str) -> None:
    """Subscribe everyone and wait until every pair knows the other is subscribed."""
    for node in nodes:
        await node.subscribe(topic)
    for node in nodes:
        await subscribed(node.pubsub, [other.peer_id for other in nodes if other is not node], topic)


def collect(node: Node, into: list) -> None:
    node.on(Note, lambda signed, topic: into.append((signed.sender, signed.msg, topic)))


async def test_typed_messages_reach_every_peer_with_a_verified_sender(tmp_path):
    async with local_mesh(4, tmp_path, messages=TEST_MESSAGES) as nodes:
        inboxes = [[] for _ in nodes]
        for node, inbox in zip(nodes, inboxes):
            collect(node, inbox)
        await join_all(nodes, TOPIC)
        await nodes[0].publish(TOPIC, Note(text="hello", n=1))
        with trio.fail_after(10):
            while not all(inboxes[1:]):
                await trio.sleep(0.01)
        for inbox in inboxes[1:]:
            assert inbox == [(nodes[0].peer_id, Note(text="hello", n=1), TOPIC)]
        assert inboxes[0] == [], "a node does not dispatch its own messages back to itself"
        # Status lists every other peer with its capabilities and a fresh heartbeat.
        status = nodes[1].status()
        assert {p["peer_id"] for p in status.peers} == {n.peer_id.to_base58() for n in nodes if n is not nodes[1]}
        assert all(p["caps"]["cpu_count"] >= 1 and p["last_heartbeat_age_s"] < 5 for p in status.peers)
        assert MESH_TOPIC in status.topics and TOPIC in status.topics
        assert all(a.endswith("/p2p/" + status.peer_id) for a in status.addrs)


async def test_a_burst_of_our_messages_arrives_whole(tmp_path):
    async with local_mesh(3, tmp_path, messages=TEST_MESSAGES) as nodes:
        inbox: list = []
        collect(nodes[2], inbox)
        await join_all(nodes, TOPIC)
        for i in range(400):
            await nodes[0].publish(TOPIC, Note(text="burst", n=i))
        with trio.fail_after(20):
            while len(inbox) < 400:
                await trio.sleep(0.02)
        assert [m.n for _, m, _ in inbox] == list(range(400))


async def test_our_oversized_message_is_refused_loudly(tmp_path):
    async with local_mesh(2, tmp_path, messages=TEST_MESSAGES) as nodes:
        with pytest.raises(MessageTooLarge, match="cap"):
            await nodes[0].publish(TOPIC, Blob(data="x" * (MAX_MESSAGE_BYTES + 1)))


def forged_frame(payload_env: bytes, key, version: int = WIRE_VERSION) -> bytes:
    head = struct.pack(">4sBI", codec.MAGIC, version, len(payload_env))
    return head + payload_env + key.private_key.sign(codec._DOMAIN + head + payload_env)


async def test_bad_messages_through_a_real_mesh_are_dropped_and_counted(tmp_path):
    async with local_mesh(3, tmp_path, messages=TEST_MESSAGES) as nodes:
        attacker, victims = nodes[0], nodes[1:]
        inboxes = [[] for _ in victims]
        for node, inbox in zip(victims, inboxes):
            collect(node, inbox)
        await join_all(nodes, TOPIC)
        before = [dict(v.router.dropped) for v in victims]

        stranger = create_new_key_pair()
        valid_once = encode(Note(text="first", n=1), attacker.key_pair, seq=10**15)

        def env(**kw) -> bytes:
            base = {"type": "test.note", "sender": attacker.peer_id.to_base58(), "seq": 5, "ts": time.time(),
                    "body": {"text": "x"}}
            base.update(kw)
            return json.dumps(base, sort_keys=True, separators=(",", ":")).encode()  # as every encoder writes it

        bad = {
            "malformed": b"definitely not a p2ptrain message",
            # Properly signed by a stranger: gossipsub says the attacker sent it, the wire says the stranger.
            "sender-mismatch": encode(Note(text="forged"), stranger, seq=1),
            # Claims the attacker's ID, but signed with the stranger's key.
            "bad-signature": forged_frame(env(), stranger),
            "unknown-version": forged_frame(env(), attacker.key_pair, version=WIRE_VERSION + 7),
            "unknown-type": forged_frame(env(type="rm -rf"), attacker.key_pair),
            "schema": forged_frame(env(body={"text": 42}), attacker.key_pair),
        }
        for data in bad.values():
            await attacker.pubsub.publish(TOPIC, data)  # raw pubsub: our own publish path would refuse
        # Over our wire cap, under pubsub's 1 MiB: dropped as read, below the router.
        await attacker.pubsub.publish(TOPIC, b"\x00" * (MAX_MESSAGE_BYTES + 1000))
        await attacker.pubsub.publish(TOPIC, valid_once)
        await attacker.pubsub.publish(TOPIC, valid_once)  # a replay: new gossipsub seqno, same wire seq
        await attacker.publish(TOPIC, Note(text="after", n=2))  # the mesh still works afterwards

        expected = {reason: 1 for reason in bad} | {"replayed": 1}
        with trio.fail_after(15):
            while not all(len(i) >= 2 for i in inboxes):
                await trio.sleep(0.02)
            while True:
                deltas = [
                    {k: v.router.dropped[k] - b.get(k, 0) for k in v.router.dropped if v.router.dropped[k] != b.get(k, 0)}
                    for v, b in zip(victims, before)
                ]
                if all(d == expected for d in deltas):
                    break
                await trio.sleep(0.02)
        for inbox in inboxes:
            assert [m.text for _, m, _ in inbox] == ["first", "after"], "nothing bad was accepted"
        for v in victims:
            assert v.status().messages["dropped"]["replayed"] >= 1
            assert v.status().messages["dropped_below_router"]["oversized"] >= 1


async def test_goodbye_marks_a_peer_gone_at_once_and_joins_are_events(tmp_path):
    async with local_mesh(3, tmp_path, silence_heartbeats=30) as nodes:
        watcher, leaver = nodes[0], nodes[2]
        async with watcher.membership.events() as events:
            leaver.stop()
            with trio.fail_after(10):  # far less than the 30 s silence limit: it was the Goodbye
                event = await events.receive()
        assert event.kind == "leave" and event.peer_id == leaver.peer_id
        assert "goodbye" in event.reason
        assert [r.peer_id for r in watcher.membership.alive()] == [nodes[1].peer_id]
        assert watcher.status().gone[0]["peer_id"] == leaver.peer_id.to_base58()


async def test_a_node_that_knows_one_peer_finds_the_rest(tmp_path):
    """A chain of bootstraps (c -> b -> a) becomes a full mesh of direct connections."""
    async with trio.open_nursery() as nursery:
        a = Node(tmp_path / "a")
        await nursery.start(a.run)
        b = Node(tmp_path / "b", NodeConfig(bootstrap=a.addrs))
        await nursery.start(b.run)
        c = Node(tmp_path / "c", NodeConfig(bootstrap=b.addrs))
        await nursery.start(c.run)
        with trio.fail_after(15):
            while a.peer_id not in c.host.get_connected_peers() or c.peer_id not in a.host.get_connected_peers():
                await trio.sleep(0.05)
            await c.membership.wait_until(lambda m: len(m.alive()) == 2)
        for node in (a, b, c):
            node.stop()


async def test_a_bootstrap_peer_never_reached_is_named_at_warning(tmp_path, caplog):
    """A --bootstrap address whose peer ID is not the listener's (a typo, another node on that
    port): the dial fails its Noise handshake, and the node says so instead of staying alone in
    silence; the redials go on (the peer may come up later)."""
    import logging

    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2ptrain.base import peer_id_of

    caplog.set_level(logging.WARNING, logger="p2ptrain.mesh._discovery")
    async with trio.open_nursery() as nursery:
        a = Node(tmp_path / "a")
        await nursery.start(a.run)
        stranger = peer_id_of(create_new_key_pair(b"\x07" * 32)).to_base58()
        wrong = a.addrs[0].rsplit("/p2p/", 1)[0] + f"/p2p/{stranger}"
        b = Node(tmp_path / "b", NodeConfig(bootstrap=[wrong]))
        await nursery.start(b.run)
        with trio.fail_after(15):
            while not any("not reached" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.05)
        line = next(r.getMessage() for r in caplog.records if "not reached" in r.getMessage())
        assert f"bootstrap peer {stranger[-8:]} not reached at {wrong.rsplit('/p2p/', 1)[0]}" in line, line
        for node in (a, b):
            node.stop()


async def test_the_dht_learns_peers_from_connections_and_lookups_reveal_them(tmp_path):
    """Kad-DHT peer routing: c knows only b, and a lookup through b finds a."""
    async with trio.open_nursery() as nursery:
        a = Node(tmp_path / "a")
        await nursery.start(a.run)
        b = Node(tmp_path / "b", NodeConfig(bootstrap=a.addrs))
        await nursery.start(b.run)
        with trio.fail_after(10):
            await b.membership.wait_until(lambda m: len(m.alive()) == 1)
        c = Node(tmp_path / "c", NodeConfig(bootstrap=b.addrs))
        await nursery.start(c.run)
        with trio.fail_after(15):
            while b.discovery.dht.routing_table.size() < 2:
                await trio.sleep(0.05)
            found = await c.discovery.dht.peer_routing.find_closest_peers_network(c.peer_id.to_bytes())
        assert a.peer_id in found
        assert c.host.get_peerstore().addrs(a.peer_id), "the lookup also brought a's addresses"
        for node in (a, b, c):
            node.stop()


async def test_discovery_parses_no_address_of_a_peer_it_is_connected_to(tmp_path, monkeypatch):
    """Each kept peer is checked twice a second; while it is connected nothing is dialed, so its
    heartbeat's addresses are not parsed again (that parsing was a quarter of an idle node's CPU).
    A heartbeat's join event parses them once (Discovery._follow), whenever it is handled: not counted."""
    import sys

    from p2ptrain.mesh import _discovery

    parsed = []
    real = _discovery.dialable

    def counting(addrs, peer):
        caller = sys._getframe(1).f_code.co_name
        if caller != "_follow":
            parsed.append((peer, caller))
        return real(addrs, peer)

    monkeypatch.setattr(_discovery, "dialable", counting)
    async with local_mesh(2, tmp_path) as (a, b):
        with trio.fail_after(10):
            while not (a.discovery.connected(b.peer_id) and b.discovery.connected(a.peer_id)):
                await trio.sleep(0.05)
        parsed.clear()
        await trio.sleep(4 * _discovery.CONNECTED_POLL_S)
        assert a.discovery.connected(b.peer_id) and b.discovery.connected(a.peer_id)
    assert parsed == []
