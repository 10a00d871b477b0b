"""Circuit relay v2 (``/libp2p/circuit/relay/0.2.0/hop`` and ``…/stop``): how a peer nobody can dial
(behind a NAT) still takes part. py-libp2p's ``CircuitV2Protocol`` and ``CircuitV2Transport``,
wired the way the field notes found them to work.

Three roles, one object per node (:class:`Relaying`):

- every node *accepts* relayed connections (the stop protocol) and can *dial* a
  ``…/p2p-circuit/p2p/<peer>`` address (:meth:`Relaying.dial`); py-libp2p's swarm skips circuit
  addresses, so the mesh's discovery calls this for them;
- a node started with ``--relay-service`` *serves* (the hop protocol), within the limits it was
  given (:func:`relay_limits`; default :data:`LIMITS`);
- a private node *reserves* a slot on a relay (:meth:`Relaying.reserve`: an explicit reservation,
  which py-libp2p's auto-relay does not make reliably) and advertises
  ``<relay addr>/p2p-circuit/p2p/<own id>``; py-libp2p refreshes the reservation before it lapses;
- every node tries to *upgrade* a relayed connection to a direct one by hole punching (DCUtR,
  :class:`_HolePunching`), where both NATs let it through.

End to end: a relayed connection is a stream through the relay on which the two peers run the
same Noise handshake and yamux as on a direct one (``upgrade_outbound_connection`` /
``upgrade_inbound_connection``), so the relay forwards ciphertext and cannot stand in for either
peer (tests/net/test_relay.py checks that a plaintext marker never crosses it in clear).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from p2ptrain.base import short_id
from p2ptrain.net._relay_limits import (
    RELAY_CIRCUIT_BYTES_RANGE,
    RELAY_CIRCUIT_S_RANGE,
    RELAY_MAX_CIRCUIT_BYTES,
    RELAY_MAX_CIRCUIT_S,
    RELAY_MAX_CIRCUITS_PER_PEER,
    RELAY_MAX_RESERVATIONS,
    RELAY_RESERVATION_TTL_S,
    RELAY_RESERVATIONS_RANGE,
    bound_problem,
)

logger = logging.getLogger(__name__)

def relay_limits(
    max_reservations: int = RELAY_MAX_RESERVATIONS,
    max_circuit_s: int = RELAY_MAX_CIRCUIT_S,
    max_circuit_bytes: int = RELAY_MAX_CIRCUIT_BYTES,
) -> RelayLimits:
    """The limits a relay enforces per reservation: the three settable ones, and the fixed ones.
    Values outside the ``RELAY_*_RANGE`` bounds are the caller's error (ValueError)."""
    for name, value, bounds in (("max_reservations", max_reservations, RELAY_RESERVATIONS_RANGE),
                                ("max_circuit_s", max_circuit_s, RELAY_CIRCUIT_S_RANGE),
                                ("max_circuit_bytes", max_circuit_bytes, RELAY_CIRCUIT_BYTES_RANGE)):
        problem = bound_problem(value, bounds)
        if problem is not None:
            raise ValueError(f"{name} {problem}, got {value!r}")
    return RelayLimits(
        duration=max_circuit_s,
        data=max_circuit_bytes,
        max_circuit_conns=RELAY_MAX_CIRCUITS_PER_PEER,
        max_reservations=max_reservations,
        reservation_ttl=RELAY_RESERVATION_TTL_S,
    )


LIMITS = relay_limits()
# One reservation request or one relayed dial, start to finish (a few round trips).
RELAY_OP_TIMEOUT_S = 20.0

# Hole punching (DCUtR, see _HolePunching). Sessions others start with us that run at once: each
# makes us dial up to PUNCH_MAX_ADDRS addresses, 3 rounds; more are refused, not queued.
PUNCH_MAX_CONCURRENT = 4
# Addresses of a peer's CONNECT message we dial (its own NAT's address, perhaps one per IP family);
# the rest are ignored: a CONNECT is hostile, and each address costs a TCP connect.
PUNCH_MAX_ADDRS = 4
# Sessions one peer may start with us per connection to it (py-libp2p's initiator tries 3 times).
PUNCH_MAX_PER_PEER = 3


