"""Hostile input against real nodes: a poisoned signed message, broken pubsub frames, and
exceptions injected into the router's decode path and into a handler. The node must keep serving
and count what it dropped."""

from __future__ import annotations

import json
import struct
import time

import pytest
import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.utils.varint import encode_uvarint

from p2ptrain.mesh import _router as router_module
from p2ptrain.wire import MESH_TOPIC, _codec as codec
from p2ptrain.node import Node, NodeConfig
from p2ptrain.testing import local_mesh, node_processes, subscribed, wait_for
from p2ptrain.wire._limits import WIRE_VERSION

from .conftest import TEST_MESSAGES, Note

TOPIC = "test/hostile"


def signed_envelope(node: Node, **overrides) -> bytes:
    """A wire frame correctly signed by ``node`` around an arbitrary envelope."""
    env = {"type": "goodbye", "sender": node.peer_id.to_base58(), "seq": time.time_ns() // 1000,
           "ts": time.time(), "body": {"reason": "x"}}
    env.update(overrides)
    payload = json.dumps(env).encode()
    head = struct.pack(">4sBI", codec.MAGIC, WIRE_VERSION, len(payload))
    return head + payload + node.key_pair.private_key.sign(codec._DOMAIN + head + payload)


@pytest.mark.timeout(600)  # three node processes, each importing libp2p and torch on a shared box
async def test_a_signed_timestamp_of_10_pow_400_stops_no_node_of_a_three_process_mesh(tmp_path):
    """Issue 13, found 1: this one message made all three nodes exit with code 1."""
    with node_processes(3, tmp_path / "procs") as procs:
        attacker = Node(tmp_path / "attacker", NodeConfig(bootstrap=[procs[0].addr]))
        async with trio.open_nursery() as nursery:
            await nursery.start(attacker.run)
            victims = [ID.from_base58(p.peer_id) for p in procs]
            await subscribed(attacker.pubsub, victims[:1], MESH_TOPIC, mesh=True)
            poison = signed_envelope(attacker, ts=10**400)
            await attacker.pubsub.publish(MESH_TOPIC, poison)  # raw: our own publish path is not the attack

            def all_counted() -> bool:
                return all(p.status()["messages"]["dropped"].get("malformed", 0) >= 1 for p in procs)

            # Gossipsub relays before we decode: node0 forwards the poison to the other two.
            await trio.to_thread.run_sync(lambda: wait_for(all_counted, timeout=30))
            for p in procs:
                assert p.proc.poll() is None, f"{p.home.name} exited:\n{p.read_log()}"
                status = await trio.to_thread.run_sync(p.status)
                assert status["peer_id"] == p.peer_id
            attacker.stop()


async def raw_pubsub_stream(attacker: Node, victim: Node):
    await attacker.discovery.dial(victim.peer_id, [victim.host.get_addrs()[0]])
    return await attacker.host.new_stream(victim.peer_id, [PROTOCOL_ID_V11])


@pytest.mark.parametrize(
    "reason, frame",
    [
        ("rpc-malformed", encode_uvarint(64) + b"\xff" * 64),  # not a protobuf RPC
        ("rpc-oversized", encode_uvarint(2 << 20) + b"\x00" * 1024),  # claims 2 MiB, over pubsub's 1 MiB
    ],
)
async def test_broken_pubsub_frames_are_counted_below_the_router_and_the_node_keeps_serving(tmp_path, reason, frame):
    async with local_mesh(2, tmp_path, messages=TEST_MESSAGES) as (victim, attacker):
        stream = await raw_pubsub_stream(attacker, victim)
        with trio.fail_after(10):
            await stream.write(frame)
            while victim.status().messages["dropped_below_router"].get(reason, 0) < 1:
                await trio.sleep(0.02)
        # The victim still runs and still delivers: a fresh, honest message gets through.
        inbox: list = []
        victim.on(Note, lambda signed, topic: inbox.append(signed.msg))
        await victim.subscribe(TOPIC)
        await attacker.subscribe(TOPIC)
        await subscribed(attacker.pubsub, [victim.peer_id], TOPIC, mesh=True)
        with trio.fail_after(15):
            while not inbox:  # until the attacker's new mesh for the topic includes the victim
                await attacker.publish(TOPIC, Note(text="still here"))
                await trio.sleep(0.2)
        assert not victim.stopped.is_set()


