"""GossipSub configured for training traffic, and a clean way to run it.

py-libp2p's defaults suit a slow public network, not a training cluster; each setting here answers
a silent drop measured in ../shared/FIELD-NOTES.md:

- heartbeat 120 s -> ~1 s, so the mesh forms and heals within a couple of seconds;
- adaptive gossip off: on low "network health" it raises the heartbeat to 30-60 s;
- spam limit 10 msg/s per peer per topic -> ``MAX_MESSAGES_PER_TOPIC_PER_S`` (a coordinator's burst
  of round messages is not spam; every message is still signed and checked by p2ptrain.wire);
- subscription queue 32 -> ``SUBSCRIPTION_QUEUE`` (a burst of 100 delivered 32), and our router
  drains it in a task of its own;
- pubsub ignores connections made before it started, so :func:`running_pubsub` registers those
  peers explicitly once the service is up;
- messages over our wire cap are refused loudly by :func:`publish_bytes` instead of vanishing
  (pubsub's own cap, ~1 MiB, drops silently).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.abc import IHost, ISubscriptionAPI
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.subscription import TrioSubscriptionAPI

from p2ptrain.net.service import running_service

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
SUBSCRIPTION_QUEUE = 4096
MAX_MESSAGES_PER_TOPIC_PER_S = 1000.0
# Mesh degree: every training peer wants every control message quickly, and clusters are small.
DEGREE, DEGREE_LOW, DEGREE_HIGH = 6, 4, 12


class MessageTooLarge(ValueError):
    """Our own message is over the wire cap; pubsub would have dropped it without a word."""


class TrainingPubsub(Pubsub):
    """Pubsub whose subscriptions hold a burst of ``SUBSCRIPTION_QUEUE`` messages, not 32."""

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
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11],
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
            async with trio.open_nursery() as nursery:
                for peer_id in pubsub.host.get_connected_peers():
                    nursery.start_soon(pubsub.ensure_peer_stream, peer_id, 5.0)
            yield pubsub


async def publish_bytes(pubsub: Pubsub, topic: str, data: bytes, limit: int) -> None:
    """Publish ``data`` on ``topic``, refusing (loudly) anything over ``limit`` bytes (the mesh
    passes the wire cap, p2ptrain.wire.limits.MAX_MESSAGE_BYTES)."""
    if len(data) > limit:
        raise MessageTooLarge(
            f"message of {len(data)} B for topic {topic!r} is over the {limit} B cap: "
            "send bulk data on a stream or by CID"
        )
    await pubsub.publish(topic, data)