def is_circuit(addr: Multiaddr) -> bool:
    """Whether ``addr`` goes through a relay (has a ``/p2p-circuit`` part)."""
    return any(p.name == "p2p-circuit" for p in addr.protocols())


def over_relay(connection: Any) -> bool:
    """Whether a connection (a swarm connection, or the muxed connection a stream runs on) goes
    through a relay."""
    return any(is_circuit(a) for a in connection.get_transport_addresses())


def has_direct_connection(host: IHost, peer: ID) -> bool:
    """Whether ``host`` holds a connection to ``peer`` that does not go through a relay (after a
    hole punch, beside the relayed one it keeps)."""
    return any(not over_relay(c) for c in host.get_network().get_connections(peer))


class _CountingProtocol(CircuitV2Protocol):
    """py-libp2p's relay, counting the bytes it forwards (what serving costs, in `node status`)."""

    relayed_bytes = 0

    async def _read_stream_with_retry(self, stream: Any, *args: Any, **kwargs: Any) -> Any:
        data = await super()._read_stream_with_retry(stream, *args, **kwargs)
        self.relayed_bytes += len(data or b"")
        return data


class _HolePunching(DCUtRProtocol):
    """py-libp2p's DCUtR (``/libp2p/dcutr``: upgrade a relayed connection to a direct one by a TCP
    simultaneous open from both peers' listen ports), bounded for what others ask of us: a session
    only over a relayed connection (a direct one needs none, and it is how a peer could otherwise make
    us dial third parties at will), one per peer at a time and :data:`PUNCH_MAX_PER_PEER` per
    connection, :data:`PUNCH_MAX_CONCURRENT` at once, :data:`PUNCH_MAX_ADDRS` addresses dialed;
    refusals and results counted (``punch_*`` in ``node status`` ``relay``).

    py-libp2p drives it: every 2 s it starts a session with each peer connected only through a relay
    (up to 3 per peer); after a direct connection is verified, new streams prefer it. py-libp2p
    would also close the relayed connection 60 s later; we keep it (:meth:`_schedule_relay_close`).
    docs/nat.md says where it works (a NAT that drops unsolicited packets) and where not (one that
    answers them with a reset, or a symmetric NAT).
    """

    def __init__(self, host: IHost, counts: Counter[str]) -> None:
        super().__init__(host)
        self.counts = counts
        self._serving: set[ID] = set()  # peers whose session with us runs now (ours with them may too:
        # both peers' auto-drive may start one at once, and refusing either would fail both)
        self._inbound: Counter[ID] = Counter()

    def on_peer_disconnected(self, peer_id: ID) -> None:
        super().on_peer_disconnected(peer_id)
        self._inbound.pop(peer_id, None)

    async def _handle_dcutr_stream(self, stream: Any) -> None:
        peer = stream.muxed_conn.peer_id
        relayed = over_relay(stream.muxed_conn)
        why = ("not_relayed" if not relayed else "busy" if len(self._serving) >= PUNCH_MAX_CONCURRENT or peer in self._serving
               else "too_many" if self._inbound[peer] >= PUNCH_MAX_PER_PEER else None)
        if why is not None:
            self.counts[f"punch_refused_{why}"] += 1
            await stream.reset()
            return
        self._inbound[peer] += 1
        self._serving.add(peer)
        try:
            await super()._handle_dcutr_stream(stream)
        finally:
            self._serving.discard(peer)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[Multiaddr]:
        return super()._decode_observed_addrs(addr_bytes[:PUNCH_MAX_ADDRS])

    def _schedule_relay_close(self, peer_id: ID) -> None:
        """Keep the relayed connection after a punch: streams already on it (the collective's
        channels, reused round after round) stay there, and closing it under a round in flight
        failed that round and left a member out of the rest of the span (measured: bench/nat.py's
        firewalled layout, 3000 steps, docs/nat.md). It ends as any circuit does (its duration or
        byte limit, a peer leaving); streams opened after the punch use the direct connection."""

    async def _perform_hole_punch(self, *args: Any, **kwargs: Any) -> bool:
        ok = await super()._perform_hole_punch(*args, **kwargs)
        self.counts["punched" if ok else "punch_failed"] += 1
        if ok:
            logger.info("hole punched: a direct connection to %s replaces the relayed one", short_id(args[0]))
        return ok


