"""GossipSub configured for training traffic, and a clean way to run it.

py-libp2p's defaults suit a slow public network, not a training cluster; each setting here answers
a silent drop measured in ../shared/FIELD-NOTES.md:

- heartbeat 120 s -> ~1 s, so the mesh forms and heals within a couple of seconds;
- adaptive gossip off: on low "network health" it raises the heartbeat to 30-60 s;
- spam limit 10 msg/s per peer per topic -> ``MAX_MESSAGES_PER_TOPIC_PER_S`` (a coordinator's burst
  of round messages is not spam; every message is still signed and checked by p2ptrain.wire);
- subscription queue 32 -> ``SUBSCRIPTION_QUEUE`` (a burst of 100 delivered 32), and our router
  drains it in a task of its own;
- per-peer outbound queue 32 -> ``OUTBOUND_QUEUE`` (a burst of 300 publishes kept 32 per peer),
  and :func:`publish_bytes` waits while a peer's queue is half full;
- pubsub ignores connections made before it started, so :func:`running_pubsub` registers those
  peers explicitly once the service is up, and inbound pubsub streams wait for the service to run;
- messages over our wire cap are refused loudly by :func:`publish_bytes` instead of vanishing
  (pubsub's own cap, ~1 MiB, drops silently).

Two more cut its CPU, which training peers share with their local steps (an idle node went from
24 to 12 ms of CPU a second in a cluster of four):

- gossipsub v1.1, not v1.2: py-libp2p's v1.2 answers *every* received message with an IDONTWANT
  to each mesh peer (the spec means it for large messages; ours are capped small), and each of
  those is one more RPC to send, parse and check;
- no signed peer record on each RPC (:meth:`TrainingPubsub.write_msg`): py-libp2p attaches one to
  every RPC and the receiver verifies its Ed25519 signature every time. The record still goes out
  once per connection (pubsub's hello) and with identify.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from libp2p.abc import IHost, INetStream, ISubscriptionAPI
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.peer.id import ID
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.subscription import TrioSubscriptionAPI
from libp2p.tools.anyio_service.exceptions import LifecycleError

from p2ptrain.net.service import running_service

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
SUBSCRIPTION_QUEUE = 4096
OUTBOUND_QUEUE = 4096
# Our publisher waits (up to BACKPRESSURE_MAX_WAIT_S) while a peer's queue is this full.
BACKPRESSURE_AT = OUTBOUND_QUEUE // 2
BACKPRESSURE_MAX_WAIT_S = 2.0
MAX_MESSAGES_PER_TOPIC_PER_S = 1000.0
# Mesh degree: every training peer wants every control message quickly, and clusters are small.
DEGREE, DEGREE_LOW, DEGREE_HIGH = 6, 4, 12


class MessageTooLarge(ValueError):
    """Our own message is over the wire cap; pubsub would have dropped it without a word."""


class _DeepQueues(dict[ID, RpcQueue]):
    """Per-peer outbound queues that hold ``OUTBOUND_QUEUE`` RPCs instead of 32.

    Pubsub makes each queue inside its peer setup with a fixed 32-slot limit and drops what does
    not fit (a burst of 100 publishes lost 68); resizing the queue as it is stored is the one
    place to change that without copying the setup code.
    """

    def __setitem__(self, peer_id: ID, queue: RpcQueue) -> None:
        queue._queue.max_size = OUTBOUND_QUEUE
        super().__setitem__(peer_id, queue)


class TrainingPubsub(Pubsub):
    """Pubsub whose subscriptions hold a burst of ``SUBSCRIPTION_QUEUE`` messages, not 32, and
    which holds inbound streams until it runs.

    Pubsub registers its stream handler when it is built but can only read once its service
    runs; a peer quick enough to open a pubsub stream in between used to crash the handler
    (``'Pubsub' object has no attribute '_manager'``) and lose that peer for good.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.service_started = trio.Event()
        self.peer_queues = _DeepQueues()

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        # Without the sender's signed peer record: pubsub attaches it to every RPC and the receiver
        # verifies its Ed25519 signature each time, for addresses it already has (the record
        # went out with pubsub's hello and with identify; membership heartbeats carry them too).
        rpc_msg.ClearField("senderRecord")
        return await super().write_msg(stream, rpc_msg)

    def queue_backlog(self) -> int:
        """The longest outbound queue to any peer, in RPCs."""
        return max((len(q) for q in self.peer_queues.values()), default=0)

    async def stream_handler(self, stream: INetStream) -> None:
        await self.service_started.wait()
        if not self.manager.is_running:
            await stream.reset()
            return
        try:
            await super().stream_handler(stream)
        except (LifecycleError, RuntimeError) as exc:
            # Pubsub hands each message to a task of its service; while the service stops, that
            # raises ("Nursery is closed to new arrivals") inside the *swarm's* connection task and
            # would take the host down with it. A message arriving during shutdown is just dropped.
            if self.manager.is_running and not isinstance(exc, LifecycleError) and "closed to new arrivals" not in str(exc):
                raise
            logger.debug("pubsub stream from %s ended during shutdown: %s", stream.muxed_conn.peer_id, exc)
            with trio.move_on_after(1):
                await stream.reset()

    async def subscribe(self, topic_id: str) -> ISubscriptionAPI:
        if topic_id in self.topic_ids:
            return self.subscribed_topics_receive[topic_id]
        send, receive = trio.open_memory_channel[rpc_pb2.Message](SUBSCRIPTION_QUEUE)
        subscription = TrioSubscriptionAPI(
            receive, unsubscribe_fn=functools.partial(self.unsubscribe, topic_id)
        )
        self.subscribed_topics_send[topic_id] = send
        self.subscribed_topics_receive[topic_id] = subscription
        packet, subopt = self._build_announce_rpc(topic_id, subscribe=True)
        await self.message_all_peers(packet.SerializeToString(), announce=subopt)
        await self.router.join(topic_id)
        return subscription


