"""GossipSub as we configure it: old connections are used, bursts are not dropped, big messages are refused."""

from __future__ import annotations

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from multiaddr import Multiaddr

from p2ptrain.net import PubsubMessageTooLarge as MessageTooLarge, make_host, make_pubsub, publish_bytes, running_pubsub
from p2ptrain.net._pubsub import SUBSCRIPTION_QUEUE
from p2ptrain.testing import connect, connected_hosts, subscribed

LOOPBACK = Multiaddr("/ip4/127.0.0.1/tcp/0")


async def test_connections_made_before_pubsub_started_carry_messages_and_bursts_arrive_whole():
    a = make_host(create_new_key_pair(), [LOOPBACK])
    b = make_host(create_new_key_pair(), [LOOPBACK])
    async with a.run(listen_addrs=[LOOPBACK]), b.run(listen_addrs=[LOOPBACK]):
        await connect(a, b, timeout=10)
        # Pubsub is built and started only now, after the connection exists.
        pa, pb = make_pubsub(a), make_pubsub(b)
        async with running_pubsub(pa), running_pubsub(pb):
            sub = await pb.subscribe("t")
            await pa.subscribe("t")
            await subscribed(pa, [b.get_id()], "t", mesh=True)
            await subscribed(pb, [a.get_id()], "t")
            # Count the signed peer records b verifies from here on (py-libp2p attaches one to every RPC).
            store = b.get_peerstore()
            verified = []
            consume = store.consume_peer_record
            store.consume_peer_record = lambda envelope, ttl: verified.append(1) or consume(envelope, ttl)
            # ... and the records a builds for them (its addresses parsed and compared each time).
            built = []
            get_addrs = a.get_addrs
            a.get_addrs = lambda: built.append(1) or get_addrs()  # type: ignore[method-assign]
            burst = 300  # py-libp2p's defaults deliver 32 of a burst (queue) and 10 per second (spam limit)
            assert burst < SUBSCRIPTION_QUEUE
            for i in range(burst):
                await publish_bytes(pa, "t", f"m{i}".encode(), limit=1024)
            got = []
            with trio.fail_after(15):
                while len(got) < burst:
                    got.append((await sub.get()).data)
            assert got == [f"m{i}".encode() for i in range(burst)]
            with pytest.raises(MessageTooLarge, match="over the 1024 B cap"):
                await publish_bytes(pa, "t", b"x" * 1025, limit=1024)
            # The cheap protocol: gossipsub v1.1, so no IDONTWANT for each of the 300 messages, and
            # no signed peer record (an Ed25519 check per RPC) attached to the messages we send.
            assert pa.router.peer_protocol[b.get_id()] == PROTOCOL_ID_V11
            assert not pa.router.dont_send_message_ids.get(b.get_id())
            assert verified == [] and built == []
        await a.close()
        await b.close()


async def test_a_subscription_queue_holds_a_bounded_number_of_bytes_and_counts_the_rest(monkeypatch):
    """A flood of maximal messages at a reader that is behind must not pin memory without bound:
    4096 queued messages of 64 KiB would be 256 MiB."""
    from p2ptrain.net import _pubsub as pubsub_module

    monkeypatch.setattr(pubsub_module, "SUBSCRIPTION_QUEUE_BYTES", 1 << 20, raising=False)
    a = make_host(create_new_key_pair(), [LOOPBACK])
    b = make_host(create_new_key_pair(), [LOOPBACK])
    pa, pb = make_pubsub(a), make_pubsub(b)
    async with a.run(listen_addrs=[LOOPBACK]), b.run(listen_addrs=[LOOPBACK]):
        async with running_pubsub(pa), running_pubsub(pb):
            await connect(a, b, timeout=10)
            sub = await pb.subscribe("t")  # and nobody reads it until the flood is over
            await pa.subscribe("t")
            await subscribed(pa, [b.get_id()], "t", mesh=True)
            size, count = 60_000, 40  # 2.4 MB in all
            for i in range(count):
                await publish_bytes(pa, "t", i.to_bytes(4, "big") + b"\x00" * (size - 4), limit=1 << 20)
            with trio.fail_after(20):
                while sub.receive_channel.statistics().current_buffer_used + pb.dropped["queue-full"] < count:
                    await trio.sleep(0.02)
            queued = sub.receive_channel.statistics().current_buffer_used
            assert queued * size <= 1 << 20
            assert pb.dropped["queue-full"] == count - queued
            first = await sub.get()
            assert first.data[:4] == (0).to_bytes(4, "big") and len(first.data) == size


async def test_wait_for_backlog_returns_once_every_queued_rpc_is_written():
    """What the node's goodbye and the publisher's backpressure wait on: woken by pubsub's writers."""
    async with connected_hosts(2) as (a, b):
        pa, pb = make_pubsub(a.host), make_pubsub(b.host)
        async with running_pubsub(pa), running_pubsub(pb):
            sub = await pb.subscribe("t")
            await pa.subscribe("t")
            await subscribed(pa, [b.id], "t", mesh=True)
            burst = 200
            for i in range(burst):
                await publish_bytes(pa, "t", f"m{i}".encode(), limit=1024)
            with trio.fail_after(10):
                await pa.wait_for_backlog(below=1)
            assert pa.queue_backlog() == 0
            got = []
            with trio.fail_after(10):
                while len(got) < burst:
                    got.append((await sub.get()).data)
            assert got == [f"m{i}".encode() for i in range(burst)]


async def test_a_subscription_made_while_a_new_peer_is_being_registered_reaches_that_peer():
    """py-libp2p writes its hello (our topics) to a new peer and registers the peer after: a
    subscription made during that write went to every registered peer but this one, and nothing
    repeated it (a hostile-frame test's victim, subscribing just after it dropped a stream, hit it).
    The hello's write is held open here until the subscription is made."""
    async with connected_hosts(2, connected=False) as (a, b):
        pa, pb = make_pubsub(a.host), make_pubsub(b.host)
        async with running_pubsub(pa), running_pubsub(pb):
            writing, release = trio.Event(), trio.Event()
            new_stream = b.host.new_stream

            async def held_new_stream(peer_id, protocols, *args, **kwargs):
                stream = await new_stream(peer_id, protocols, *args, **kwargs)
                if PROTOCOL_ID_V11 in protocols and not writing.is_set():
                    write = stream.write

                    async def held_write(data: bytes) -> None:
                        stream.write = write
                        writing.set()
                        await release.wait()
                        await write(data)

                    stream.write = held_write
                return stream

            b.host.new_stream = held_new_stream  # type: ignore[method-assign]
            await connect(a.host, b.host)
            with trio.fail_after(10):
                await writing.wait()
            assert a.id not in pb.peers
            await pb.subscribe("t")
            release.set()
            await subscribed(pa, [b.id], "t", timeout=10)
