"""The node's content service: the embedded store, Bitswap to serve and fetch it, and control ops.

Providers are first the connected peers: every one of them is asked (Bitswap wants go to all of
them, and each answers only for what it has), which on a training mesh of tens of peers is both the
fastest and the simplest way to find who holds a shard or a model. When none of them has the root,
the Kad-DHT is asked for providers (peers we are not connected to: a fresh node that knows only its
bootstrap peer), and the fetch goes on from them. For that to work the service announces on the DHT
the roots it holds (pinned at start, added through it, fetched), not every block, and announces them
again before the records expire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from p2ptrain.errors import UserError
from p2ptrain.ipfs.blockstore import PinFileError
from p2ptrain.ipfs.cid import parse_cid
from p2ptrain.ipfs.embedded import EmbeddedStore
from p2ptrain.ipfs.exchange import BlockExchange, FetchError, FetchStats
from p2ptrain.ipfs.store import ContentStore, ContentUnavailable, open_store
from p2ptrain.logs import short_id
from p2ptrain.mesh.discovery import Discovery
from p2ptrain.net import control_ops
from p2ptrain.node import Node

logger = logging.getLogger(__name__)

# Content we fetch on behalf of a task or a user is bounded, so a wrong CID cannot fill the disk.
DEFAULT_MAX_FETCH_BYTES = 8 * 1024**3
# Root CIDs announced on the DHT (and re-announced): pins, adds and fetches of a node are far
# fewer; beyond the cap a root is not announced (counted in ``provide_dropped``).
MAX_PROVIDED_ROOTS = 1024
# Announcements made in one go before the loop looks at its queue again: each walks the DHT (a few
# round trips, at most discovery.PROVIDE_TIMEOUT_S), so 32 at a time never floods the peers.
MAX_PROVIDES_PER_ROUND = 32
# Provider records live 48 h on py-libp2p peers and 24-48 h on Kubo's; announcing again every 12 h
# keeps every root findable with room for a missed round.
REPROVIDE_INTERVAL_S = 12 * 3600.0
# An announcement no peer took (the routing table still empty just after start, a lone node) is
# tried again after this long.
PROVIDE_RETRY_S = 2.0


class ContentService:
    """Runs for the node's lifetime; other services call :meth:`fetch` and use :attr:`store`."""

    def __init__(self, node: Node, ipfs_api: str | None = None) -> None:
        self.node = node
        # With a Kubo daemon, Kubo stores and exchanges the blocks (on its own network, e.g. one
        # daemon shared by a cluster) and we verify what it returns; else the embedded store + Bitswap.
        self.kubo: ContentStore | None = open_store(node.home, ipfs_api) if ipfs_api else None
        self.store: ContentStore = self.kubo or EmbeddedStore(node.home)
        self.exchange: BlockExchange | None = None
        self._ready = trio.Event()
        # Block bytes fetched and verified so far of each DAG being fetched now, by root CID, for
        # `ipfs.progress`: as many entries as fetches in flight, each gone when its last fetch ends.
        self.fetching: dict[str, int] = {}
        self._fetchers: dict[str, int] = {}
        # Roots to announce on the DHT, each with the trio time it is due next; announce() wakes the loop.
        self._provide_due: dict[str, float] = {}
        self._provide_wanted = trio.Event()
        self.provide_dropped = 0  # roots not announced: MAX_PROVIDED_ROOTS already were
        self.dht_fetches = 0  # fetches that got their DAG from providers the DHT found
        node.control.register(control_ops.IPFS_FETCH, self._fetch_op)
        node.control.register(control_ops.IPFS_PROGRESS, self._progress_op)
        node.control.register(control_ops.IPFS_ADD, self._add_op)
        node.add_status("content", self._status)

    def _status(self) -> dict[str, Any]:
        """Bitswap's inbound refusals and what peers hold with us now (none with Kubo)."""
        return {
            "bitswap": self.exchange.stats() if self.exchange is not None else None,
            "provided_roots": len(self._provide_due),
            "provide_dropped": self.provide_dropped,
            "dht_fetches": self.dht_fetches,
        }

    @property
    def _discovery(self) -> Discovery | None:
        """The node's discovery when it runs the Kad-DHT (else content routing is off)."""
        discovery = self.node.discovery
        return discovery if discovery is not None and discovery.dht is not None else None

    def announce(self, cid: str) -> None:
        """Announce on the DHT (soon, then every REPROVIDE_INTERVAL_S) that we hold the DAG ``cid``."""
        if cid in self._provide_due:
            return
        if len(self._provide_due) >= MAX_PROVIDED_ROOTS:
            self.provide_dropped += 1
            return
        self._provide_due[cid] = trio.current_time()
        self._provide_wanted.set()

    async def _provide_loop(self) -> None:
        """Announce each root when it is due: at most MAX_PROVIDES_PER_ROUND at a time, again after
        REPROVIDE_INTERVAL_S when a peer took it; when none did, every root due by then after
        PROVIDE_RETRY_S (one failed walk per retry on a lone node, not one per root)."""
        try:
            pins = await trio.to_thread.run_sync(self.store.pin_ls)
        except PinFileError as exc:  # the pin commands report it; announcing is best effort
            logger.warning("not announcing pinned roots: %s", exc)
            pins = {}
        for cid in list(pins)[:MAX_PROVIDED_ROOTS]:
            self.announce(cid)
        while True:
            discovery, ok = self._discovery, True
            now = trio.current_time()
            due = sorted((t, cid) for cid, t in self._provide_due.items() if t <= now)[:MAX_PROVIDES_PER_ROUND]
            for _, cid in due:
                ok = discovery is not None and await discovery.provide(cid)
                if not ok:  # no peer to take records (yet): the others would fail alike; all wait
                    retry = trio.current_time() + PROVIDE_RETRY_S
                    for waiting, at in self._provide_due.items():
                        self._provide_due[waiting] = max(at, retry)
                    break
                self._provide_due[cid] = trio.current_time() + REPROVIDE_INTERVAL_S
            if due and ok:
                continue
            self._provide_wanted = trio.Event()
            next_due = min(self._provide_due.values(), default=now + REPROVIDE_INTERVAL_S)
            with trio.move_on_at(next_due):
                await self._provide_wanted.wait()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        assert self.node.host is not None
        if self.kubo is not None:
            self._ready.set()
            task_status.started()
            return
        assert isinstance(self.store, EmbeddedStore)
        self.exchange = BlockExchange(self.node.host, self.store.blocks)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.exchange.run)
                if self._discovery is not None:
                    nursery.start_soon(self._provide_loop)
                self._ready.set()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.exchange = None

    async def fetch(self, cid: str, *, timeout: float = 60.0, max_bytes: int = DEFAULT_MAX_FETCH_BYTES) -> None:
        """Make the DAG under ``cid`` local, asking every connected peer; every block is verified.

        Raises :class:`ContentUnavailable` naming the CID and the reason when nobody can provide it.
        """
        await self._ready.wait()
        if await trio.to_thread.run_sync(self.store.has, cid):
            return
        if self.kubo is not None:
            try:
                with trio.fail_after(timeout):
                    # Pinning makes Kubo fetch the whole DAG; cat then verifies it block by block.
                    await trio.to_thread.run_sync(self.kubo.pin_add, cid, abandon_on_cancel=True)
                    await trio.to_thread.run_sync(self.kubo.cat, cid, abandon_on_cancel=True)
            except trio.TooSlowError:
                raise ContentUnavailable(cid, f"Kubo did not fetch it in {timeout:.0f} s") from None
            return
        assert self.exchange is not None and self.node.host is not None
        connected = list(self.node.host.get_connected_peers())
        if not connected and self._discovery is None:
            raise ContentUnavailable(cid, "not held locally and no peer is connected")

        def progress(n: int) -> None:
            self.fetching[cid] = self.fetching.get(cid, 0) + n

        self.fetching.setdefault(cid, 0)
        self._fetchers[cid] = self._fetchers.get(cid, 0) + 1
        try:
            with trio.fail_after(timeout):
                stats = await self._fetch_from_connected_then_dht(cid, connected, max_bytes, progress)
        except FetchError as exc:
            raise ContentUnavailable(cid, str(exc)) from None
        except trio.TooSlowError:
            raise ContentUnavailable(cid, f"fetch did not finish in {timeout:.0f} s") from None
        finally:
            self._fetchers[cid] -= 1
            if not self._fetchers[cid]:
                del self._fetchers[cid], self.fetching[cid]
        logger.info("node %s fetched %s: %s", short_id(self.node.peer_id), cid, stats)
        self.announce(cid)

    async def _fetch_from_connected_then_dht(
        self, cid: str, connected: list[ID], max_bytes: int, progress: Callable[[int], None]
    ) -> FetchStats:
        """The DAG from the connected peers; when none of them has it (every one refused or none is
        connected), from the providers the DHT names (dialed by the exchange). Raises FetchError."""
        assert self.exchange is not None
        root = parse_cid(cid)
        refused: FetchError | None = None
        if connected:
            try:
                return await self.exchange.fetch_dag(root, connected, max_bytes=max_bytes, progress=progress)
            except FetchError as exc:
                refused = exc
        discovery = self._discovery
        found = await discovery.find_providers(cid) if discovery is not None else []
        found = [info for info in found if info.peer_id not in connected]
        if not found:
            if refused is not None:
                raise refused
            raise ContentUnavailable(cid, "no peer is connected and the DHT names no provider")
        logger.info("the DHT names %d provider(s) of %s: %s", len(found), cid,
                    ", ".join(short_id(info.peer_id) for info in found))
        stats = await self.exchange.fetch_dag(root, found, max_bytes=max_bytes, progress=progress)
        self.dht_fetches += 1
        return stats

    async def _fetch_op(self, request: dict[str, Any]) -> dict[str, Any]:
        cid = _cid_of(request)
        timeout = float(request.get("timeout", 60.0))
        try:
            await self.fetch(cid, timeout=timeout)
        except ContentUnavailable as exc:
            raise UserError(f"cannot fetch {exc}") from None
        return {"cid": cid}

    async def _progress_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """How far the fetch of ``cid`` is (the CLI asks while its ``ipfs.fetch`` runs): bytes
        fetched and verified so far, or ``fetching: false`` when no fetch of it is in flight."""
        cid = _cid_of(request)
        if cid not in self.fetching:
            return {"cid": cid, "fetching": False, "bytes": 0}
        return {"cid": cid, "fetching": True, "bytes": self.fetching[cid]}

    async def _add_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """Store a small payload (task files go this way from the CLI); big files use the home's store."""
        data = str(request.get("text", "")).encode()
        cid = await trio.to_thread.run_sync(self.store.add_bytes, data)
        self.announce(cid)
        return {"cid": cid}


def _cid_of(request: dict[str, Any]) -> str:
    """The request's ``cid``, refused in one line unless it parses as a CID."""
    cid = str(request.get("cid", ""))
    try:
        parse_cid(cid)
    except Exception:
        raise UserError(f"{cid!r} is not a CID") from None
    return cid
