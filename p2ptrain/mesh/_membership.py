"""Who is in the mesh: heartbeats on the mesh topic and a liveness view built from them.

Every node publishes a signed :class:`Heartbeat` (its addresses, capabilities, tasks) every
``interval`` seconds. A peer is *alive* from its first heartbeat until it is silent for
``silence_heartbeats`` intervals or says :class:`Goodbye`; then it is *gone* (kept in the view,
marked, so status can show when it left). Other layers await changes with :meth:`wait_until` or
read a stream of :class:`MemberEvent` from :meth:`events`.

The heartbeat also drives discovery: the addresses a heartbeat carries are how a node that knows
one peer learns how to dial all the others (see :mod:`p2ptrain.mesh._discovery`).

Identities cost an attacker nothing (9,000 heartbeats from fresh keys grew a node's view, and its
`node status`, without end), so the view is bounded: gone peers are forgotten ``GONE_TTL_S`` after
they left, and at most ``MAX_PEER_RECORDS`` peers are known at once. When a newcomer finds the view
full, the record evicted is the longest-gone peer, or if none is gone the alive peer we have heard
the fewest heartbeats from (the longest silent of those): a throwaway identity has sent one, an
established peer one per interval since it joined, so a flood of fresh keys evicts its own kind and
never the peers we train with (see docs/mesh.md).
"""

from __future__ import annotations

import logging
from collections import Counter
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import trio
from libp2p.peer.id import ID

from p2ptrain.base import count_rejection, short_id
from p2ptrain.mesh import _capabilities as caps_probe
from p2ptrain.mesh._liveness import DEFAULT_SILENCE_HEARTBEATS
from p2ptrain.mesh._router import MessageRouter
from p2ptrain.net import STATUSES
from p2ptrain.wire import Capabilities, Goodbye, Heartbeat, MAX_BUILDERS, MESH_TOPIC, Signed

logger = logging.getLogger(__name__)

# A new peer makes us heartbeat early so it sees us at once, but never more often than this.
MIN_HEARTBEAT_GAP_S = 0.05
EVENT_QUEUE = 1024
# A peer's entry in `node status` shows this many of its addresses and tasks (tasks_total counts
# all): keeps one entry under ~2.5 KB with the schema's longest strings.
STATUS_MAX_ADDRS = 4
STATUS_MAX_TASKS = 8
# How many peers (alive and gone) the view holds: ten times the largest cluster we run, and at
# ~1 KB a record, about 1 MB at most.
MAX_PEER_RECORDS = 1024
# How long a gone peer stays listed (for `node status` and a late look at who left): ten minutes.
GONE_TTL_S = 600.0
# Joins and departures are logged at INFO while the view holds at most this many peers, at DEBUG
# beyond: 9,000 throwaway identities wrote 9,000 "joined" lines (and as many "left").
LOG_PEERS_AT_INFO = 64
# The GPU probe imports torch (seconds of GIL) this long after start, once the mesh has formed:
# no event says "formed" for a node alone or still discovering, and 2 s covers a LAN join.
TORCH_PROBE_DELAY_S = 2.0

Publish = Callable[[str, Any], Awaitable[None]]


@dataclass
class PeerRecord:
    """What we know about one peer from its heartbeats."""

    peer_id: ID
    addrs: tuple[str, ...]
    caps: Capabilities
    tasks: tuple[str, ...]
    first_seen: float  # wall clock, for display
    last_seen: float  # trio clock, for liveness
    last_seen_wall: float
    alive: bool = True
    left_reason: str = ""
    left_at: float = 0.0  # trio clock, when marked gone
    heartbeats: int = 1  # heard since it (re)joined: what eviction ranks by
    # The sequence number of its Goodbye (-1: none): a heartbeat it sent before that, which gossip
    # may bring after the Goodbye by another route, does not make it alive again.
    left_seq: int = -1
    reachability: str = "unknown"  # what its last heartbeat said (public, private, unknown)

    def age(self) -> float:
        """Seconds since the last heartbeat."""
        return trio.current_time() - self.last_seen

    def as_json(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id.to_base58(),
            "alive": self.alive,
            "left_reason": self.left_reason or None,
            "last_heartbeat_age_s": round(self.age(), 3),
            "first_seen": self.first_seen,
            "addrs": list(self.addrs[:STATUS_MAX_ADDRS]),
            "tasks": list(self.tasks[:STATUS_MAX_TASKS]),
            "tasks_total": len(self.tasks),
            "reachability": self.reachability,
            "caps": {
                "device": self.caps.device,
                "gpu_name": self.caps.gpu_name,
                "gpu_memory_bytes": self.caps.gpu_memory_bytes,
                "cpu_count": self.caps.cpu_count,
                "free_ram_bytes": self.caps.free_ram_bytes,
                "version": self.caps.version,
                "builders": list(self.caps.builders),
            },
        }


