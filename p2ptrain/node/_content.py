"""The node's content service: the embedded store, Bitswap to serve and fetch it, and control ops.

Providers: a fetch asks every connected peer (Bitswap wants go to all of them, and each answers only
for what it has), which on a training mesh of tens of peers is the fastest way to find who holds a
shard or a model, and *at the same time* asks the Kad-DHT (:mod:`p2ptrain.mesh._providers`), whose
providers join the fetch as soon as they are dialed. Whichever serves the DAG first wins; the
lookup is cancelled when the fetch ends, so a fetch among connected peers waits for nothing, and a
fetch no connected peer can serve (a fresh node that knows only its bootstrap peer) fails only once
the lookup is over too. For the DHT to know, the service announces the roots it holds (pinned at
start, added through it, fetched), not every block, and announces them again before records expire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from p2ptrain.base import UserError, fmt_bytes, short_id
from p2ptrain.ipfs import (
    BlockExchange,
    ContentStore,
    ContentUnavailable,
    DagError,
    EmbeddedStore,
    FetchError,
    FetchStats,
    PinFileError,
    dag_bytes_limit,
    open_store,
    parse_cid,
    requested_cid,
)
from p2ptrain.mesh import MAX_PROVIDERS_PER_QUERY, ContentRouting
from p2ptrain.control import ops as control_ops
from p2ptrain.node import Node

logger = logging.getLogger(__name__)

# Content we fetch on behalf of a task or a user is bounded, so a wrong CID cannot fill the disk.
DEFAULT_MAX_FETCH_BYTES = 8 * 1024**3
# A fetch asks the connected peers and the DHT in parallel, but the DHT lookup (a walk of streams
# to several peers) starts only once the connected peers had this long to answer for the root, or
# at once when they all refused it or none is connected. A peer that holds the root answers within a
# round trip or two (milliseconds on a LAN, ~0.3 s across continents); a lookup started beside
# such a fetch only competed with it for the event loop (measured: a 4 KiB fetch among connected
# peers 11 ms alone, 34 ms with a lookup started at once; bench/dht_fetch.py).
CONNECTED_HEAD_START_S = 0.5
# Keys announced on the DHT (and re-announced): the pins, adds and fetches of a node are far fewer;
# beyond the cap a key is not announced (counted in ``provide_dropped``).
MAX_PROVIDED_KEYS = 1024
# Announcements made in one go before the loop looks at its queue again: each walks the DHT (a few
# round trips, at most providers.PROVIDE_DEADLINE_S), one at a time, so they never flood the peers.
MAX_PROVIDES_PER_ROUND = 32
# Provider records live 48 h on py-libp2p peers and 24-48 h on Kubo's; announcing again every 12 h
# keeps every key findable with room for a missed round.
REPROVIDE_INTERVAL_S = 12 * 3600.0
# An announcement no peer took (no peer connected yet just after start, a lone node) is tried again
# after this long; the loop retries every key due by then, not one walk per key.
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
        # Totals of Bitswap fetches, for the metrics exporter (fetch throughput = bytes / seconds).
        self.fetch_totals: dict[str, float] = {"ok": 0, "failed": 0, "bytes": 0, "blocks": 0, "seconds": 0.0}
        # Content routing through the node's Kad-DHT (None with --no-dht, or with Kubo).
        self.routing: ContentRouting | None = None
        # Keys to announce on the DHT, each with the trio time it is due next; announce() wakes the loop.
        self._provide_due: dict[str, float] = {}
        self._provide_wanted = trio.Event()
        self.provide_dropped = 0  # keys not announced: MAX_PROVIDED_KEYS already were
        self.dht_fetches = 0  # fetches that got blocks from providers the DHT named
        node.control.register(control_ops.IPFS_FETCH, self._fetch_op)
        node.control.register(control_ops.IPFS_PROGRESS, self._progress_op)
        node.control.register(control_ops.IPFS_ADD, self._add_op)
        node.add_status("content", self._status)

    def _status(self) -> dict[str, Any]:
        """Bitswap's inbound refusals and what peers hold with us now (none with Kubo); the DHT's
        announcements and lookups."""
        return {
            "bitswap": self.exchange.stats() if self.exchange is not None else None,
            "dht": self.routing.stats() if self.routing is not None else None,
            "provided_keys": len(self._provide_due),
            "provide_dropped": self.provide_dropped,
            "dht_fetches": self.dht_fetches,
        }

    def announce(self, key: str) -> None:
        """Announce on the DHT (soon, then every REPROVIDE_INTERVAL_S) that we hold ``key``: a root
        CID, or a :func:`~p2ptrain.mesh.derived_key`. A no-op without the DHT."""
        if self.routing is None or key in self._provide_due:
            return
        if len(self._provide_due) >= MAX_PROVIDED_KEYS:
            self.provide_dropped += 1
            return
        self._provide_due[key] = trio.current_time()
        self._provide_wanted.set()

    async def _provide_loop(self, routing: ContentRouting) -> None:
        """Announce each key when it is due: at most MAX_PROVIDES_PER_ROUND at a time, again after
        REPROVIDE_INTERVAL_S when a peer took it; when none did, every key due by then after
        PROVIDE_RETRY_S (one failed walk per retry on a lone node, not one per key)."""
        try:
            pins = await trio.to_thread.run_sync(self.store.pin_ls)
        except PinFileError as exc:  # the pin commands report it; announcing is best effort
            logger.warning("not announcing pinned roots: %s", exc)
            pins = {}
        for cid in list(pins)[:MAX_PROVIDED_KEYS]:
            self.announce(cid)
        while True:
            ok = True
            now = trio.current_time()
            due = sorted((t, key) for key, t in self._provide_due.items() if t <= now)[:MAX_PROVIDES_PER_ROUND]
            for _, key in due:
                ok = await routing.provide(key)
                if not ok:  # no peer to take records (yet): the others would fail alike; all wait
                    retry = trio.current_time() + PROVIDE_RETRY_S
                    for waiting, at in self._provide_due.items():
                        self._provide_due[waiting] = max(at, retry)
                    break
                self._provide_due[key] = trio.current_time() + REPROVIDE_INTERVAL_S
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
        discovery = self.node.discovery
        if discovery is not None and discovery.dht is not None:
            self.routing = ContentRouting(discovery)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.exchange.run)
                if self.routing is not None:
                    nursery.start_soon(self._provide_loop, self.routing)
                self._ready.set()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.exchange = self.routing = None

    async def fetch(self, cid: str, *, timeout: float = 60.0, max_bytes: int = DEFAULT_MAX_FETCH_BYTES,
                    progress: Callable[[int], None] | None = None) -> None:
        """Make the DAG under ``cid`` local, asking every connected peer and the DHT at once; every
        block is verified. What was fetched is then announced. ``progress(bytes_so_far)`` is called
        as each verified block arrives (the CLI's temporary node shows it; ``ipfs.progress`` tells
        the same to a CLI whose home's node fetches).

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
                    kubo = self.kubo
                    await trio.to_thread.run_sync(lambda: kubo.cat(cid, max_bytes=max_bytes), abandon_on_cancel=True)
            except trio.TooSlowError:
                raise ContentUnavailable(cid, f"Kubo did not fetch it in {timeout:.0f} s") from None
            except DagError as exc:  # FileTooLarge: over the bound
                raise ContentUnavailable(cid, str(exc)) from None
            return
        assert self.exchange is not None and self.node.host is not None
        providers = list(self.node.host.get_connected_peers())
        if not providers and self.routing is None:
            raise ContentUnavailable(cid, "not held locally and no peer is connected")

        mine = [0]

        def arrived(n: int) -> None:
            self.fetching[cid] = self.fetching.get(cid, 0) + n
            if progress is not None:
                mine[0] += n
                progress(mine[0])

        self.fetching.setdefault(cid, 0)
        self._fetchers[cid] = self._fetchers.get(cid, 0) + 1
        try:
            with trio.fail_after(timeout):
                stats = await self._fetch_dag(cid, providers, max_bytes, arrived)
        except FetchError as exc:
            self.fetch_totals["failed"] += 1
            raise ContentUnavailable(cid, str(exc)) from None
        except trio.TooSlowError:
            self.fetch_totals["failed"] += 1
            raise ContentUnavailable(cid, f"fetch did not finish in {timeout:.0f} s") from None
        finally:
            self._fetchers[cid] -= 1
            if not self._fetchers[cid]:
                del self._fetchers[cid], self.fetching[cid]
        totals = self.fetch_totals
        totals["ok"] += 1
        totals["bytes"] += stats.bytes
        totals["blocks"] += stats.blocks
        totals["seconds"] += stats.seconds
        logger.debug("node %s fetched %s: %d blocks, %s in %.2f s from %d peer(s)", short_id(self.node.peer_id), cid,
                    stats.blocks, fmt_bytes(stats.bytes), stats.seconds, len(stats.per_provider))
        self.announce(cid)

    async def read(self, cid: str, *, max_bytes: int, timeout: float = 60.0) -> bytes:
        """The file ``cid``, fetched if need be, refused beyond ``max_bytes`` of content: the fetch
        ends once its blocks pass what a file of that size takes (``unixfs.dag_bytes_limit``) or its
        root declares more, and removes what it stored; the read stops at the bound too. For
        content whose honest size is known before it arrives (a model of the architecture a task
        names). Raises :class:`ContentUnavailable` naming the bound."""
        await self.fetch(cid, timeout=timeout, max_bytes=dag_bytes_limit(max_bytes))
        try:
            return await trio.to_thread.run_sync(lambda: self.store.cat(cid, max_bytes=max_bytes))
        except DagError as exc:  # FileTooLarge, or a DAG that is not a readable file
            raise ContentUnavailable(cid, str(exc)) from None

    async def _fetch_dag(
        self, cid: str, connected: list[ID], max_bytes: int, progress: Callable[[int], None]
    ) -> FetchStats:
        """The DAG from the connected peers and, in parallel, from the providers the DHT names
        (each joins the fetch once dialed). The lookup is cancelled when the fetch ends, so it
        never delays a fetch the connected peers serve. Raises FetchError."""
        assert self.exchange is not None
        routing = self.routing
        if routing is None:
            return await self.exchange.fetch_dag(parse_cid(cid), connected, max_bytes=max_bytes, progress=progress)
        found_send, found = trio.open_memory_channel[ID](MAX_PROVIDERS_PER_QUERY)
        root_settled = trio.Event()
        received = [0]

        def counted(n: int) -> None:
            received[0] += n
            progress(n)

        async def search() -> None:
            """The DHT lookup, unless the connected peers served the root within their head start."""
            with trio.move_on_after(CONNECTED_HEAD_START_S):
                await root_settled.wait()
            if received[0]:
                found_send.close()  # the connected peers hold the DAG: no search needed
                return
            await routing.find_and_connect(cid, set(connected), found_send)

        stats: FetchStats | None = None
        failure: FetchError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(search)
            try:
                async with found:
                    stats = await self.exchange.fetch_dag(parse_cid(cid), connected, max_bytes=max_bytes,
                                                          progress=counted, more_providers=found,
                                                          root_settled=root_settled)
            except FetchError as exc:  # raised here, not from the nursery (it would wrap it in a group)
                failure = exc
            finally:
                nursery.cancel_scope.cancel()  # first useful answer wins: the lookup is not needed
        if failure is not None:
            raise failure
        assert stats is not None
        if set(stats.per_provider) - {short_id(p) for p in connected}:
            self.dht_fetches += 1
        return stats

    async def _fetch_op(self, request: dict[str, Any]) -> dict[str, Any]:
        cid = requested_cid(request.get("cid", ""))
        timeout = float(request.get("timeout", 60.0))
        try:
            await self.fetch(cid, timeout=timeout)
        except ContentUnavailable as exc:
            raise UserError(f"cannot fetch {exc}") from None
        return {"cid": cid}

    async def _progress_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """How far the fetch of ``cid`` is (the CLI asks while its ``ipfs.fetch`` runs): bytes
        fetched and verified so far, or ``fetching: false`` when no fetch of it is in flight."""
        cid = requested_cid(request.get("cid", ""))
        if cid not in self.fetching:
            return {"cid": cid, "fetching": False, "bytes": 0}
        return {"cid": cid, "fetching": True, "bytes": self.fetching[cid]}

    async def _add_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """Store a small payload (task files go this way from the CLI); big files use the home's store."""
        data = str(request.get("text", "")).encode()
        cid = await trio.to_thread.run_sync(self.store.add_bytes, data)
        self.announce(cid)
        return {"cid": cid}

