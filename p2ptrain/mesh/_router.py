"""Turn pubsub deliveries into verified, typed messages and hand them to the layers that want them.

Every message on every topic we join goes through :meth:`MessageRouter._deliver`: decoded by
p2ptrain.wire (size, framing, version, schema, Ed25519 signature, clock skew), checked against
replays, and checked that the wire sender is the peer gossipsub verified as the origin (a peer may
relay others' messages, but may not re-sign them as someone else). Anything wrong is dropped with a
per-reason counter and a debug line; the node keeps running. Handlers are registered by message
type by any layer: ``router.on(Heartbeat, handler)``.

Rates: a layer may also cap how often one sender's messages of a type are taken
(``router.limit(TaskHead, Rate(4, 16))``, :mod:`p2ptrain.mesh._rates`). Pubsub asks :meth:`admit`
about each message as it is read, before it checks, delivers or relays it: a message of a limited
type whose sender (as the message claims it) has no token left is dropped there, unchecked and not
relayed, which is what makes a flood cheap to ignore; one whose sender has a token is charged only
once gossipsub's signature proves the sender, so nobody can spend another peer's tokens.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.validators import signature_validator

from p2ptrain.base import short_id
from p2ptrain.mesh._rates import Rate, SenderRates
from p2ptrain.wire import DecodeError, MESSAGES, MessageRegistry, ReplayGuard, Signed, decode, peek_type

logger = logging.getLogger(__name__)

M = TypeVar("M")
# A handler of one message type M gets a Signed[M]; the router keeps them all as this.
Handler = Callable[[Signed[Any], str], Awaitable[None] | None]
# Messages charged to their sender's rate lately, by gossipsub message ID: a message that arrives
# from two relays before pubsub marks it seen is charged once.
_CHARGED_IDS = 4096


class MessageRouter:
    """Decode, verify and dispatch pubsub messages; one reader task per joined topic."""

    def __init__(self, own_id: ID, types: MessageRegistry = MESSAGES) -> None:
        self._own_id = own_id
        self._types = types  # what is decoded; any other type is dropped as unknown-type
        self._handlers: dict[type, list[Handler]] = {}
        self._replay = ReplayGuard()
        self._pubsub: Pubsub | None = None
        self._nursery: trio.Nursery | None = None
        self.dropped: Counter[str] = Counter()
        self.delivered: Counter[str] = Counter()
        self.bytes_received = 0  # payload bytes of peers' messages on our topics, before checks
        self.rates = SenderRates()
        self._charged: dict[bytes, None] = {}  # ordered set of charged message IDs (_CHARGED_IDS)

    def on(self, msg_type: type[M], handler: Callable[[Signed[M], str], Awaitable[None] | None]) -> None:
        """Call ``handler(signed, topic)`` (sync or async) for every valid ``msg_type`` message.

        Handlers run in the topic's reader task, in arrival order: keep them short (hand long work
        to a service of your own through a memory channel), or the topic's queue backs up.
        """
        if not self._types.knows(msg_type):
            raise TypeError(f"{msg_type!r} is not a registered wire message type")
        self._handlers.setdefault(msg_type, []).append(handler)

    def limit(self, msg_type: type[Any], rate: Rate) -> None:
        """Take at most ``rate`` of ``msg_type`` messages from each sender; the rest are dropped
        (counted ``rate-limited:<type>``) before they are checked or relayed."""
        if not self._types.knows(msg_type):
            raise TypeError(f"{msg_type!r} is not a registered wire message type")
        self.rates.limit(msg_type.TYPE, rate)

    def admit(self, raw: rpc_pb2.Message) -> bool:
        """Pubsub's question about each message it reads, before it checks, delivers or relays it:
        False drops it. A limited type's message is refused when the sender it claims has no token;
        else it is charged once gossipsub's signature proves that sender (pubsub drops a forgery)."""
        kind = peek_type(raw.data)
        if kind is None or not self.rates.limited(kind):
            return True
        now = trio.current_time()
        if not self.rates.has_token(raw.from_id, kind, now, len(raw.data)):
            self.dropped[f"rate-limited:{kind}"] += 1
            return False
        msg_id = raw.from_id + raw.seqno
        if msg_id in self._charged or not signature_validator(raw):
            return True
        self.rates.take(raw.from_id, kind, now, len(raw.data))
        self._charged[msg_id] = None
        if len(self._charged) > _CHARGED_IDS:
            del self._charged[next(iter(self._charged))]
        return True

    @property
    def topics(self) -> list[str]:
        return sorted(self._pubsub.topic_ids) if self._pubsub is not None else []

    async def run(self, pubsub: Pubsub, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Own the reader tasks of all joined topics for the lifetime of the node."""
        self._pubsub = pubsub
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def join(self, topic: str) -> None:
        """Subscribe to ``topic``; its messages are dispatched to the registered handlers."""
        if self._pubsub is None or self._nursery is None:
            raise RuntimeError("the message router is not running (start the node first)")
        if topic in self._pubsub.topic_ids:
            return
        subscription = await self._pubsub.subscribe(topic)
        self._nursery.start_soon(self._read, topic, subscription, name=f"router:{topic}")
        logger.info("joined topic %s", topic)

    async def leave(self, topic: str) -> None:
        """Unsubscribe from ``topic``; its reader task ends when the queue closes."""
        if self._pubsub is not None:
            await self._pubsub.unsubscribe(topic)

    async def _read(self, topic: str, subscription: Any) -> None:
        async for raw in subscription:
            await self._deliver(topic, raw)

    def _drop(self, reason: str, topic: str, origin: ID, detail: object = "") -> None:
        self.dropped[reason] += 1
        logger.debug("dropped message on %s from %s: %s %s", topic, short_id(origin), reason, detail)

    async def _deliver(self, topic: str, raw: rpc_pb2.Message) -> None:
        """The one boundary of every pubsub message: whatever goes wrong in checking it or in a
        handler is a counted, logged rejection of that message, never an exception out of here
        (which would end the topic's reader and, through the node's nursery, the node)."""
        origin = ID(raw.from_id)
        if origin == self._own_id:
            return  # pubsub hands our own publications back to us
        self.bytes_received += len(raw.data)
        try:
            signed = self._check(topic, raw, origin)
        except Exception:
            # A decoder bug is still the input's fault as far as the node is concerned.
            self.dropped["decoder-error"] += 1
            logger.exception("checking a message on %s from %s failed unexpectedly", topic, short_id(origin))
            return
        if signed is None:
            return
        handlers = self._handlers.get(type(signed.msg), [])
        self.delivered[type(signed.msg).TYPE] += 1
        for handler in handlers:
            try:
                result = handler(signed, topic)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                # A message from the network must not take the node down through a handler's bug.
                self.dropped["handler-error"] += 1
                logger.exception(
                    "handler %r failed on %s from %s", handler, type(signed.msg).TYPE, short_id(origin)
                )

    def _check(self, topic: str, raw: rpc_pb2.Message, origin: ID) -> Signed[Any] | None:
        """Decode and verify ``raw``; None (counted) if it is to be dropped."""
        try:
            signed = decode(raw.data, types=self._types)
        except DecodeError as exc:
            self._drop(exc.reason, topic, origin, exc)
            return None
        if signed.sender != origin:
            self._drop("sender-mismatch", topic, origin, f"wire sender {short_id(signed.sender)}")
            return None
        if not self._replay.accept(signed.sender, signed.seq):
            self._drop("replayed", topic, origin, f"seq {signed.seq}")
            return None
        return signed

    def stats(self) -> dict[str, Any]:
        return {"dropped": dict(self.dropped), "delivered": dict(self.delivered), "bytes_received": self.bytes_received}
