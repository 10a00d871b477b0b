"""Content routing through the Kad-DHT: announce what we hold, find who holds what we want.

Why the DHT and not only the connected peers: on a training mesh heartbeats connect everyone, so
asking the connected peers (Bitswap wants go to all of them) finds a holder at once. A fresh node
that knows only its bootstrap peer, a mesh past ``discovery.MAX_KEPT_PEERS``, or a run that has
ended (its members no longer heartbeat on one topic) leaves the holder unconnected; the DHT names it.

What a DHT peer tells us is hostile: it can name any number of "providers" (py-libp2p reads a
response of at most 4 MiB, ``MAX_DHT_MESSAGE_SIZE``, and stops a lookup at the ``count`` we ask
for), each with any addresses, and can stretch a lookup with endless "closer peers". So a lookup is
bounded in time (``FIND_DEADLINE_S``), we take at most ``MAX_PROVIDERS_PER_QUERY`` providers, dial
at most ``discovery.MAX_DIAL_ADDRS_PER_PEER`` TCP addresses of each through the node's bounded dialer
(``MAX_CONCURRENT_DIALS`` at once), all within ``DIAL_DEADLINE_S``. Everything a provider then sends
is verified block by block by the exchange, so a lying record costs a dial, never content.

Keys: a content root is announced under its CID's multihash (what Kubo and py-libp2p key provider
records by); other keys (a task's heads, :func:`derived_key`) are a sha2-256 multihash of a
namespaced name, so they never collide with a CID's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2ptrain.base import short_id
from p2ptrain.mesh._discovery import Discovery, dialable

logger = logging.getLogger(__name__)

# One announcement walks the DHT towards the key and sends ADD_PROVIDER to the closest peers
# (py-libp2p waits up to 10 s per peer, QUERY_TIMEOUT): on a mesh of tens of peers a few round trips;
# 10 s bounds a walk through unresponsive peers.
PROVIDE_DEADLINE_S = 10.0
# One provider lookup: a few round trips on a mesh (tens of milliseconds on loopback). It runs
# beside the connected peers' answer, so it delays only a fetch none of them can serve; 5 s bounds
# a walk through dead or stalling peers (a failing fetch fails at most this much later).
FIND_DEADLINE_S = 5.0
# Providers taken from one lookup: a handful is plenty to fetch from, and each may be dialed.
MAX_PROVIDERS_PER_QUERY = 8
# Dialing the providers of one lookup (in parallel, through the node's bounded dialer).
DIAL_DEADLINE_S = 10.0
# Namespace of derived keys: sha2-256 of this plus a name (e.g. a task CID) is the DHT key.
DERIVED_KEY_PREFIX = b"/p2ptrain/"


def derived_key(kind: str, name: str) -> str:
    """A DHT key (a sha2-256 multihash, hex) for ``name`` in namespace ``kind``, e.g. a task's heads."""
    digest = hashlib.sha256(DERIVED_KEY_PREFIX + kind.encode() + b"/" + name.encode()).digest()
    return (bytes([0x12, 0x20]) + digest).hex()


class ContentRouting:
    """Provide and find through the node's Kad-DHT; every failure counted, never raised."""

    def __init__(self, discovery: Discovery) -> None:
        assert discovery.dht is not None
        self.discovery = discovery
        self.dht = discovery.dht
        self._own = discovery.host.get_id()
        self.provides = 0  # announcements at least one peer took
        self.provide_failures = 0  # ... and those no peer took, or that ran out of time
        self.lookups = 0
        self.lookup_failures = 0  # lookups that named no provider (or ran out of time)
        self.providers_found = 0  # providers lookups named (at most MAX_PROVIDERS_PER_QUERY each)
        self.provider_dials = 0  # found providers we connected to
        self.provider_dial_failures = 0

    def stats(self) -> dict[str, int]:
        return {
            "provides": self.provides,
            "provide_failures": self.provide_failures,
            "lookups": self.lookups,
            "lookup_failures": self.lookup_failures,
            "providers_found": self.providers_found,
            "provider_dials": self.provider_dials,
            "provider_dial_failures": self.provider_dial_failures,
        }

    async def provide(self, key: str) -> bool:
        """Announce that we hold ``key`` (a CID, or a :func:`derived_key`); True when a peer took it."""
        ok = False
        with trio.move_on_after(PROVIDE_DEADLINE_S):
            try:
                ok = await self.dht.provide(key)
            except Exception as exc:  # the remote peers' answers are hostile input
                logger.debug("DHT provide %s failed: %s", key, exc)
        if ok:
            self.provides += 1
        else:
            self.provide_failures += 1
        return ok

    async def find(self, key: str, exclude: Collection[ID] = ()) -> list[PeerInfo]:
        """Providers of ``key`` other than us and ``exclude`` (at most MAX_PROVIDERS_PER_QUERY, each
        with at most MAX_DIAL_ADDRS_PER_PEER TCP addresses); [] on failure or after FIND_DEADLINE_S."""
        self.lookups += 1
        found: list[PeerInfo] = []
        with trio.move_on_after(FIND_DEADLINE_S):
            try:
                found = await self.dht.find_providers(key, MAX_PROVIDERS_PER_QUERY + 1 + len(exclude))
            except Exception as exc:
                logger.debug("DHT find_providers %s failed: %s", key, exc)
        out: list[PeerInfo] = []
        for info in found:
            if info.peer_id == self._own or info.peer_id in exclude or any(o.peer_id == info.peer_id for o in out):
                continue
            out.append(PeerInfo(info.peer_id, dialable([str(a) for a in info.addrs], info.peer_id)))
            if len(out) >= MAX_PROVIDERS_PER_QUERY:
                break
        if out:
            self.providers_found += len(out)
        else:
            self.lookup_failures += 1
        return out

    async def connect(self, info: PeerInfo) -> bool:
        """Dial a found provider (the node's bounded dialer); True when connected."""
        ok = False
        with trio.move_on_after(DIAL_DEADLINE_S):
            ok = await self.discovery.dial(info.peer_id, info.addrs)
        if ok:
            self.provider_dials += 1
        else:
            self.provider_dial_failures += 1
            logger.debug("could not dial provider %s", short_id(info.peer_id))
        return ok

    async def find_and_connect(self, key: str, exclude: Collection[ID], found: trio.MemorySendChannel[ID]) -> None:
        """Look ``key`` up and send each provider to ``found`` as soon as it is connected; closes
        ``found`` when the lookup and its dials are over (the receiver then knows no more come).
        ``found`` should hold MAX_PROVIDERS_PER_QUERY (it never blocks then); a receiver gone is fine."""
        async with found:
            providers = await self.find(key, exclude)
            if providers:
                logger.info("the DHT names %d provider(s) of %s: %s", len(providers), key,
                            ", ".join(short_id(info.peer_id) for info in providers))

            async def connect(info: PeerInfo) -> None:
                if await self.connect(info):
                    try:
                        found.send_nowait(info.peer_id)
                    except (trio.WouldBlock, trio.BrokenResourceError):
                        pass  # the fetch is over, or holds as many providers as one query may name

            async with trio.open_nursery() as nursery:
                for info in providers:
                    nursery.start_soon(connect, info)
