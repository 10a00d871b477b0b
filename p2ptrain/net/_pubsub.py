"""GossipSub configured for training traffic, and a clean way to run it.

py-libp2p's defaults suit a slow public network, not a training cluster; each setting here answers
a silent drop measured in ../shared/FIELD-NOTES.md:

- heartbeat 120 s -> ~1 s, so the mesh forms and heals within a couple of seconds;
- adaptive gossip off: on low "network health" it raises the heartbeat to 30-60 s;
- spam limit 10 msg/s per peer per topic -> ``MAX_MESSAGES_PER_TOPIC_PER_S`` (a coordinator's burst
  of round messages is not spam; every message is still signed and checked by p2ptrain.wire);
- subscription queue 32 -> ``SUBSCRIPTION_QUEUE`` (a burst of 100 delivered 32), bounded in bytes
  too (``SUBSCRIPTION_QUEUE_BYTES``), and our router drains it in a task of its own;
- per-peer outbound queue 32 -> ``OUTBOUND_QUEUE`` (a burst of 300 publishes kept 32 per peer),
  and :func:`publish_bytes` waits while a peer's queue is half full;
- pubsub ignores connections made before it started, so :func:`running_pubsub` registers those
  peers explicitly once the service is up, and inbound pubsub streams wait for the service to run;
- a subscription made while a new peer's pubsub stream is being set up reached every peer but
  that one, for good; :meth:`TrainingPubsub._handle_new_peer` announces it to the new peer too;
- messages over our wire cap are refused loudly by :func:`publish_bytes` instead of vanishing
  (pubsub's own cap, ~1 MiB, drops silently);
- what pubsub drops from the network *below* our message router is counted in
  :attr:`TrainingPubsub.dropped` (shown by `node status`): inbound RPC frames over its 1 MiB cap
  (``rpc-oversized``), frames that are not a pubsub protobuf (``rpc-malformed``; py-libp2p let
  protobuf's DecodeError escape its stream handler), invalid signed peer records, too many
  subscriptions in one RPC, messages that did not fit a subscription's queue (``queue-full``), and
  messages over the wire cap (``oversized``, dropped as read: they are never checked, queued or
  forwarded), and messages over a peer's inbound rate (``rate-limited``, see
  net/_inbound_limits.py); and messages its ``inbound_gate`` refuses (per-sender
  rates of message types, counted by the router that sets it) are neither delivered nor relayed, and
  a peer that keeps sending its own over their rate is not read for a while (``flooder-paused``).

Two more cut its CPU, which training peers share with their local steps (an idle node went from
24 to 12 ms of CPU a second in a cluster of four):

- gossipsub v1.1, not v1.2: py-libp2p's v1.2 answers *every* received message with an IDONTWANT
  to each mesh peer (the spec means it for large messages; ours are capped small), and each of
  those is one more RPC to send, parse and check;
- no signed peer record on each RPC (:meth:`TrainingPubsub.write_msg`): py-libp2p attaches one to
  every RPC and the receiver verifies its Ed25519 signature every time. The record still goes out
  once per connection (pubsub's hello) and with identify. Gossipsub also stops *building* the
  record it attached (:func:`_record_for_gossip`): the host's addresses were parsed into multiaddrs
  and compared with the cached record's for every message sent or forwarded and every control
  message (0.24 ms of CPU each, ~4% of a small in-process run), for bytes that write_msg then cleared.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
from google.protobuf.message import DecodeError as ProtobufDecodeError
from libp2p.abc import IHost, INetStream, ISubscriptionAPI
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError, IOException, MessageTooLarge as RpcTooLarge
from libp2p.network.stream.exceptions import StreamEOF, StreamError
import libp2p.pubsub.gossipsub as _gossipsub
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.peer.id import ID
from libp2p.peer.peerstore import env_to_send_in_RPC as _env_to_send_in_rpc
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import RpcQueue
from libp2p.pubsub.subscription import TrioSubscriptionAPI
from libp2p.pubsub.utils import maybe_consume_signed_record
from libp2p.utils.varint import read_varint_prefixed_bytes_limited
from libp2p.tools.anyio_service.exceptions import LifecycleError

from p2ptrain.net._inbound_limits import InboundLimits, refusal_units
from p2ptrain.net._service import running_service

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
SUBSCRIPTION_QUEUE = 4096
# ... and at most this many bytes of message data a topic: 4096 messages at our 64 KiB cap would pin
# 256 MiB; honest traffic is small control messages (a burst of 4096 heartbeats is ~2 MB).
SUBSCRIPTION_QUEUE_BYTES = 16 * 1024 * 1024
OUTBOUND_QUEUE = 4096
# Our publisher waits (up to BACKPRESSURE_MAX_WAIT_S) while a peer's queue is this full.
BACKPRESSURE_AT = OUTBOUND_QUEUE // 2
BACKPRESSURE_MAX_WAIT_S = 2.0
# Resetting the stream of a peer that sent a bad frame must not hang on that peer.
STREAM_RESET_TIMEOUT_S = 1.0
MAX_MESSAGES_PER_TOPIC_PER_S = 1000.0
# Mesh degree: every training peer wants every control message quickly, and clusters are small.
DEGREE, DEGREE_LOW, DEGREE_HIGH = 6, 4, 12


class PubsubMessageTooLarge(ValueError):
    """Our own message is over the wire cap; pubsub would have dropped it without a word."""


class _DeepQueues(dict[ID, RpcQueue]):
    """Per-peer outbound queues that hold ``OUTBOUND_QUEUE`` RPCs instead of 32.

    Pubsub makes each queue inside its peer setup with a fixed 32-slot limit and drops what does
    not fit (a burst of 100 publishes lost 68); resizing the queue as it is stored is the one
    place to change that without copying the setup code.
    """

    def __init__(self, on_removed: Callable[[], None]) -> None:
        super().__init__()
        self._on_removed = on_removed

    def __setitem__(self, peer_id: ID, queue: RpcQueue) -> None:
        queue._queue.max_size = OUTBOUND_QUEUE
        super().__setitem__(peer_id, queue)

    def pop(self, *args: Any) -> Any:
        """Pubsub drops a departed peer's queue here: what it held no longer counts as backlog."""
        try:
            return super().pop(*args)
        finally:
            self._on_removed()


