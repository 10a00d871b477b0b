"""One running peer: host, pubsub, membership, discovery and the control endpoint, in one lifetime.

A :class:`Node` owns a home directory::

    <home>/identity.key   Ed25519 key (0600): the peer ID survives restarts
    <home>/config.toml    effective settings, written atomically on first start
    <home>/control.sock   the owner-only control endpoint while the node runs
    <home>/blocks/        the content layer's block store
    <home>/logs/          log files of `p2ptrain node start`

Other layers extend a node before or while it runs: message handlers (``node.on``), topics
(``node.subscribe``), control ops (``node.control.register``) and services (``node.add_service``),
which run in the node's own nursery and stop with it. There is no fire-and-forget anywhere: every
task the node starts lives in a nursery that ``run`` waits for.

Stopping is ordered and bounded: cancel the services, say Goodbye, stop discovery, membership and
the router, stop gossipsub and pubsub, close the listeners, close every connection, remove the
control socket. The node's lifetime runs
shielded from the caller's cancellation and is driven by a stop event instead, because py-libp2p
torn down by a plain cancellation leaks sockets and raises 'Nursery is closed to new arrivals'.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID
from libp2p.pubsub.pubsub import Pubsub
from multiaddr import Multiaddr

from p2ptrain import __version__
from p2ptrain.base import ArgumentError, UserError, first_leaf, load_or_create_identity, peer_id_of, short_id, write_atomic
from p2ptrain.mesh import Discovery, M, Membership, MessageRouter, Rate, keep_reservations, parse_bootstrap
from p2ptrain.control import ControlServer, NodeStatus, ops as control_ops
from p2ptrain.node._node_config import CONFIG_FILE, NodeConfig, prepare_home
from p2ptrain.wire import MAX_MESSAGE_BYTES, MESH_TOPIC, MESSAGES, MessageRegistry, Signed, encode
from p2ptrain.net import (
    PubsubMessageTooLarge,
    Reachability,
    Relaying,
    advertised_addrs,
    check_listen,
    close_host,
    is_circuit,
    make_host,
    make_pubsub,
    not_a_multiaddr,
    publish_bytes,
    relay_limits,
    running_pubsub,
)

logger = logging.getLogger(__name__)

# Bound on saying goodbye at shutdown (publish, then wait until pubsub's writers put it on the
# wire): a goodbye only saves peers the 5 heartbeats of silence before they call us gone, so a
# peer that is not reading must not hold up our exit; on a live connection it takes milliseconds.
GOODBYE_TIMEOUT_S = 0.5
HOST_CLOSE_TIMEOUT_S = 5.0
# If an orderly stop takes longer than this, the node's lifetime is cancelled outright.
SHUTDOWN_TIMEOUT_S = 15.0
# `node status` lists at most this many alive and this many gone peers (and counts them all), so
# its answer stays under ~150 KB however many identities heartbeat at us (it reached 0.93 MB).
STATUS_MAX_PEERS = 64


Service = Callable[..., Awaitable[Any]]


class Node:
    """One peer. ``await node.run()`` (or ``await nursery.start(node.run)``) until ``node.stop()``.

    ``config``: its settings, whole (``node start`` resolves them from flags, ``P2PTRAIN_*``,
    config.toml and defaults: :func:`p2ptrain.cli.config.resolve`); None: the home's config.toml,
    else the defaults. A home without a config.toml gets this one written.
    ``messages``: the message types its router decodes (default: the package's); tests and
    extensions with types of their own pass ``MESSAGES.copy()`` extended with them.
    """

    def __init__(
        self, home: Path | str, config: NodeConfig | None = None, *, messages: MessageRegistry = MESSAGES,
    ) -> None:
        self.home = Path(home).expanduser().absolute()
        stored = NodeConfig.load(self.home)
        self.config = config or stored or NodeConfig()
        self.config.check()
        self._listen = _maddrs(self.config.listen)
        for addr in self.config.bootstrap:
            parse_bootstrap(addr)  # a bad --bootstrap is the user's error: say so before starting
        prepare_home(self.home)  # after the checks: a refused address leaves no new home behind
        if stored is None:
            write_atomic(self.home / CONFIG_FILE, self.config.to_toml().encode(), mode=0o600)
        self.key_pair: KeyPair = load_or_create_identity(self.home)
        self.peer_id: ID = peer_id_of(self.key_pair)
        self.control = ControlServer(self.home)
        self.router = MessageRouter(self.peer_id, messages)
        self.membership = Membership(
            own_id=self.peer_id,
            router=self.router,
            publish=self.publish,
            addrs=lambda: self.addrs,
            interval=self.config.heartbeat_interval,
            silence_heartbeats=self.config.silence_heartbeats,
        )
        self.host: IHost | None = None
        self.pubsub: Pubsub | None = None
        self.discovery: Discovery | None = None
        self.reachability: Reachability | None = None
        self.relaying: Relaying | None = None
        self._services: list[tuple[Service, tuple[Any, ...], str]] = []
        self._status_sections: dict[str, Callable[[], dict[str, Any]]] = {}
        self._nursery: trio.Nursery | None = None
        self._seq = time.time_ns() // 1000  # grows across restarts with no stored state
        self.bytes_published = 0  # signed payload bytes this node published (once per message)
        self._stop = trio.Event()
        self.started = trio.Event()
        self.listening_at: float | None = None  # wall clock: listeners up, pubsub running
        self.started_at: float | None = None  # wall clock: mesh joined, services started
        self.stopped = trio.Event()
        self.control.register(control_ops.STATUS, self._status_op)
        self.control.register(control_ops.PING, self._ping_op)

    # -- the API for other layers --------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<Node {short_id(self.peer_id)} home={self.home}>"


    @property
    def addrs(self) -> list[str]:
        """Listen multiaddrs ending in ``/p2p/<peer id>``: each usable as another node's bootstrap."""
        if self.host is None:
            return []
        suffix = f"/p2p/{self.peer_id.to_base58()}"
        out = []
        for addr in advertised_addrs(self.host.get_addrs()):
            text = str(addr)
            out.append(text if text.endswith(suffix) else text + suffix)
        if self.relaying is not None:
            out.extend(self.relaying.addrs)  # through relays, when we are behind a NAT
        return out

    def on(self, msg_type: type[M], handler: Callable[[Signed[M], str], Awaitable[None] | None]) -> None:
        """Call ``handler(signed, topic)`` for every valid ``msg_type`` message on joined topics."""
        self.router.on(msg_type, handler)

    def limit(self, msg_type: type, rate: Rate) -> None:
        """Take at most ``rate`` of ``msg_type`` messages from each sender (mesh.rates); the rest
        are dropped before they are checked or relayed. For the service that knows the honest rate."""
        self.router.limit(msg_type, rate)

    async def subscribe(self, topic: str) -> None:
        """Join ``topic`` (while running); its messages go to the handlers registered with ``on``."""
        await self.router.join(topic)

    async def unsubscribe(self, topic: str) -> None:
        await self.router.leave(topic)

    async def publish(self, topic: str, msg: Any) -> None:
        """Sign and publish a wire message; raises PubsubMessageTooLarge over the wire cap."""
        if self.pubsub is None:
            raise RuntimeError(f"{self!r} is not running")
        self._seq += 1
        try:
            data = encode(msg, self.key_pair, self._seq)
        except ValueError as exc:
            raise PubsubMessageTooLarge(str(exc)) from None
        await publish_bytes(self.pubsub, topic, data, MAX_MESSAGE_BYTES)
        self.bytes_published += len(data)

    def add_service(self, fn: Service, *args: Any, name: str | None = None) -> None:
        """Run ``await fn(*args)`` for the node's lifetime, started after the mesh is up.

        If ``fn`` takes a ``task_status`` keyword it is started with ``nursery.start`` and the node
        reports itself started only once ``fn`` called ``task_status.started()``. When ``fn``
        returns, nothing else happens; when it raises, the node stops and ``run`` raises.
        Register before ``run``; while running use :meth:`start_soon`.
        """
        if self._nursery is not None:
            raise RuntimeError("the node is running: use node.start_soon(...) instead")
        self._services.append((fn, args, name or str(getattr(fn, "__qualname__", repr(fn)))))

    def add_status(self, section: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Show ``fn()`` under ``services.<section>`` in `node status`: how a service above the node
        (content, tasks) reports its counters without the node importing it."""
        self._status_sections[section] = fn

    def start_soon(self, fn: Service, *args: Any, name: str | None = None) -> None:
        """Start a task in the node's service nursery (while running); it is cancelled at stop."""
        if self._nursery is None:
            raise RuntimeError(f"{self!r} is not running")
        self._nursery.start_soon(fn, *args, name=name)

    def stop(self) -> None:
        """Ask the node to stop; ``run`` returns once everything is closed."""
        self._stop.set()

    # -- the lifetime --------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until :meth:`stop` or cancellation; ``task_status.started()`` once the mesh is up."""
        finished = trio.Event()
        lifetime = trio.CancelScope(shield=True)

        async def live(*, task_status: Any) -> None:
            with lifetime:
                try:
                    await self._live(task_status)
                finally:
                    finished.set()

        try:
            await self._run_lifetime(live, finished, lifetime, task_status)
        except BaseExceptionGroup as group:
            # A user's mistake found while starting (home in use, port taken) should read as one
            # line, not as the nursery tree it travelled through.
            user_errors, _ = group.split(UserError)
            if user_errors is not None:
                raise first_leaf(user_errors) from None
            raise

    async def _run_lifetime(self, live: Any, finished: trio.Event, lifetime: trio.CancelScope, task_status: Any) -> None:
        async with trio.open_nursery() as nursery:
            try:
                await nursery.start(live)
                task_status.started()
                await finished.wait()
            finally:
                self._stop.set()
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(SHUTDOWN_TIMEOUT_S):
                        await finished.wait()
                    if not finished.is_set():
                        logger.warning("%s did not stop in %.0f s; cancelling it", short_id(self.peer_id), SHUTDOWN_TIMEOUT_S)
                        lifetime.cancel()

    async def _live(self, task_status: Any) -> None:
        if self._stop.is_set():
            return
        self.control.claim_socket()  # fail fast, before any network work, if the home is in use
        # py-libp2p binds with SO_REUSEPORT: on a port another node listens on it would start beside
        # it, and the kernel would deal dialers between the two. Refused here, for every way a node
        # starts (`node start`, a script's background peer, p2ptrain.testing, a user's own Node).
        check_listen(self.config.listen)
        host = make_host(self.key_pair, self._listen)
        # Before any connection exists; inbound messages over the wire cap are dropped as read.
        pubsub = make_pubsub(host, self.config.heartbeat_interval, MAX_MESSAGE_BYTES)
        pubsub.inbound_gate = self.router.admit  # per-sender rates (Node.limit), before any check or relay
        self.host, self.pubsub = host, pubsub
        try:
            async with host.run(listen_addrs=self._listen):
                try:
                    if len(host.get_addrs()) < len(self._listen):
                        # py-libp2p logs a failed listen and carries on without it.
                        listening = ", ".join(str(a) for a in host.get_addrs()) or "nothing"
                        raise UserError(
                            f"could not listen on all of {', '.join(self.config.listen)} (listening on {listening}); "
                            "is the port in use by another program or node?"
                        )
                    async with running_pubsub(pubsub):
                        await self._serve(host, pubsub, task_status)
                finally:
                    # Pubsub first (it drops what still arrives), then listeners, then connections.
                    logger.debug("node %s: pubsub stopped; closing the host", short_id(self.peer_id))
                    with trio.move_on_after(HOST_CLOSE_TIMEOUT_S):
                        await close_host(host)
                    logger.debug("node %s: host closed", short_id(self.peer_id))
        finally:
            self.host = self.pubsub = None
            self.stopped.set()
            logger.info("node %s stopped", short_id(self.peer_id))

    async def _serve(self, host: IHost, pubsub: Pubsub, task_status: Any) -> None:
        self.listening_at = time.time()
        config = self.config
        self.relaying = Relaying(host, serve=config.relay_service, limits=relay_limits(
            config.relay_max_reservations, config.relay_max_circuit_duration, config.relay_max_circuit_bytes))
        self.discovery = Discovery(
            host, pubsub, self.membership, self.config.bootstrap, mdns=self.config.mdns, dht=self.config.dht,
            dial_relayed=self.relaying.dial,
        )
        self.reachability = Reachability(host, lambda: _direct_peers(host))
        async with trio.open_nursery() as nursery:
            await nursery.start(self.control.serve)
            await nursery.start(self.relaying.run)
            await nursery.start(self.router.run, pubsub)
            await nursery.start(self.membership.run)
            await nursery.start(self.discovery.run)
            await nursery.start(self.reachability.run)
            nursery.start_soon(self._tell_reachability, self.reachability)
            await nursery.start(keep_reservations, host, self.relaying, self.reachability, self.membership,
                                self.membership.poke)
            async with trio.open_nursery() as services:
                self._nursery = services
                for fn, args, name in self._services:
                    if "task_status" in inspect.signature(fn).parameters:
                        await services.start(fn, *args, name=name)
                    else:
                        services.start_soon(fn, *args, name=name)
                logger.info("node %s listening on %s", short_id(self.peer_id), ", ".join(self.addrs))
                self.started_at = time.time()
                self.started.set()
                task_status.started()
                await self._stop.wait()
                logger.info("node %s stopping", short_id(self.peer_id))
                services.cancel_scope.cancel()
            self._nursery = None
            with trio.move_on_after(GOODBYE_TIMEOUT_S):
                await self.membership.say_goodbye()
                # Let the per-peer writer tasks put Goodbye on the wire before pubsub stops.
                await pubsub.wait_for_backlog(below=1)  # type: ignore[attr-defined]
            logger.debug("node %s: goodbye sent; stopping mesh tasks", short_id(self.peer_id))
            nursery.cancel_scope.cancel()
        logger.debug("node %s: mesh tasks stopped", short_id(self.peer_id))

    async def _tell_reachability(self, reach: Reachability) -> None:
        """Put each new reachability verdict in our heartbeats, the next one sent at once."""
        while True:
            await reach.changed.wait()
            self.membership.reachability = reach.status
            self.membership.poke()

    # -- control ops ---------------------------------------------------------------------------

    def status(self) -> NodeStatus:
        """What `p2ptrain node status` shows (its ``to_json``: the keys of ``--json``)."""
        connected = []
        if self.host is not None:
            connected = sorted(p.to_base58() for p in self.host.get_connected_peers())
        members = self.membership.all()
        alive = sorted((r for r in members if r.alive), key=lambda r: r.first_seen)
        gone = sorted((r for r in members if not r.alive), key=lambda r: -r.left_at)
        return NodeStatus(
            peer_id=self.peer_id.to_base58(),
            addrs=tuple(self.addrs),
            reachability=self.reachability.status if self.reachability is not None else "unknown",
            autonat=self.reachability.stats() if self.reachability is not None else None,
            relay=self.relaying.stats() if self.relaying is not None else None,
            home=str(self.home),
            version=__version__,
            listening_at=self.listening_at,
            started_at=self.started_at,
            connected=tuple(connected),
            topics=tuple(self.router.topics),
            mesh_topic=MESH_TOPIC,
            heartbeat_interval_s=self.config.heartbeat_interval,
            caps=self.membership.heartbeat().caps.__dict__ if self.host is not None else None,
            # Bounded however many identities heartbeat at us: the oldest members and the latest
            # departures are listed, the rest counted.
            peers=tuple(r.as_json() for r in alive[:STATUS_MAX_PEERS]),
            gone=tuple(r.as_json() for r in gone[:STATUS_MAX_PEERS]),
            peers_total=len(alive),
            gone_total=len(gone),
            membership={"evicted": self.membership.evicted, "expired": self.membership.expired,
                        "dropped_events": dict(self.membership.dropped_events)},
            discovery=self.discovery.stats() if self.discovery is not None else None,
            control=self.control.stats(),
            messages={
                **self.router.stats(),
                "bytes_published": self.bytes_published,
                "dropped_below_router": dict(getattr(self.pubsub, "dropped", {})),
            },
            services={section: fn() for section, fn in self._status_sections.items()},
        )

    async def _status_op(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.status().to_json()

    async def _ping_op(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"peer_id": self.peer_id.to_base58(), "started": self.started.is_set()}


def _direct_peers(host: IHost) -> list[ID]:
    """Peers we have a direct (not relayed) connection to: AutoNAT servers refuse relayed requests."""
    network = host.get_network()
    return [p for p in host.get_connected_peers()
            if any(not any(is_circuit(a) for a in c.get_transport_addresses()) for c in network.get_connections(p))]


def _maddrs(addrs: Sequence[str]) -> list[Multiaddr]:
    out = []
    for a in addrs:
        try:
            out.append(Multiaddr(a))
        except Exception as exc:
            raise ArgumentError("{listen:{addr!r}} is not a multiaddr: {why}", addr=a, why=not_a_multiaddr(a, exc)) from None
    return out
