"""One fetch from Bitswap providers: which blocks are wanted, who was asked for what, who is out.

A :class:`FetchSession` is the want-list side of :class:`~p2ptrain.ipfs.BlockExchange`:
it walks a DAG (or takes one block), asks each provider for at most ``window`` blocks at once,
takes a block only when its hash is one it asked for, and moves what a provider owed to the others
when that provider stalls, disconnects, says DontHave or sends something it should not. It talks
to the network only through the small :class:`Exchange` interface (send wants, is there a stream),
so the exchange's stream handling and serving side live elsewhere (``exchange.py``, ``serving.py``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from p2ptrain.ipfs._bitswap_wire import WantEntry, WireBlock
from p2ptrain.ipfs._cid import CID, DAG_PB, cid_str
from p2ptrain.ipfs._dagpb import DecodeError, PBNode, decode_node, decode_unixfs
from p2ptrain.ipfs._store import BlockSource
from p2ptrain.ipfs._unixfs import MAX_DEPTH
from p2ptrain.base import short_id

__all__ = ["DEFAULT_STALL_TIMEOUT", "DEFAULT_WINDOW", "Exchange", "FetchError", "FetchSession", "FetchStats"]

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 32  # blocks outstanding per provider: 8 MiB of 256 KiB leaves
DEFAULT_STALL_TIMEOUT = 10.0
_TICK = 0.25  # how often a fetch looks for stalled or disconnected providers
_WRITERS = 4  # blocks being written (and fsynced) at once by one fetch
CONTENT = "content"  # FetchError's reason key when the content, not a provider, is at fault


class FetchError(Exception):
    """A DAG could not be fetched: names the block, and what each provider did wrong."""

    def __init__(self, cid: CID, root: CID, reasons: dict[str, str]) -> None:
        self.cid = cid
        self.root = root
        self.reasons = reasons
        tried = "; ".join(f"{peer}: {why}" for peer, why in reasons.items()) or "no providers given"
        super().__init__(f"cannot fetch block {cid_str(cid)} of {cid_str(root)}: {tried}")

    @property
    def refused(self) -> bool:
        """The content itself was refused (over the size bound, malformed, too deep): no provider
        can help, and what the fetch stored of it is worth nothing."""
        return CONTENT in self.reasons


@dataclass
class FetchStats:
    """What one :meth:`BlockExchange.fetch_dag` did."""

    blocks: int = 0  # fetched over the network
    bytes: int = 0
    local_blocks: int = 0  # already held (a resumed fetch)
    seconds: float = 0.0
    per_provider: dict[str, int] = field(default_factory=dict)  # short peer id -> bytes received
    failed: dict[str, str] = field(default_factory=dict)  # short peer id -> why it was dropped


class Exchange(Protocol):
    """What a fetch needs of the exchange it runs in (:class:`~p2ptrain.ipfs.BlockExchange`)."""

    host: IHost
    store: BlockSource

    def send_wants(self, peer_id: ID, wants: Iterable[WantEntry]) -> None: ...

    def has_outbox(self, peer_id: ID) -> bool: ...

    def has_stream(self, peer_id: ID) -> bool: ...


class FetchSession:
    """One fetch_dag: which blocks are wanted, who was asked for what, who is out."""

    def __init__(
        self,
        exchange: Exchange,
        root: CID,
        providers: list[ID],
        window: int,
        stall_timeout: float,
        max_bytes: int | None,
        progress: Callable[[int], None] | None,
        recursive: bool,
        more_providers: trio.MemoryReceiveChannel[ID] | None = None,
        root_settled: trio.Event | None = None,
    ) -> None:
        self.ex = exchange
        self.root_settled = root_settled if root_settled is not None else trio.Event()
        self.more_providers = more_providers
        self.searching = more_providers is not None  # more providers may still come: refusals wait
        self.recursive = recursive
        self.root = root
        self.live = list(providers)
        self.window = window
        self.stall_timeout = stall_timeout
        self.max_bytes = max_bytes
        self.progress = progress
        self.unchecked: deque[CID] = deque([root])  # not yet looked up in the store
        # Every block this fetch has queued, by multihash, with its depth below the root: a block
        # linked many times (legal: Kubo's file of zeros) is looked up, asked for and walked once,
        # so a DAG costs one visit per distinct block; a block deeper than MAX_DEPTH ends the fetch.
        self.depth: dict[bytes, int] = {root.digest: 0}
        self.pending: deque[CID] = deque()  # known to be missing: to be asked for
        # Blocks are keyed by multihash (``cid.digest``): a CIDv0 and a CIDv1 of one block are one block.
        self.inflight: dict[ID, dict[bytes, CID]] = {p: {} for p in providers}
        self.owner: dict[bytes, ID] = {}  # multihash -> provider asked for it
        self.dont_have: dict[bytes, set[ID]] = {}
        self.done: set[bytes] = set()
        self.last_progress: dict[ID, float] = {}
        self.stats = FetchStats()
        self.fetched: list[CID] = []  # blocks this fetch got from providers (none was held before)
        self.reasons: dict[str, str] = {}
        self.changed = trio.Event()
        self.error: FetchError | None = None
        self._to_disk, self._from_net = trio.open_memory_channel[tuple[CID, bytes]](math.inf)

    async def run(self) -> FetchStats:
        start = trio.current_time()
        # The memory channel is unbounded in type only: at most window × providers blocks are in flight.
        taking = trio.CancelScope()
        if not self.live:
            self.root_settled.set()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write_blocks)
            if self.more_providers is not None:
                nursery.start_soon(self._take_providers, self.more_providers, taking)
            try:
                failure = await self._schedule()
            finally:
                taking.cancel()  # the fetch is over: whoever is found now is not needed
                self._to_disk.close()  # the writer still stores what arrived, so a retry resumes
        if failure is not None:
            raise failure
        self.stats.seconds = trio.current_time() - start
        self.stats.failed = dict(self.reasons)
        return self.stats

    async def _take_providers(self, more: trio.MemoryReceiveChannel[ID], scope: trio.CancelScope) -> None:
        """Add each provider found while the fetch runs; when the search ends, refusals count."""
        with scope:
            async for peer_id in more:
                if peer_id == self.ex.host.get_id() or peer_id in self.inflight:
                    continue  # already asked (or dropped): a second chance is not the search's to give
                self.live.append(peer_id)
                self.inflight[peer_id] = {}
                logger.debug("bitswap: fetch of %s adds provider %s", cid_str(self.root), short_id(peer_id))
                self.changed.set()
        self.searching = False
        self.changed.set()

    async def _schedule(self) -> FetchError | None:
        try:
            while True:
                if self.error is not None:
                    raise self.error
                self.changed = trio.Event()
                await self._sort_unchecked()
                if self.error is not None:  # a held block's links ended the walk (_queue_children)
                    raise self.error
                await self._assign()
                if not self.unchecked and not self.pending and not self.owner:
                    return None
                with trio.move_on_after(_TICK):
                    await self.changed.wait()
                self._check_providers()
        except FetchError as exc:
            return exc

    async def _assign(self) -> None:
        """Hand pending blocks to providers with room in their window."""
        batches: dict[ID, list[WantEntry]] = {}
        skipped: list[CID] = []
        while self.pending:
            room = {p: self.window - len(self.inflight[p]) for p in self.live}
            if not any(r > 0 for r in room.values()):
                break
            cid = self.pending.popleft()
            digest = cid.digest
            if digest in self.done or digest in self.owner:
                continue
            refused = self.dont_have.get(digest, set())
            if not self.live or all(p in refused for p in self.live):
                if digest == self.root.digest:
                    self.root_settled.set()
                if not self.searching:
                    raise self._failure(cid)
                skipped.append(cid)  # a provider still being searched for may have it
                continue
            candidates = [p for p in self.live if room[p] > 0 and p not in refused]
            if not candidates:
                skipped.append(cid)
                continue
            provider = max(candidates, key=room.__getitem__)
            if not self.inflight[provider]:
                self.last_progress[provider] = trio.current_time()
            self.inflight[provider][digest] = cid
            self.owner[digest] = provider
            batches.setdefault(provider, []).append(WantEntry(cid, send_dont_have=True))
        self.pending.extendleft(reversed(skipped))
        if not self.live and not self.searching and (self.pending or self.owner):
            raise self._failure(self.pending[0] if self.pending else self.root)
        for provider, wants in batches.items():
            self.ex.send_wants(provider, wants)

    async def _sort_unchecked(self) -> None:
        """Look new CIDs up in the store, in one worker-thread hop per batch (a stat each): held ones
        are resolved locally (an interrupted fetch resumes), missing ones wait for a provider."""
        while self.unchecked:
            batch = []
            while self.unchecked:
                cid = self.unchecked.popleft()
                if cid.digest not in self.done and cid.digest not in self.owner:
                    batch.append(cid)
            held = await trio.to_thread.run_sync(lambda: [self.ex.store.has(c) for c in batch])  # noqa: B023 - run at once
            for cid, is_held in zip(batch, held):
                if is_held:
                    await self._resolve_local(cid)
                else:
                    self.pending.append(cid)

    async def _resolve_local(self, cid: CID) -> None:
        """A block we already hold: nothing to fetch, but its children may still be missing."""
        if cid.digest == self.root.digest:
            self.root_settled.set()
        self.done.add(cid.digest)
        self.stats.local_blocks += 1
        if self.recursive and cid.codec.name == DAG_PB:
            data = await trio.to_thread.run_sync(self.ex.store.get, cid)
            self._queue_children(cid, data)

    def _queue_children(self, cid: CID, data: bytes) -> None:
        if not self.recursive or cid.codec.name != DAG_PB:
            return
        try:
            node = decode_node(data)
        except DecodeError as exc:
            # The block matches its hash, so the content itself is malformed: no provider can help.
            self.error = FetchError(cid, self.root, {CONTENT: f"not a valid dag-pb node: {exc}"})
            return
        if cid.digest == self.root.digest and self._declares_too_much(node):
            return
        depth = self.depth[cid.digest] + 1
        for link in node.links:
            if link.cid.digest in self.depth:
                continue
            if depth > MAX_DEPTH:
                self.error = FetchError(link.cid, self.root, {CONTENT: f"DAG deeper than {MAX_DEPTH} levels"})
                return
            self.depth[link.cid.digest] = depth
            self.unchecked.append(link.cid)

    def _declares_too_much(self, root: PBNode) -> bool:
        """Whether the root of a UnixFS file declares more file bytes than ``max_bytes`` (then the
        fetch ends with that error before any child is asked for). Counting arriving blocks alone
        misses a DAG that repeats one leaf: a few KB to fetch, its declared gigabytes to read."""
        if self.max_bytes is None or root.data is None:
            return False
        try:
            meta = decode_unixfs(root.data)
        except DecodeError:
            return False  # not a UnixFS file: its reader refuses it, and its blocks are counted
        declared = max(meta.filesize or 0, len(meta.data or b"") + sum(meta.blocksizes))
        if declared <= self.max_bytes:
            return False
        self.error = FetchError(self.root, self.root, {
            CONTENT: f"the file declares {declared} bytes, over the {self.max_bytes} byte limit"})
        return True

    def _failure(self, cid: CID) -> FetchError:
        reasons = dict(self.reasons)
        for peer_id in self.dont_have.get(cid.digest, ()):
            reasons.setdefault(short_id(peer_id), "does not have it (DontHave)")
        return FetchError(cid, self.root, reasons)

    # -- events from the exchange (synchronous: called while a message is being handled) --

    def on_block(self, peer_id: ID, block: WireBlock) -> bool:
        """Take a block if it is one we want: its multihash was computed from its bytes, so the match
        against the multihash of a CID we asked for *is* the verification."""
        digest, data = block.multihash, block.data
        owner = self.owner.pop(digest, None)
        if owner is None:
            return digest in self.done  # a late duplicate is harmless; anything else is not ours
        wanted = self.inflight[owner].pop(digest)
        if digest == self.root.digest:
            self.root_settled.set()
        if owner != peer_id and owner in self.live:
            self.ex.send_wants(owner, [WantEntry(wanted, cancel=True)])
        self.done.add(digest)
        self.last_progress[peer_id] = trio.current_time()
        self.stats.blocks += 1
        self.stats.bytes += len(data)
        key = short_id(peer_id)
        self.stats.per_provider[key] = self.stats.per_provider.get(key, 0) + len(data)
        if self.max_bytes is not None and self.stats.bytes > self.max_bytes:
            self.error = FetchError(
                wanted, self.root, {CONTENT: f"DAG is larger than the {self.max_bytes} byte limit"}
            )
        self._queue_children(wanted, data)
        self.fetched.append(wanted)
        self._to_disk.send_nowait((wanted, data))  # the wanted CID: same hash, our codec
        if self.progress is not None:
            self.progress(len(data))
        self.changed.set()
        return True

    def on_dont_have(self, peer_id: ID, cid: CID) -> None:
        digest = cid.digest
        if self.owner.get(digest) != peer_id:
            return
        del self.owner[digest]
        wanted = self.inflight[peer_id].pop(digest)
        self.dont_have.setdefault(digest, set()).add(peer_id)
        self.pending.appendleft(wanted)
        self.changed.set()

    def on_bad_provider(self, peer_id: ID, reason: str, offence: bool = True) -> None:
        if peer_id in self.live:
            self._drop(peer_id, reason, cancel=offence)

    def _check_providers(self) -> None:
        now = trio.current_time()
        network = self.ex.host.get_network()
        for peer_id in list(self.live):
            if not self.inflight[peer_id]:
                continue
            if now - self.last_progress.get(peer_id, now) > self.stall_timeout:
                self._drop(peer_id, f"no block for {self.stall_timeout:g} s")
            elif self.ex.has_stream(peer_id) and not network.get_connections(peer_id):
                self._drop(peer_id, "disconnected")

    def _drop(self, peer_id: ID, reason: str, cancel: bool = False) -> None:
        """Take a provider out of this fetch; what it owed goes back to the front of the queue."""
        self.live.remove(peer_id)
        self.reasons[short_id(peer_id)] = reason
        owed = list(self.inflight[peer_id].values())
        self.inflight[peer_id].clear()
        for cid in owed:
            del self.owner[cid.digest]
        self.pending.extendleft(reversed(owed))
        logger.info(
            "bitswap: fetch of %s drops provider %s (%s); %d block(s) go to others",
            cid_str(self.root), short_id(peer_id), reason, len(owed),
        )
        if cancel and owed and self.ex.has_outbox(peer_id):
            self.ex.send_wants(peer_id, [WantEntry(c, cancel=True) for c in owed])
        if not self.live:
            self.root_settled.set()  # nobody left to answer for the root either
        self.changed.set()

    async def _write_blocks(self) -> None:
        """Store verified blocks off the event loop, several at once: each put fsyncs (1-3 ms here)."""
        async with trio.open_nursery() as nursery:
            async with self._from_net:
                for _ in range(_WRITERS):
                    nursery.start_soon(self._write_some, self._from_net.clone())

    async def _write_some(self, blocks: trio.MemoryReceiveChannel[tuple[CID, bytes]]) -> None:
        async with blocks:
            async for cid, data in blocks:
                await trio.to_thread.run_sync(self.ex.store.put, cid, data)