class Relaying:
    """A node's relay roles (see the module); :meth:`run` for the node's lifetime. ``hole_punch``:
    run DCUtR (off in tests of the relay path itself, where a punch would replace the circuit)."""

    def __init__(self, host: IHost, serve: bool, limits: RelayLimits = LIMITS, hole_punch: bool = True) -> None:
        self.host = host
        self.serve = serve
        self.limits = limits
        self.protocol = _CountingProtocol(host, limits=limits, allow_hop=serve)
        # No CLIENT role: py-libp2p would then reserve a slot on the relay at every dial; our
        # reservations are explicit (reserve), made only by private nodes.
        roles = RelayRole.STOP | (RelayRole.HOP if serve else RelayRole(0))
        self.transport = CircuitV2Transport(host, self.protocol, RelayConfig(roles=roles, limits=limits))
        self.reserved: dict[ID, str] = {}  # relay -> the circuit address we advertise through it
        self.counts: Counter[str] = Counter()
        self.punching = _HolePunching(host, self.counts) if hole_punch else None
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.protocol):
            if self.punching is None:
                await self._serve(task_status)
            else:
                async with background_trio_service(self.punching):
                    await self._serve(task_status)

    async def _serve(self, task_status: Any) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    @property
    def addrs(self) -> list[str]:
        """The circuit addresses we can be dialed at (one per relay we hold a reservation on)."""
        return list(self.reserved.values())

    async def reserve(self, relay: ID, relay_addr: Multiaddr) -> bool:
        """Reserve a slot on ``relay`` (connected, reached at ``relay_addr``); True if it granted one."""
        if self._nursery is None:
            raise RuntimeError("Relaying is not running")
        try:
            with trio.fail_after(RELAY_OP_TIMEOUT_S):
                stream = await self.host.new_stream(relay, [HOP_PROTOCOL_ID])
                try:
                    ok = await self.transport.reserve(stream, relay, self._nursery)
                finally:
                    await stream.close()
        except Exception as exc:  # not a relay, or gone: the caller tries another
            self.counts["reserve_failed"] += 1
            logger.debug("no reservation on %s: %s", short_id(relay), exc)
            return False
        if not ok:
            self.counts["reserve_refused"] += 1
            return False
        base = str(relay_addr).split("/p2p/")[0]
        self.reserved[relay] = f"{base}/p2p/{relay.to_base58()}/p2p-circuit/p2p/{self.host.get_id().to_base58()}"
        self.counts["reserved"] += 1
        logger.info("reserved a relay slot on %s: reachable at %s", short_id(relay), self.reserved[relay])
        return True

    async def dial(self, addr: Multiaddr) -> None:
        """Connect through a relay to the peer a circuit address names (raises if it cannot)."""
        self.counts["dials"] += 1
        with trio.fail_after(RELAY_OP_TIMEOUT_S):
            await self.transport.dial(addr)
        self.counts["dialed"] += 1

    def relayed_peers(self) -> list[ID]:
        """Connected peers we reach only through a relay (no direct connection to them)."""
        return [p for p in self.host.get_connected_peers() if not has_direct_connection(self.host, p)]

    def stats(self) -> dict[str, Any]:
        served = {"limits": {"max_reservations": self.limits.max_reservations, "max_circuit_duration_s": self.limits.duration,
                             "max_circuit_bytes": self.limits.data}} if self.serve else {}
        return {"service": self.serve, **served, "relayed_peers": [short_id(p) for p in self.relayed_peers()],
                "reserved_on": [short_id(r) for r in self.reserved], "addrs": self.addrs,
                "relayed_bytes": self.protocol.relayed_bytes, **dict(self.counts)}
