"""Throwaway identities (issue 13, found 7): heartbeats from thousands of fresh keys must not grow
a node's view, its dialing or its `node status` without bound.

The attacker is a real node that injects pubsub messages signed by fresh keys (as any peer can:
pubsub checks each message's signature against its claimed origin, and a fresh key signs validly),
so the victim receives exactly what a swarm of one-shot peers would send.
"""

from __future__ import annotations

import json
import logging
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX

from p2ptrain.base import peer_id_of
from p2ptrain.mesh import _discovery as discovery_module, _membership as membership_module
from p2ptrain.wire import Capabilities, Goodbye, Heartbeat, MESH_TOPIC, encode
from p2ptrain.node._node import STATUS_MAX_PEERS
from p2ptrain.node import Node
from p2ptrain.testing import free_port, local_mesh

CAPS = Capabilities(device="cpu", cpu_count=1, free_ram_bytes=1, version="0")


def closed_port_addrs(n: int) -> tuple[str, ...]:
    """Loopback addresses nobody listens on: each dial is refused at once."""
    return tuple(f"/ip4/127.0.0.1/tcp/{free_port()}" for _ in range(n))


async def inject(attacker: Node, key: KeyPair, message: object, seq: int) -> ID:
    """``message`` signed by ``key`` with sequence number ``seq``, pushed into ``attacker``'s pubsub
    (validated, then relayed to the mesh) as a peer of that key would publish it."""
    data = encode(message, key, seq=seq)
    msg = rpc_pb2.Message(data=data, topicIDs=[MESH_TOPIC], from_id=peer_id_of(key).to_bytes(),
                          seqno=seq.to_bytes(8, "big"))
    msg.signature = key.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    msg.key = key.public_key.serialize()
    await attacker.pubsub.push_msg(attacker.peer_id, msg)
    return peer_id_of(key)


async def heartbeat_from_a_fresh_identity(attacker: Node, addrs: tuple[str, ...] = ()) -> ID:
    return await inject(attacker, create_new_key_pair(), Heartbeat(addrs=addrs, caps=CAPS), time.time_ns() // 1000)


def hearing(node: Node) -> set:
    """The senders of every valid heartbeat ``node`` receives from now on."""
    heard: set = set()
    node.on(Heartbeat, lambda signed, topic: heard.add(signed.sender))
    return heard


async def test_the_view_is_capped_gone_peers_expire_and_status_stays_bounded(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=membership_module.__name__)
    async with local_mesh(3, tmp_path) as (victim, honest, attacker):
        victim.membership.max_records = 100
        # Nothing is forgotten while the 150 arrive: on a loaded machine sending them takes longer
        # than silence + a short gone_ttl, and the view would shrink below the status cap it pins.
        victim.membership.gone_ttl = 3600.0
        heard = hearing(victim)
        fresh = {await heartbeat_from_a_fresh_identity(attacker) for _ in range(150)}
        with trio.fail_after(20):
            while not fresh <= heard:
                await trio.sleep(0.05)
        assert len(victim.membership.all()) <= 100
        # Honest peers heartbeat every second, so they are never the ones evicted.
        assert {r.peer_id for r in victim.membership.alive()} >= {honest.peer_id, attacker.peer_id}
        status = victim.status()
        assert len(status.peers) == STATUS_MAX_PEERS and status.peers_total <= 100
        # At least 50 of the 150 were pushed out of the view by newcomers.
        assert status.membership["evicted"] >= 50
        assert len(json.dumps(status.to_json())) < 150_000
        # The fresh identities fall silent: marked gone, then forgotten after gone_ttl.
        victim.membership.gone_ttl = 1.0
        with trio.fail_after(30):
            while len(victim.membership.all()) > 2:
                await trio.sleep(0.1)
        assert victim.membership.expired >= 98
        assert {r.peer_id for r in victim.membership.alive()} == {honest.peer_id, attacker.peer_id}
    # The log stays bounded too: joins beyond LOG_PEERS_AT_INFO peers in view go to DEBUG (all
    # three nodes log here; each logged at most that many joins at INFO, not 150).
    joins = [r for r in caplog.records if r.levelno == logging.INFO and "joined (" in r.getMessage()]
    assert len(joins) <= 3 * (membership_module.LOG_PEERS_AT_INFO + 2)


async def test_discovery_dials_few_addresses_of_a_peer_and_keeps_a_bounded_number_of_peers(tmp_path, monkeypatch):
    monkeypatch.setattr(discovery_module, "MAX_KEPT_PEERS", 12, raising=False)
    # Fresh identities stay alive (so followed) for the whole test, however loaded the machine.
    async with local_mesh(2, tmp_path, silence_heartbeats=60) as (victim, attacker):
        heard = hearing(victim)
        fresh = {await heartbeat_from_a_fresh_identity(attacker, closed_port_addrs(16)) for _ in range(40)}
        store = victim.host.get_peerstore()

        def dialed() -> list:
            fresh = [r.peer_id for r in victim.membership.alive() if r.peer_id != attacker.peer_id]
            return [store.addrs(p) for p in fresh if p in store.peer_ids() and store.addrs(p)]

        with trio.fail_after(20):
            while not fresh <= heard or len(dialed()) < 8:
                await trio.sleep(0.05)
        assert all(len(a) <= 4 for a in dialed()), "at most MAX_DIAL_ADDRS_PER_PEER of 16 addresses"
        with trio.fail_after(10):  # a peer with a larger ID than ours is followed a second later
            while victim.status().discovery["not_kept"] < 40 - 12:
                await trio.sleep(0.05)
        assert len(victim.discovery._keeping) <= 12


async def test_a_heartbeat_sent_before_a_goodbye_and_heard_after_it_does_not_bring_the_peer_back(tmp_path):
    """Gossip may bring a peer's last heartbeat after its Goodbye, by another route: older than the
    Goodbye (its sequence number), it no longer makes the peer alive again (a suite run saw a stopped
    node back in the view a moment after its goodbye). A heartbeat sent after the Goodbye does."""
    async with local_mesh(2, tmp_path) as (victim, relay):
        key, seq = create_new_key_pair(), time.time_ns() // 1000
        heard = hearing(victim)

        async def until(condition) -> None:
            with trio.fail_after(20):
                while not condition():
                    await trio.sleep(0.02)

        def alive() -> set:
            return {r.peer_id for r in victim.membership.alive()}

        peer = await inject(relay, key, Heartbeat(addrs=(), caps=CAPS), seq)
        await until(lambda: peer in alive())
        await inject(relay, key, Goodbye(reason="stopping"), seq + 2)
        await until(lambda: peer not in alive())
        heard.clear()
        await inject(relay, key, Heartbeat(addrs=(), caps=CAPS), seq + 1)  # sent before the Goodbye
        await until(lambda: peer in heard)
        assert peer not in alive()
        await inject(relay, key, Heartbeat(addrs=(), caps=CAPS), seq + 3)  # after it: back
        await until(lambda: peer in alive())