class _BoundedSubscription(TrioSubscriptionAPI):
    """A subscription that knows how many bytes of message data wait in its queue."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queued_bytes = 0

    def __aiter__(self) -> AsyncIterator[rpc_pb2.Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[rpc_pb2.Message]:
        async for msg in self.receive_channel:
            self.queued_bytes -= len(msg.data)
            yield msg

    async def get(self) -> rpc_pb2.Message:
        msg = await self.receive_channel.receive()
        self.queued_bytes -= len(msg.data)
        return msg


# The hosts whose pubsub is a TrainingPubsub: their gossipsub RPCs go out without a sender record.
_RECORDLESS_HOSTS: weakref.WeakSet[IHost] = weakref.WeakSet()


def _record_for_gossip(host: IHost) -> tuple[bytes, bool]:
    """What gossipsub attaches as the sender's signed peer record: nothing for a host that runs a
    :class:`TrainingPubsub` (its write_msg clears the field before anything is sent), py-libp2p's
    own record for any other. Gossipsub alone calls this (its module's name is replaced, once):
    pubsub's hello and identify still send the record."""
    if host in _RECORDLESS_HOSTS:
        return b"", False
    return _env_to_send_in_rpc(host)


_gossipsub.env_to_send_in_RPC = _record_for_gossip  # type: ignore[attr-defined]  # gossipsub's own import of it


class TrainingPubsub(Pubsub):
    """Pubsub whose subscriptions hold a burst of ``SUBSCRIPTION_QUEUE`` messages, not 32, and
    which holds inbound streams until it runs.

    Pubsub registers its stream handler when it is built but can only read once its service
    runs; a peer quick enough to open a pubsub stream in between used to crash the handler
    (``'Pubsub' object has no attribute '_manager'``) and lose that peer for good.
    """

    def __init__(self, *args: Any, max_message_bytes: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _RECORDLESS_HOSTS.add(self.host)
        # Inbound messages over this are dropped (counted "oversized") as they are read, before
        # their signature is checked and before they can sit in a subscription queue (an 80 KB
        # frame flood grew a node by 140 MB through that queue).
        self.max_message_bytes = max_message_bytes
        self.service_started = trio.Event()
        self.peer_queues = _DeepQueues(self._backlog_changed)
        # Set (then replaced) whenever the outbound backlog shrinks: a peer's writer finished an
        # RPC, or a peer's queue was dropped. What wait_for_backlog sleeps on instead of polling.
        self._backlog_shrank = trio.Event()
        self._writes_in_flight = 0
        # What pubsub drops before our router sees it, by reason (see the module docstring).
        self.dropped: Counter[str] = Counter()
        # Each peer's message rate and a flooder's pauses (net/_inbound_limits.py), as it is read.
        self.limits = InboundLimits()
        # Asked about each new message as it is read, before pubsub checks, delivers or relays it:
        # False drops it (the layer that set it counts why). The node sets its message router's
        # per-sender rates here (mesh.router.MessageRouter.admit).
        self.inbound_gate: Callable[[rpc_pb2.Message], bool] | None = None

    async def _handle_new_peer(self, peer_id: ID) -> None:
        """Register a peer as py-libp2p does, then tell it what we subscribed to or left meanwhile.

        py-libp2p builds its hello (our topics) and only after writing it adds the peer to those a
        subscription is announced to: a subscription made during that write reached every peer but
        this one, which then never heard it (no later message repeats it). A node that joins a
        task's topic while a peer connects, or just after it dropped a peer's broken stream, hit it.
        """
        before = set(self.topic_ids)
        await super()._handle_new_peer(peer_id)
        queue = self.peer_queues.get(peer_id)
        if queue is None:  # it could not be registered: it hears our topics in the hello of a later try
            return
        for topic in sorted(before.symmetric_difference(self.topic_ids)):
            packet, announce = self._build_announce_rpc(topic, subscribe=topic in self.topic_ids)
            self._enqueue_or_retry_announce(peer_id, queue, packet, announce)

    def _note_own_refusals(self, peer_id: ID, units: int) -> None:
        """``units`` of ``peer_id``'s own messages were refused by the gate: past its allowance,
        its stream is not read for a while (counted ``flooder-paused``)."""
        pause = self.limits.refused(peer_id, units, trio.current_time())
        if pause is not None:
            self._drop("flooder-paused", peer_id, f"{units} units of its own messages refused: {pause:g} s")

    def _drop(self, reason: str, peer_id: ID, detail: object = "") -> None:
        self.dropped[reason] += 1
        logger.debug("pubsub dropped input from %s: %s %s", peer_id, reason, detail)

    async def continuously_read_stream(self, stream: INetStream) -> None:
        """Read a peer's RPCs; each one is handled like py-libp2p does, but every frame that is
        dropped here is counted, and a frame that does not parse ends the stream (counted) instead
        of raising protobuf's DecodeError into the swarm's connection task.

        py-libp2p's loop also feeds a metrics channel; our hosts do not enable metrics.
        """
        peer_id = stream.muxed_conn.peer_id
        try:
            while self.manager.is_running:
                paused = self.limits.take_pause(peer_id)
                if paused is not None:
                    await trio.sleep_until(paused)
                try:
                    incoming = await read_varint_prefixed_bytes_limited(stream, self.max_inbound_rpc_size)
                    rpc = rpc_pb2.RPC()
                    rpc.ParseFromString(incoming)
                except RpcTooLarge as exc:
                    await self._give_up_on(stream, peer_id, "rpc-oversized", exc)
                    return
                except (ProtobufDecodeError, ParseError) as exc:
                    await self._give_up_on(stream, peer_id, "rpc-malformed", exc)
                    return
                if not maybe_consume_signed_record(rpc, self.host, peer_id):
                    self._drop("rpc-bad-peer-record", peer_id)
                    continue
                await self._handle_rpc(peer_id, rpc)
        except (StreamEOF, StreamError, IncompleteReadError, IOException) as exc:
            logger.debug("pubsub stream from %s ended: %s", peer_id, exc)
        finally:
            self.limits.forget(peer_id)

    async def _give_up_on(self, stream: INetStream, peer_id: ID, reason: str, detail: object) -> None:
        """Count the bad frame, reset the stream and forget the peer's pubsub state (as py-libp2p
        does for an oversized frame); the peer may open a new stream, and is counted again."""
        self._drop(reason, peer_id, detail)
        with trio.move_on_after(STREAM_RESET_TIMEOUT_S):
            try:
                await stream.reset()
            except Exception as exc:  # the stream may already be gone; nothing more to do
                logger.debug("reset of the pubsub stream from %s failed: %s", peer_id, exc)
        self._handle_dead_peer(peer_id)

    async def _handle_rpc(self, peer_id: ID, rpc: rpc_pb2.RPC) -> None:
        """py-libp2p's handling of one inbound RPC: messages (rate-limited per peer first),
        subscriptions, control."""
        admitted = self.limits.admit(peer_id, len(rpc.publish), trio.current_time()) if rpc.publish else 0
        if admitted < len(rpc.publish):
            self.dropped["rate-limited"] += len(rpc.publish) - admitted
            logger.debug("pubsub dropped %d messages from %s: rate-limited", len(rpc.publish) - admitted, peer_id)
        own_refused, sender = 0, peer_id.to_bytes()
        for msg in rpc.publish[:admitted]:
            if self.max_message_bytes is not None and len(msg.data) > self.max_message_bytes:
                self._drop("oversized", peer_id, f"{len(msg.data)} B")
            elif self._is_subscribed_to_msg(msg) and self.manager.is_running:
                if self.inbound_gate is not None and not self._is_msg_seen(msg) and not self.inbound_gate(msg):
                    if msg.from_id == sender:
                        own_refused += refusal_units(len(msg.data))
                    continue
                # A copy of its own: a message parsed out of an RPC keeps the whole RPC's buffer
                # alive (protobuf's arena) for as long as it waits in a queue, so one small
                # message could pin a 1 MiB frame (a 3,000 msg/s flood grew a node by 336 MB).
                own = rpc_pb2.Message()
                own.CopyFrom(msg)
                self.manager.run_task(self.push_msg, peer_id, own)
        if own_refused:
            self._note_own_refusals(peer_id, own_refused)
        if rpc.subscriptions:
            if len(rpc.subscriptions) > self.max_subscriptions_per_rpc:
                self._drop("rpc-too-many-subscriptions", peer_id, len(rpc.subscriptions))
            else:
                for sub in rpc.subscriptions:
                    self.handle_subscription(peer_id, sub)
        if rpc.HasField("control"):
            await self.router.handle_rpc(rpc, peer_id)

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        """Hand a message to our subscriptions; one that does not fit a full queue is counted."""
        size = len(publish_message.data)
        for topic in publish_message.topicIDs:
            if topic in self.topic_ids:
                subscription = self.subscribed_topics_receive[topic]
                if isinstance(subscription, _BoundedSubscription):
                    if subscription.queued_bytes + size > SUBSCRIPTION_QUEUE_BYTES:
                        self._drop("queue-full", ID(publish_message.from_id), f"{topic}: bytes")
                        continue
                try:
                    self.subscribed_topics_send[topic].send_nowait(publish_message)
                except trio.WouldBlock:
                    self._drop("queue-full", ID(publish_message.from_id), topic)
                    continue
                if isinstance(subscription, _BoundedSubscription):
                    subscription.queued_bytes += size

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        # Without the sender's signed peer record: pubsub attaches it to every RPC and the receiver
        # verifies its Ed25519 signature each time, for addresses it already has (the record
        # went out with pubsub's hello and with identify; membership heartbeats carry them too).
        rpc_msg.ClearField("senderRecord")
        # Pubsub's per-peer writer pops an RPC off the queue and calls this without a checkpoint
        # in between, so an RPC is always either queued or counted here until it is written.
        self._writes_in_flight += 1
        try:
            return await super().write_msg(stream, rpc_msg)
        finally:
            self._writes_in_flight -= 1
            self._backlog_changed()

    def _backlog_changed(self) -> None:
        self._backlog_shrank.set()
        self._backlog_shrank = trio.Event()

    def queue_backlog(self) -> int:
        """The longest outbound queue to any peer, in RPCs."""
        return max((len(q) for q in self.peer_queues.values()), default=0)

    async def wait_for_backlog(self, below: int) -> None:
        """Return once every peer's outbound queue holds fewer than ``below`` RPCs; with
        ``below=1``, once every queued RPC has also been written to its stream. Woken by the
        writers, not by polling; unbounded (a peer may stop reading), so bound it."""
        while self.queue_backlog() >= below or (below <= 1 and self._writes_in_flight):
            await self._backlog_shrank.wait()

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
        subscription = _BoundedSubscription(receive, unsubscribe_fn=functools.partial(self.unsubscribe, topic_id))
        self.subscribed_topics_send[topic_id] = send
        self.subscribed_topics_receive[topic_id] = subscription
        packet, subopt = self._build_announce_rpc(topic_id, subscribe=True)
        await self.message_all_peers(packet.SerializeToString(), announce=subopt)
        await self.router.join(topic_id)
        return subscription


def make_pubsub(
    host: IHost, heartbeat_interval: float = HEARTBEAT_INTERVAL_S, max_message_bytes: int | None = None
) -> TrainingPubsub:
    """Pubsub + GossipSub for ``host``; build it before the host dials anyone, run it with
    :func:`running_pubsub`. Strict signing stays on (gossipsub verifies the origin of every
    message; ``ID(msg.from_id)`` is that verified origin). Inbound messages over
    ``max_message_bytes`` (the mesh passes the wire cap) are dropped as they are read."""
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
    return TrainingPubsub(host, router, strict_signing=True, max_message_bytes=max_message_bytes)


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
    passes the wire cap, p2ptrain.wire.MAX_MESSAGE_BYTES)."""
    if len(data) > limit:
        raise PubsubMessageTooLarge(
            f"message of {len(data)} B for topic {topic!r} is over the {limit} B cap: "
            "send bulk data on a stream or by CID"
        )
    if isinstance(pubsub, TrainingPubsub) and pubsub.queue_backlog() >= BACKPRESSURE_AT:
        # Slow down rather than overflow a peer's queue; a peer that stopped reading entirely
        # must not stall us forever, so the wait is bounded.
        with trio.move_on_after(BACKPRESSURE_MAX_WAIT_S):
            await pubsub.wait_for_backlog(below=BACKPRESSURE_AT)
    await pubsub.publish(topic, data)
