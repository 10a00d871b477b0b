"""Finding and staying connected to peers: bootstrap list, heartbeat addresses, Kad-DHT, mDNS.

Why our own dialer: py-libp2p's ``host.connect`` goes through ``Swarm.dial_peer``, whose "happy
eyeballs" loop waits 250 ms after starting each address's dial unless the peer's connection count
already reached ``max_connections_per_peer`` (3 by default, so one successful dial never cuts the
wait short). With the peer ID known from the multiaddr we call ``Swarm.dial_addr`` directly: one
TCP + Noise + yamux handshake, a few milliseconds on loopback, all peers dialed in parallel.

Sources of peers, all feeding one dial path:

- ``--bootstrap`` multiaddrs (must end in ``/p2p/<peer id>``): kept connected for the node's
  lifetime, redialed with backoff whenever the connection drops;
- heartbeats: a heartbeat carries the sender's listen addresses, so a node that knows one peer
  learns how to reach every peer in the mesh; those are kept connected while the peer is alive;
- Kad-DHT (server mode): lookups of our own key walk the DHT and reveal peers that may not be on
  the same pubsub mesh yet;
- mDNS (``--mdns``, LAN only; it binds all interfaces): peers announced on the local network.

A heartbeat's addresses are chosen by its sender, and identities are free, so the dialing they
cause is bounded (issue 13: 9,000 fresh identities with 16 addresses each pinned a core):
at most ``MAX_DIAL_ADDRS_PER_PEER`` addresses per peer, ``MAX_CONCURRENT_DIALS`` dials at once,
``MAX_KEPT_PEERS`` peers kept connected at once (bootstrap peers always are; beyond the cap a newly
heard-of peer is not dialed by us, counted in ``not_kept``, and reaches us by dialing itself), and a
per-peer backoff that grows to ``REDIAL_MAX_UNREACHED_S`` for a peer never once reached.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.discovery.events.peerDiscovery import peerDiscovery
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.pubsub import Pubsub
from multiaddr import Multiaddr

from p2ptrain.base import ArgumentError, short_id
from p2ptrain.mesh._membership import MemberEvent, Membership
from p2ptrain.wire import Heartbeat, MESH_TOPIC, Signed
from p2ptrain.net import not_a_multiaddr, running_service

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 5.0
# Redial backoff of a peer we were connected to (it restarts, a link blips): quick, capped at 2 s.
REDIAL_MIN_S, REDIAL_MAX_S = 0.2, 2.0
# ... and of a peer never reached at any of its addresses (likely made up): up to 30 s between tries.
REDIAL_MAX_UNREACHED_S = 30.0
# A real node listens on one or two addresses; a heartbeat may carry 16.
MAX_DIAL_ADDRS_PER_PEER = 4
# Dials in flight at once, over all peers: a handshake costs ~10 ms of CPU, so 8 at once stay far
# below one core even when every one of them times out.
MAX_CONCURRENT_DIALS = 8
# Peers we keep connected at once (one redial task each): far above any cluster we run.
MAX_KEPT_PEERS = 256
# How often a kept peer's connection and keep-condition (``while_``, e.g. "membership still counts
# it alive", which has no event of its own here) are checked again: a lost connection is redialed
# within half a second, well inside the 5 heartbeats (5 s) after which membership calls it gone.
CONNECTED_POLL_S = 0.5
# Of two peers that learn of each other from heartbeats, the one with the larger ID waits this long
# before dialing, so the pair usually ends up with one connection, not two.
YIELD_TO_LOWER_ID_S = 1.0
DHT_WALK_INTERVALS_S = (1.0, 2.0, 5.0, 10.0, 30.0)
# The DHT's identify checks and first lookups compete for the CPU with forming the pubsub mesh
# (measured: ~0.16 s of a late joiner's ~0.35 s); they wait until that is done.
DHT_DELAY_S = 1.0
ADDR_TTL_S = 3600


def parse_bootstrap(addr: str) -> PeerInfo:
    """A bootstrap multiaddr with its ``/p2p/<peer id>``; a clear error otherwise (naming
    ``--bootstrap`` or ``bootstrap=``, as the caller gave it)."""
    try:
        maddr = Multiaddr(addr)
    except Exception as exc:
        raise ArgumentError("{bootstrap:{addr!r}} is not a multiaddr: {why}", addr=addr,
                            why=not_a_multiaddr(addr, exc, peer=True)) from None
    try:
        return info_from_p2p_addr(maddr)
    except Exception:
        raise ArgumentError(
            "{bootstrap:{addr!r}} has no /p2p/<peer id> part; copy an address from "
            "`p2ptrain node status --json` (the \"addrs\" list), which includes it", addr=addr
        ) from None


def dialable(addrs: Iterable[str], peer_id: ID) -> list[Multiaddr]:
    """TCP addresses from a peer's heartbeat, stripped of a ``/p2p`` part that is not its own, then
    its relayed ones (``…/p2p/<relay>/p2p-circuit/p2p/<peer>``, kept whole): direct first."""
    direct, relayed = [], []
    for text in addrs:
        try:
            maddr = Multiaddr(text)
            names = [p.name for p in maddr.protocols()]
            if "tcp" not in names or any(n in names for n in ("ws", "wss")):
                continue
            if "p2p-circuit" in names:
                if names.count("p2p-circuit") == 1 and names[-1] == "p2p" and text.endswith(f"/p2p/{peer_id.to_base58()}"):
                    relayed.append(maddr)
                continue
            if "p2p" in names:
                if maddr.value_for_protocol("p2p") != peer_id.to_base58():
                    continue
                maddr = maddr.decapsulate(Multiaddr(f"/p2p/{peer_id.to_base58()}"))
            direct.append(maddr)
        except Exception:
            continue
    return direct + relayed


def _is_circuit(addr: Multiaddr) -> bool:
    return "/p2p-circuit" in str(addr)


class _ConnectionEvents(INotifee):
    """Forwards new connections to the discovery task (a notifee must not block the swarm)."""

    def __init__(self, send: trio.MemorySendChannel[ID]) -> None:
        self._send = send

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        try:
            self._send.send_nowait(conn.muxed_conn.peer_id)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        await trio.lowlevel.checkpoint()

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        await trio.lowlevel.checkpoint()

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        await trio.lowlevel.checkpoint()

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        await trio.lowlevel.checkpoint()

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        await trio.lowlevel.checkpoint()


class Discovery:
    """Keeps the node connected to every peer it learns of; runs inside the node's nursery."""

    def __init__(
        self,
        host: IHost,
        pubsub: Pubsub,
        membership: Membership,
        bootstrap: Iterable[str] = (),
        *,
        mdns: bool = False,
        dht: bool = True,
        dial_relayed: Callable[[Multiaddr], Awaitable[None]] | None = None,
    ) -> None:
        self.host = host
        # Connects through a relay to the peer a circuit address names (p2ptrain.net._relay); None:
        # circuit addresses are not dialed.
        self.dial_relayed = dial_relayed
        # Set when an unconnected kept peer's heartbeat names a relayed address: its redial waits
        # on this rather than the rest of its backoff (it may just have become reachable).
        self._new_relayed: dict[ID, trio.Event] = {}
        membership.router.on(Heartbeat, self._on_heartbeat)
        self.pubsub = pubsub
        self.membership = membership
        self.bootstrap = [parse_bootstrap(a) for a in bootstrap]
        self.mdns = mdns
        self.dht: KadDHT | None = KadDHT(host, DHTMode.SERVER) if dht else None
        self._own = host.get_id()
        self._keeping: set[ID] = set()
        self._nursery: trio.Nursery | None = None
        self._dial_slots = trio.CapacityLimiter(MAX_CONCURRENT_DIALS)
        self.dials = 0
        self.relayed_dials = 0
        self.dial_failures = 0
        self.not_kept = 0  # peers heard of but not dialed because MAX_KEPT_PEERS were kept

    def stats(self) -> dict[str, int]:
        return {
            "dials": self.dials,
            "dial_failures": self.dial_failures,
            "relayed_dials": self.relayed_dials,
            "kept": len(self._keeping),
            "not_kept": self.not_kept,
        }

    def connected(self, peer_id: ID) -> bool:
        return any(not c.is_closed for c in self.host.get_network().get_connections(peer_id))

    async def dial(self, peer_id: ID, addrs: Iterable[Multiaddr]) -> bool:
        """Connect to ``peer_id`` at the first address that works; True if connected."""
        if self.connected(peer_id):
            return True
        addrs = list(addrs)[:MAX_DIAL_ADDRS_PER_PEER]
        self.host.get_peerstore().add_addrs(peer_id, [a for a in addrs if not _is_circuit(a)], ADDR_TTL_S)
        network = self.host.get_network()
        for addr in addrs:
            try:
                async with self._dial_slots:
                    if self.connected(peer_id):
                        return True
                    self.dials += 1
                    if _is_circuit(addr):
                        if self.dial_relayed is None:
                            continue
                        self.relayed_dials += 1
                        await self.dial_relayed(addr)  # bounded by its own timeout (several round trips)
                    else:
                        with trio.fail_after(DIAL_TIMEOUT_S):
                            await network.dial_addr(addr, peer_id)
                logger.debug("connected to %s at %s", short_id(peer_id), addr)
                return True
            except (Exception, trio.TooSlowError) as exc:  # every dial failure is the remote's
                self.dial_failures += 1
                logger.debug("dial %s at %s failed: %s", short_id(peer_id), addr, exc)
        return self.connected(peer_id)

    def keep_connected(self, peer_id: ID, addrs: list[Multiaddr], while_: Callable[[], bool]) -> None:
        """Start (once per peer) a task that redials ``peer_id`` whenever it drops, while ``while_()``."""
        if peer_id == self._own or peer_id in self._keeping or self._nursery is None:
            return
        if len(self._keeping) >= MAX_KEPT_PEERS and not self._is_bootstrap(peer_id):
            self.not_kept += 1
            logger.debug("not dialing %s: already keeping %d peers", short_id(peer_id), MAX_KEPT_PEERS)
            return
        self._keeping.add(peer_id)
        self._nursery.start_soon(self._keep, peer_id, addrs, while_, name=f"keep:{short_id(peer_id)}")

    def _is_bootstrap(self, peer_id: ID) -> bool:
        return any(info.peer_id == peer_id for info in self.bootstrap)

    async def _keep(self, peer_id: ID, addrs: list[Multiaddr], while_: Callable[[], bool]) -> None:
        delay, reached, failed = REDIAL_MIN_S, False, 0
        self._new_relayed[peer_id] = trio.Event()
        try:
            while while_():
                if self.connected(peer_id) or await self.dial(peer_id, self._addrs_of(peer_id, addrs)):
                    delay, reached = REDIAL_MIN_S, True
                    await trio.sleep(CONNECTED_POLL_S)
                else:
                    failed += 1
                    if self._is_bootstrap(peer_id) and not reached and failed >= 4 and failed & (failed - 1) == 0:
                        # The user named this peer: a typo, a node that is not running or a closed
                        # port would otherwise leave a node alone with nothing said. From the 4th try
                        # (~1.5 s: nodes started together are still starting before), then the 8th, 16th...
                        logger.warning("bootstrap peer %s not reached at %s (%d tries): check the address, the peer "
                                       "ID, that its node runs and that its port is open; trying again",
                                       short_id(peer_id), ", ".join(map(str, addrs)), failed)
                    logger.debug("%s unreachable; redial in %.2f s", short_id(peer_id), delay)
                    with trio.move_on_after(delay * random.uniform(0.8, 1.2)):
                        await self._new_relayed[peer_id].wait()
                    if self._new_relayed[peer_id].is_set():
                        self._new_relayed[peer_id] = trio.Event()
                        delay = REDIAL_MIN_S
                    delay = min(delay * 2, REDIAL_MAX_S if reached or self._is_bootstrap(peer_id) else REDIAL_MAX_UNREACHED_S)
        finally:
            self._keeping.discard(peer_id)
            self._new_relayed.pop(peer_id, None)

    def _addrs_of(self, peer_id: ID, addrs: list[Multiaddr]) -> list[Multiaddr]:
        """Where to dial ``peer_id``: the addresses of its latest heartbeat, else ``addrs``. Parsed
        only when a dial is due (a connected peer is checked twice a second: parsing its addresses
        each time was a quarter of an idle node's CPU)."""
        record = self.membership.get(peer_id)
        return (dialable(record.addrs, peer_id) if record is not None else []) or addrs

    def _on_heartbeat(self, signed: Signed[Heartbeat], topic: str) -> None:
        """Wake the backed-off redial of a kept, unconnected peer whose heartbeat names a relayed
        address (it reserved one since we last tried): at most one redial per heartbeat of it."""
        event = self._new_relayed.get(signed.sender)
        if event is None or event.is_set() or self.dial_relayed is None:
            return
        if any("/p2p-circuit" in a for a in signed.msg.addrs) and not self.connected(signed.sender):
            event.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        send, receive = trio.open_memory_channel[ID](256)
        notifee = _ConnectionEvents(send)
        self.host.get_network().register_notifee(notifee)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for info in self.bootstrap:
                self.keep_connected(info.peer_id, list(info.addrs), lambda: True)
            nursery.start_soon(self._greet_new_connections, receive)
            nursery.start_soon(self._follow_heartbeats)
            if self.dht is not None:
                nursery.start_soon(self._walk_dht)
            if self.mdns:
                nursery.start_soon(self._listen_mdns)
            task_status.started()
        self._nursery = None

    async def _greet_new_connections(self, receive: trio.MemoryReceiveChannel[ID]) -> None:
        """Heartbeat as soon as a new peer (inbound or outbound) can hear us, not up to 1 s later."""
        async with receive, trio.open_nursery() as nursery:
            async for peer_id in receive:
                nursery.start_soon(self._greet, peer_id)
                if self.dht is not None:
                    nursery.start_soon(self._add_to_dht, peer_id)

    async def _greet(self, peer_id: ID) -> None:
        with trio.move_on_after(DIAL_TIMEOUT_S):
            await self.pubsub.wait_for_subscription(peer_id, MESH_TOPIC, timeout=DIAL_TIMEOUT_S)
            self.membership.poke()

    async def _add_to_dht(self, peer_id: ID) -> None:
        assert self.dht is not None
        await trio.sleep(DHT_DELAY_S)
        with trio.move_on_after(DIAL_TIMEOUT_S):
            try:
                await self.dht.add_peer(peer_id)
            except Exception as exc:
                logger.debug("could not add %s to the DHT routing table: %s", short_id(peer_id), exc)

    async def _follow_heartbeats(self) -> None:
        async with self.membership.events() as events:
            for record in self.membership.alive():
                self._follow(MemberEvent("join", record.peer_id))
            async for event in events:
                self._follow(event)

    def _follow(self, event: MemberEvent) -> None:
        record = self.membership.get(event.peer_id)
        if event.kind != "join" or record is None:
            return
        addrs = dialable(record.addrs, event.peer_id)
        if not addrs:
            return

        def alive() -> bool:
            current = self.membership.get(event.peer_id)
            return current is not None and current.alive

        if self._own.to_bytes() < event.peer_id.to_bytes():
            self.keep_connected(event.peer_id, addrs, alive)
        elif self._nursery is not None:
            self._nursery.start_soon(self._keep_later, event.peer_id, addrs, alive)

    async def _keep_later(self, peer_id: ID, addrs: list[Multiaddr], alive: Callable[[], bool]) -> None:
        await trio.sleep(YIELD_TO_LOWER_ID_S)
        self.keep_connected(peer_id, addrs, alive)

    async def _walk_dht(self) -> None:
        """Look up our own key now and then; dial every peer the walk reveals."""
        assert self.dht is not None
        await trio.sleep(DHT_DELAY_S)
        async with running_service(self.dht, "kad-dht"):
            intervals = iter(DHT_WALK_INTERVALS_S)
            interval = next(intervals)
            while True:
                await trio.sleep(interval)
                interval = next(intervals, interval)
                found: list[ID] = []
                try:
                    with trio.move_on_after(DIAL_TIMEOUT_S):
                        found = await self.dht.peer_routing.find_closest_peers_network(self._own.to_bytes())
                except Exception as exc:
                    logger.debug("DHT walk failed: %s", exc)
                for peer_id in found:
                    if peer_id == self._own or self.connected(peer_id):
                        continue
                    addrs = self.host.get_peerstore().addrs(peer_id)
                    if addrs:
                        logger.debug("DHT revealed %s", short_id(peer_id))
                        self.keep_connected(peer_id, list(addrs), functools.partial(self._known_alive, peer_id))

    def _known_alive(self, peer_id: ID) -> bool:
        """Keep a DHT-found peer until heartbeats say it is gone (or it never heartbeats at all)."""
        record = self.membership.get(peer_id)
        return record is None or record.alive

    async def _listen_mdns(self) -> None:
        """Announce ourselves on the LAN and dial peers announced there."""
        from libp2p.discovery.mdns.mdns import create_mdns_discovery

        tcp_ports = [a.value_for_protocol("tcp") for a in self.host.get_addrs() if "tcp" in str(a)]
        mdns = create_mdns_discovery(
            self.host.get_network(),
            port=int(tcp_ports[0]) if tcp_ports else 4001,
            private_network_fingerprint="p2ptrain",
            host=self.host,
        )
        send, receive = trio.open_memory_channel[PeerInfo](256)
        token = trio.lowlevel.current_trio_token()

        def enqueue(info: PeerInfo) -> None:
            try:
                send.send_nowait(info)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass

        def found(info: PeerInfo) -> None:  # called from zeroconf's thread
            try:
                token.run_sync_soon(enqueue, info)
            except trio.RunFinishedError:
                pass

        peerDiscovery.register_peer_discovered_handler(found)
        mdns.start()
        try:
            async with receive:
                async for info in receive:
                    logger.info("mDNS found %s", short_id(info.peer_id))
                    self.keep_connected(info.peer_id, list(info.addrs), functools.partial(self._known_alive, info.peer_id))
        finally:
            peerDiscovery.unregister_peer_discovered_handler(found)
            mdns.stop()