async def test_exceptions_in_decode_and_in_a_handler_are_counted_rejections_not_exits(tmp_path, monkeypatch):
    """One boundary per input: the router catches what its own checks or a handler raise."""
    async with local_mesh(2, tmp_path, messages=TEST_MESSAGES) as (victim, sender):
        await victim.subscribe(TOPIC)
        await sender.subscribe(TOPIC)
        await subscribed(sender.pubsub, [victim.peer_id], TOPIC, mesh=True)
        inbox: list = []

        def handler(signed, topic):
            if signed.msg.text == "boom":
                raise KeyError("a handler's bug")
            inbox.append(signed.msg.text)

        victim.on(Note, handler)
        real_decode = router_module.decode

        def decode_with_a_bug(data: bytes, types):
            signed = real_decode(data, types=types)
            if getattr(signed.msg, "text", None) == "poison":
                raise OverflowError("a decoder's bug")  # the class of found 1
            return signed

        monkeypatch.setattr(router_module, "decode", decode_with_a_bug)
        for text in ("poison", "boom", "after"):
            await sender.publish(TOPIC, Note(text=text))
        with trio.fail_after(15):
            while inbox != ["after"]:
                await trio.sleep(0.02)
        dropped = victim.status().messages["dropped"]
        assert dropped["decoder-error"] == 1 and dropped["handler-error"] == 1
        assert not victim.stopped.is_set()


async def test_a_peer_flooding_faster_than_its_inbound_rate_is_cut_off_before_any_check(tmp_path, monkeypatch):
    """Gossipsub's own rate limit only gates forwarding; each message still costs the receiver its
    checks. 6,000 messages written at once against a bucket of 100/s (burst 200), so the test does
    not depend on how fast this machine checks messages: the burst and what the rate refills get
    through, the rest is cut off as it is read."""
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX

    from p2ptrain.net import _inbound_limits as pubsub_module

    monkeypatch.setattr(pubsub_module, "MAX_INBOUND_MESSAGES_PER_PEER_PER_S", 100.0, raising=False)
    monkeypatch.setattr(pubsub_module, "INBOUND_BURST", 200, raising=False)
    async with local_mesh(2, tmp_path) as (victim, attacker):
        stream = await raw_pubsub_stream(attacker, victim)
        key, origin = attacker.key_pair, attacker.peer_id.to_bytes()
        frames = []
        for batch in range(60):
            msgs = []
            for i in range(100):
                msg = rpc_pb2.Message(data=b"junk", topicIDs=[MESH_TOPIC], from_id=origin,
                                      seqno=(batch * 100 + i).to_bytes(8, "big"))
                msg.signature = key.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
                msgs.append(msg)
            rpc = rpc_pb2.RPC(publish=msgs).SerializeToString()
            frames.append(encode_uvarint(len(rpc)) + rpc)
        before = victim.router.dropped["malformed"]
        with trio.fail_after(30):
            await stream.write(b"".join(frames))
            while True:
                counted = victim.router.dropped["malformed"] - before
                limited = victim.pubsub.dropped["rate-limited"]
                if counted + limited + victim.pubsub.dropped["queue-full"] >= 6000:
                    break
                await trio.sleep(0.05)
        assert limited >= 3000, "the flood was cut off as it was read"
        assert counted >= 200, "the burst got through to be checked (and dropped) by the router"
        assert victim.status().messages["dropped_below_router"]["rate-limited"] == limited
