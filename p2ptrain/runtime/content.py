"""The node's content service: the embedded store, Bitswap to serve and fetch it, and control ops.

Providers are not looked up in a routing table: every connected peer of the mesh is asked (Bitswap
wants go to all of them, and each answers only for what it has), which on a training mesh of tens of
peers is both the fastest and the simplest way to find who holds a shard or a model.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from p2ptrain.errors import UserError
from p2ptrain.ipfs.cid import parse_cid
from p2ptrain.ipfs.embedded import EmbeddedStore
from p2ptrain.ipfs.exchange import BlockExchange, FetchError
from p2ptrain.ipfs.store import ContentStore, ContentUnavailable, open_store
from p2ptrain.logs import fmt_bytes, short_id
from p2ptrain.net import control_ops
from p2ptrain.node import Node

logger = logging.getLogger(__name__)

# Content we fetch on behalf of a task or a user is bounded, so a wrong CID cannot fill the disk.
DEFAULT_MAX_FETCH_BYTES = 8 * 1024**3


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
        node.control.register(control_ops.IPFS_FETCH, self._fetch_op)
        node.control.register(control_ops.IPFS_PROGRESS, self._progress_op)
        node.control.register(control_ops.IPFS_ADD, self._add_op)
        node.add_status("content", self._status)

    def _status(self) -> dict[str, Any]:
        """Bitswap's inbound refusals and what peers hold with us now (none with Kubo)."""
        return {"bitswap": self.exchange.stats() if self.exchange is not None else None}

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
        providers = list(self.node.host.get_connected_peers())
        if not providers:
            raise ContentUnavailable(cid, "not held locally and no peer is connected")

        def progress(n: int) -> None:
            self.fetching[cid] = self.fetching.get(cid, 0) + n

        self.fetching.setdefault(cid, 0)
        self._fetchers[cid] = self._fetchers.get(cid, 0) + 1
        try:
            with trio.fail_after(timeout):
                stats = await self.exchange.fetch_dag(parse_cid(cid), providers, max_bytes=max_bytes,
                                                      progress=progress)
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
        return {"cid": cid}


def _cid_of(request: dict[str, Any]) -> str:
    """The request's ``cid``, refused in one line unless it parses as a CID."""
    cid = str(request.get("cid", ""))
    try:
        parse_cid(cid)
    except Exception:
        raise UserError(f"{cid!r} is not a CID") from None
    return cid

