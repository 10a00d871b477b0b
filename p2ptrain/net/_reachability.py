"""Whether other peers can dial us: ``public``, ``private`` (behind a NAT or a firewall) or
``unknown``, from libp2p AutoNAT (``/libp2p/autonat/1.0.0``, py-libp2p's AutoNATService).

A node asks up to :data:`MAX_SERVERS` connected peers to dial it back at its listen addresses and
counts their verdicts. Every node also answers such requests, under AutoNAT's own rules: it dials
only addresses at the requester's observed IP (no amplification against a third party) and
refuses requests that arrive through a relay.

Why the dial-back is ours (:meth:`DialBackService._try_dial`): py-libp2p's server dials back with
``host.connect``, which returns at once when a connection to the peer already exists (always: the
request arrived on one), so every peer whose advertised address equals its observed one would be
told "public", a firewalled one included. Ours opens a *fresh* TCP connection to the address and
closes it: proof that the address accepts connections from outside, which is what reachability
means (the Noise handshake that follows a real dial is not needed to know that).

Verdicts: ``public`` when at least :data:`CONFIRMATIONS` peers reached us, ``private`` when that
many could not and fewer reached us, else ``unknown`` (also in a mesh of two: one answer is not
enough). A peer on the same LAN behind the same NAT does reach us (directly): needing two answers
is what keeps one such neighbour, perhaps the only peer we are connected to at the first check,
from making a private peer "public".
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import trio
from libp2p.abc import IHost
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from p2ptrain.base import short_id

logger = logging.getLogger(__name__)

Status = Literal["public", "private", "unknown"]
STATUSES: tuple[Status, ...] = ("public", "private", "unknown")

# Peers asked per check: enough for a majority, few enough that a check of a large mesh costs a
# handful of streams (and each asked peer one TCP connect per address).
MAX_SERVERS = 5
# Verdicts that must agree: 2, so one LAN neighbour (who reaches a private peer directly) or one
# lying peer cannot flip the answer alone. AutoNAT's spec says "more than three", for the public
# internet's thousands of servers; a training mesh may have three peers.
CONFIRMATIONS = 2
# One dial-back request, from our stream open to its answer: the server's TCP connects to us take
# at most DIAL_BACK_TIMEOUT_S per address, for at most MAX_DIAL_BACK_ADDRS addresses.
QUERY_TIMEOUT_S = 20.0
# One TCP connect of a dial-back (a reachable address answers in milliseconds, even loaded).
DIAL_BACK_TIMEOUT_S = 3.0
# Addresses of one request we try to connect to; the rest are ignored (a request is hostile).
MAX_DIAL_BACK_ADDRS = 4
# Dial-backs we run at once for others; more requests are refused ("busy"), not queued.
MAX_CONCURRENT_DIAL_BACKS = 4
# First check this long after the node starts (its bootstrap connections are up by then), then
# every CHECK_INTERVAL_S; while unknown (too few peers yet) every RETRY_INTERVAL_S.
FIRST_CHECK_DELAY_S = 1.0
RETRY_INTERVAL_S = 5.0
CHECK_INTERVAL_S = 120.0


def decide(reached: int, unreached: int) -> Status:
    """The verdict from how many asked peers reached us and how many could not (see the module)."""
    if reached >= CONFIRMATIONS:
        return "public"
    if unreached >= CONFIRMATIONS:
        return "private"
    return "unknown"


class DialBackService(AutoNATService):
    """py-libp2p's AutoNAT service with a fresh-connection dial-back and a bound on concurrent
    dial-backs (both sides: we serve others and ask others)."""

    def __init__(self, host: IHost) -> None:
        super().__init__(host, serve=True)  # type: ignore[arg-type]
        self._limiter = trio.CapacityLimiter(MAX_CONCURRENT_DIAL_BACKS)
        self.served: Counter[str] = Counter()

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        try:
            self._limiter.acquire_nowait()
        except trio.WouldBlock:
            self.served["busy"] += 1
            return None
        try:
            for raw in addrs[:MAX_DIAL_BACK_ADDRS]:
                target = _tcp_target(raw)
                if target is None:
                    continue
                with trio.move_on_after(DIAL_BACK_TIMEOUT_S):
                    try:
                        stream = await trio.open_tcp_stream(*target)
                    except OSError:
                        continue
                    await stream.aclose()
                    self.served["reached"] += 1
                    return raw
            self.served["unreached"] += 1
            return None
        finally:
            self._limiter.release()


def _tcp_target(raw: bytes) -> tuple[str, int] | None:
    """``(ip, port)`` of an ``/ip4|ip6/…/tcp/…`` address, or None for anything else (or garbage)."""
    try:
        addr = Multiaddr(raw)
        port = int(addr.value_for_protocol("tcp"))
        for proto in ("ip4", "ip6"):
            try:
                return str(addr.value_for_protocol(proto)), port
            except Exception:
                continue
    except Exception:
        return None
    return None


class Reachability:
    """Our reachability, re-checked for the node's lifetime (:meth:`run`); :attr:`status` is what
    `node status --json` and our heartbeats say."""

    def __init__(self, host: IHost, peers: Callable[[], list[ID]]) -> None:
        self.service = DialBackService(host)
        self._peers = peers
        self.status: Status = "unknown"
        self.checks = 0
        self.last: dict[str, int] = {"reached": 0, "unreached": 0}
        self.changed = trio.Event()  # set (and replaced) each time status changes

    async def check(self) -> Status:
        """Ask up to MAX_SERVERS of the peers we are connected to; update and return the status."""
        peers = self._peers()
        asked = random.sample(peers, min(MAX_SERVERS, len(peers)))
        reached = unreached = 0
        for peer in asked:
            try:
                status, _ = await self.service.query_server(peer, timeout=QUERY_TIMEOUT_S)
            except Exception as exc:  # a peer that cannot answer (or times out) gives no verdict
                logger.debug("reachability: %s did not answer: %s", short_id(peer), exc)
                continue
            if status == Message.OK:
                reached += 1
            else:
                unreached += 1
        self.checks += 1
        self.last = {"reached": reached, "unreached": unreached}
        new = decide(reached, unreached)
        if new != self.status and not (new == "unknown" and self.status != "unknown"):
            logger.info("reachability: %s (%d of %d asked peers reached us)", new, reached, reached + unreached)
            self.status = new
            self.changed.set()
            self.changed = trio.Event()
        return self.status

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(FIRST_CHECK_DELAY_S)
        while True:
            status = await self.check()
            await trio.sleep(CHECK_INTERVAL_S if status != "unknown" else RETRY_INTERVAL_S)

    def stats(self) -> dict[str, Any]:
        return {"status": self.status, "checks": self.checks, "last": dict(self.last),
                "served": dict(self.service.served)}