def make_pubsub(host: IHost, heartbeat_interval: float = HEARTBEAT_INTERVAL_S) -> TrainingPubsub:
    """Pubsub + GossipSub for ``host``; build it before the host dials anyone, run it with
    :func:`running_pubsub`. Strict signing stays on (gossipsub verifies the origin of every
    message; ``ID(msg.from_id)`` is that verified origin)."""
    router = GossipSub(
        protocols=[PROTOCOL_ID_V11],
        degree=DEGREE,
        degree_low=DEGREE_LOW,
        degree_high=DEGREE_HIGH,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=heartbeat_interval,  # type: ignore[arg-type]  # trio.sleep takes floats
        adaptive_gossip_enabled=False,
        max_messages_per_topic_per_second=MAX_MESSAGES_PER_TOPIC_PER_S,
    )
    return TrainingPubsub(host, router, strict_signing=True)


@asynccontextmanager
async def running_pubsub(pubsub: Pubsub) -> AsyncIterator[Pubsub]:
    """Run pubsub and its router; on entry, register peers connected before pubsub started."""
    async with running_service(pubsub, "pubsub"):
        async with running_service(pubsub.router, "gossipsub"):
            await pubsub.wait_until_ready()
            if isinstance(pubsub, TrainingPubsub):
                pubsub.service_started.set()
            async with trio.open_nursery() as nursery:
                for peer_id in pubsub.host.get_connected_peers():
                    nursery.start_soon(pubsub.ensure_peer_stream, peer_id, 5.0)
            yield pubsub


async def close_host(host: IHost) -> None:
    """Stop accepting connections, then close every connection.

    ``host.close()`` closes connections first and listeners after; a peer redialing in between
    gets a fresh connection whose pubsub messages then land on a stopping pubsub. Closing the
    listeners first removes that window.

    Each listener leaves the network's table before it is closed: while a TCP listener closes,
    ``host.get_addrs()`` (which identify calls for a stream arriving meanwhile) would read its
    closing socket and fail with EBADF inside libp2p's nursery, failing the node's shutdown.
    """
    network = host.get_network()
    listeners = getattr(network, "listeners", {})
    for key, listener in list(listeners.items()):
        listeners.pop(key, None)
        await listener.close()
    await host.close()


async def publish_bytes(pubsub: Pubsub, topic: str, data: bytes, limit: int) -> None:
    """Publish ``data`` on ``topic``, refusing (loudly) anything over ``limit`` bytes (the mesh
    passes the wire cap, p2ptrain.wire.limits.MAX_MESSAGE_BYTES)."""
    if len(data) > limit:
        raise MessageTooLarge(
            f"message of {len(data)} B for topic {topic!r} is over the {limit} B cap: "
            "send bulk data on a stream or by CID"
        )
    if isinstance(pubsub, TrainingPubsub) and pubsub.queue_backlog() >= BACKPRESSURE_AT:
        # Slow down rather than overflow a peer's queue; a peer that stopped reading entirely
        # must not stall us forever, so the wait is bounded.
        with trio.move_on_after(BACKPRESSURE_MAX_WAIT_S):
            while pubsub.queue_backlog() >= BACKPRESSURE_AT:
                await trio.sleep(0.005)
    await pubsub.publish(topic, data)