@dataclass(frozen=True)
class MemberEvent:
    kind: Literal["join", "leave"]
    peer_id: ID
    reason: str = ""


@dataclass
class Membership:
    """The heartbeat sender and the liveness view; runs inside the node's nursery."""

    own_id: ID
    router: MessageRouter
    publish: Publish
    addrs: Callable[[], list[str]]
    interval: float = 1.0
    silence_heartbeats: int = DEFAULT_SILENCE_HEARTBEATS
    tasks: tuple[str, ...] = ()
    reachability: str = "unknown"  # ours, as the node's Reachability last found it
    caps: Capabilities = field(default_factory=caps_probe.quick_capabilities)
    # Where this node trains (its --device, set by the layer that knows it: train_on); the GPU
    # advertised is that one, and none where it is the CPU.
    device: str = "auto"
    # The model builders this node has, set by the layer that knows them (services: installed
    # packages' builders load with torch, after the mesh is up); sent in caps.builders.
    builders: tuple[str, ...] = ()
    # Set once the torch probe has refined caps (or failed): until then a GPU the driver's /proc
    # entries do not show reads as "cpu" (see caps_known).
    _probed: trio.Event = field(default_factory=trio.Event, init=False)
    _peers: dict[ID, PeerRecord] = field(default_factory=dict, init=False)
    _changed: trio.Event = field(default_factory=trio.Event, init=False)
    _wake: trio.Event = field(default_factory=trio.Event, init=False)
    _listeners: list[trio.MemorySendChannel[MemberEvent]] = field(default_factory=list, init=False)
    max_records: int = MAX_PEER_RECORDS
    gone_ttl: float = GONE_TTL_S
    evicted: int = field(default=0, init=False)  # records pushed out by a newcomer to a full view
    expired: int = field(default=0, init=False)  # gone records forgotten after gone_ttl
    # Events a listener was too far behind to take (one counter per reason, logged sparingly).
    dropped_events: Counter[str] = field(default_factory=Counter, init=False)

    def __post_init__(self) -> None:
        self.router.on(Heartbeat, self._on_heartbeat)
        self.router.on(Goodbye, self._on_goodbye)

    # -- the view ------------------------------------------------------------------------------

    def alive(self) -> list[PeerRecord]:
        """Peers heard from recently, oldest member first."""
        return [p for p in self._peers.values() if p.alive]

    def all(self) -> list[PeerRecord]:
        """Every peer ever heard from, gone ones included."""
        return list(self._peers.values())

    def get(self, peer_id: ID) -> PeerRecord | None:
        return self._peers.get(peer_id)

    async def wait_until(self, predicate: Callable[[Membership], bool]) -> None:
        """Return once ``predicate(self)`` holds; re-checked on every join and leave.

        Bound it yourself: ``with trio.fail_after(10): await m.wait_until(lambda m: ...)``.
        """
        while not predicate(self):
            await self._changed.wait()

    @asynccontextmanager
    async def events(self) -> AsyncIterator[trio.MemoryReceiveChannel[MemberEvent]]:
        """A channel of join/leave events from now on, for as long as the block runs."""
        send, receive = trio.open_memory_channel[MemberEvent](EVENT_QUEUE)
        self._listeners.append(send)
        try:
            async with receive:
                yield receive
        finally:
            self._listeners.remove(send)
            send.close()

    def _emit(self, event: MemberEvent) -> None:
        self._changed.set()
        self._changed = trio.Event()
        for send in self._listeners:
            try:
                send.send_nowait(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # a listener whose block is ending (its end closed, the send end not yet removed)
            except trio.WouldBlock:
                count_rejection(self.dropped_events, "listener-behind", logger, logging.WARNING,
                                "a membership listener is %d events behind; dropping one", EVENT_QUEUE)

    # -- receiving -----------------------------------------------------------------------------

    def _on_heartbeat(self, signed: Signed[Heartbeat], topic: str) -> None:
        hb, now = signed.msg, trio.current_time()
        record = self._peers.get(signed.sender)
        if record is not None and not record.alive and signed.seq < record.left_seq:
            logger.debug("peer %s: a heartbeat sent before its goodbye, heard after it: ignored", short_id(signed.sender))
            return
        if record is None or not record.alive:
            if record is None and len(self._peers) >= self.max_records:
                self._evict_one()
            self._peers[signed.sender] = PeerRecord(
                peer_id=signed.sender,
                addrs=hb.addrs,
                caps=hb.caps,
                tasks=hb.tasks,
                first_seen=time.time(),
                last_seen=now,
                last_seen_wall=time.time(),
                reachability=_reachability(hb),
            )
            logger.log(self._peer_log_level(), "peer %s joined (%s, %d addrs)", short_id(signed.sender), hb.caps.device,
                       len(hb.addrs))
            self._emit(MemberEvent("join", signed.sender))
            self.poke()  # let the newcomer hear from us now rather than in up to one interval
            return
        record.addrs, record.caps, record.tasks = hb.addrs, hb.caps, hb.tasks
        record.reachability = _reachability(hb)
        record.last_seen, record.last_seen_wall = now, time.time()
        record.heartbeats += 1

    def _peer_log_level(self) -> int:
        return logging.INFO if len(self._peers) <= LOG_PEERS_AT_INFO else logging.DEBUG

    def _evict_one(self) -> None:
        """Make room for a newcomer: the longest-gone peer, else the alive peer with the fewest
        heartbeats (the longest silent of those)."""
        gone = [r for r in self._peers.values() if not r.alive]
        if gone:
            victim = min(gone, key=lambda r: r.left_at)
        else:
            victim = min(self._peers.values(), key=lambda r: (r.heartbeats, r.last_seen))
        if victim.alive:
            self._mark_gone(victim.peer_id, "evicted: membership view full")
        del self._peers[victim.peer_id]
        self.evicted += 1

    def _on_goodbye(self, signed: Signed[Goodbye], topic: str) -> None:
        record = self._peers.get(signed.sender)
        if record is not None:
            record.left_seq = max(record.left_seq, signed.seq)
        self._mark_gone(signed.sender, f"goodbye: {signed.msg.reason}" if signed.msg.reason else "goodbye")

    def _mark_gone(self, peer_id: ID, reason: str) -> None:
        record = self._peers.get(peer_id)
        if record is None or not record.alive:
            return
        record.alive, record.left_reason = False, reason
        record.left_at = trio.current_time()
        logger.log(self._peer_log_level(), "peer %s left (%s)", short_id(peer_id), reason)
        self._emit(MemberEvent("leave", peer_id, reason))

    # -- sending -------------------------------------------------------------------------------

    def poke(self) -> None:
        """Send the next heartbeat now (e.g. a new connection wants to hear from us)."""
        self._wake.set()

    def heartbeat(self) -> Heartbeat:
        caps = replace(self.caps, builders=self.builders[:MAX_BUILDERS]) if self.builders else self.caps
        return Heartbeat(addrs=tuple(self.addrs()[:16]), caps=caps, tasks=self.tasks, reachability=self.reachability)

    async def say_goodbye(self, reason: str = "shutdown") -> None:
        await self.publish(MESH_TOPIC, Goodbye(reason=reason[:256]))

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self.router.join(MESH_TOPIC)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._refine_caps)
            nursery.start_soon(self._reap)
            task_status.started()
            await self._send_heartbeats()

    async def _send_heartbeats(self) -> None:
        while True:
            # A fresh event before sending: a poke that arrives while we send or pause is kept.
            self._wake = trio.Event()
            self.caps = caps_probe.refresh_ram(self.caps)
            await self.publish(MESH_TOPIC, self.heartbeat())
            await trio.sleep(MIN_HEARTBEAT_GAP_S)
            with trio.move_on_after(max(self.interval - MIN_HEARTBEAT_GAP_S, 0.0)):
                await self._wake.wait()

    async def _reap(self) -> None:
        """Mark peers silent for ``silence_heartbeats`` intervals as gone; forget those gone for
        longer than ``gone_ttl``."""
        limit = self.silence_heartbeats * self.interval
        while True:
            await trio.sleep(self.interval / 2)
            now = trio.current_time()
            for record in list(self._peers.values()):
                if record.alive and record.age() > limit:
                    self._mark_gone(record.peer_id, f"silent for {record.age():.1f} s")
                elif not record.alive and now - record.left_at > self.gone_ttl:
                    del self._peers[record.peer_id]
                    self.expired += 1

    def train_on(self, device: str) -> None:
        """Advertise the device this node trains on (``--device``), from the next heartbeat."""
        self.device = device
        if device == "cpu":
            self.caps = caps_probe.on_cpu(self.caps)

    async def caps_known(self) -> Capabilities:
        """This node's capabilities once the torch probe has run: a task that needs CUDA is checked
        against these, not the quick probe's (a machine whose driver has no /proc entries)."""
        await self._probed.wait()
        return self.caps

    async def _refine_caps(self) -> None:
        # Wait until the mesh has formed: the import competes for the GIL with the event loop.
        await trio.sleep(TORCH_PROBE_DELAY_S)
        try:
            self.caps = await trio.to_thread.run_sync(caps_probe.torch_capabilities, self.device,
                                                      abandon_on_cancel=True)
        except Exception as exc:  # a broken torch install must not stop the node; say so once
            logger.warning("could not probe torch for GPU capabilities: %s", exc)
        finally:
            self._probed.set()


def _reachability(hb: Heartbeat) -> str:
    """A heartbeat's reachability, anything but the three known values read as "unknown"."""
    return hb.reachability if hb.reachability in STATUSES else "unknown"
