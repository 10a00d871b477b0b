"""Block exchange over Bitswap: serve the blocks we hold, fetch whole DAGs from several providers at once.

Why standard Bitswap (``/ipfs/bitswap/1.2.0``, falling back to 1.1 and 1.0) rather than our own protocol:
a Kubo or Helia peer can then fetch our blocks and we theirs, with no gateway in between. We speak the
protocol as Kubo does: each side sends messages only on the one long-lived stream *it* opened to the
other, and reads every stream the other opened. Wants go out on our stream, blocks come back on theirs.
Helia (js-libp2p 3) differs in ways we allow for: it sends each message on a fresh stream, half-closes
every stream it accepts at once, and resets one that idles 10 s; see docs/content.md, "Interop rules".

Why our own implementation rather than ``libp2p.bitswap.BitswapClient``: that client names multi-chunk
files with the wrong CIDs, logs per block at INFO, polls, and stalled against a real Kubo node; its
protobuf schema is sound and is what :mod:`p2ptrain.ipfs.bitswap_wire` uses.

Trust: nothing a provider says is believed. A block's CID is computed from its bytes
(:mod:`~p2ptrain.ipfs.bitswap_wire`), so a block is accepted only when that hash is one we asked for.
Anything else from a provider we are fetching from (a corrupted or unsolicited block) costs that
provider its place in the fetch: its outstanding wants go to the others, and :attr:`BlockExchange.strikes`
counts the offence. A provider that disconnects, goes silent for ``stall_timeout`` or says DontHave
loses its outstanding wants the same way, so a fetch finishes as long as one honest provider remains.

Speed: a fetch keeps ``window`` blocks outstanding per provider; a server packs blocks into ~2 MiB
messages, written with one call each, and reads its store off the event loop. See docs/benchmarks.md.
"""

from __future__ import annotations

import collections
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.io.exceptions import IOException
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.peerinfo import PeerInfo
from libp2p.stream_muxer.exceptions import MuxedConnError, MuxedStreamError

from p2ptrain.ipfs.bitswap_wire import (
    MAX_ENTRIES,
    MAX_MESSAGE_SIZE,
    ByteBudget,
    PROTOCOLS,
    TARGET_MESSAGE_SIZE,
    MessageReader,
    Received,
    WantEntry,
    WireBlock,
    WireError,
    decode_message,
    encode_message,
)
from p2ptrain.ipfs.cid import CID, DAG_PB, cid_str, parse_cid
from p2ptrain.ipfs.dagpb import DecodeError, decode_node
from p2ptrain.ipfs.unixfs import MAX_DEPTH
from p2ptrain.logs import count_rejection, short_id
from p2ptrain.net.streams import StreamGuard

__all__ = ["BlockExchange", "BlockSource", "FetchError", "FetchStats", "open_exchange"]

logger = logging.getLogger(__name__)

DEFAULT_WINDOW = 32  # blocks outstanding per provider: 8 MiB of 256 KiB leaves
DEFAULT_STALL_TIMEOUT = 10.0
DIAL_TIMEOUT = 10.0
_TICK = 0.25  # how often a fetch looks for stalled or disconnected providers
_RECENT_WANTS = 1 << 16  # digests we asked for lately: a late duplicate of one is not an offence
_SERVE_BATCH = 8  # blocks loaded from disk per thread hop
_WRITERS = 4  # blocks being written (and fsynced) at once by one fetch
MAX_PEER_WANTS = 8192  # requests one peer may have queued with our server (Kubo's own cap is similar)
# Inbound Bitswap streams one peer may have open with us (all Bitswap versions together). Kubo and
# we open one long-lived stream per peer; 4 leaves room for a reconnect overlapping the old one.
MAX_INBOUND_STREAMS_PER_PEER = 4
# Bytes of inbound messages one peer may hold with us at once over all its streams, counted from a
# message's length prefix (before its body is in): two whole messages of the 4 MiB maximum, e.g.
# a block message on its stream and one on ours. A message over the budget resets its stream.
MAX_INBOUND_BYTES_PER_PEER = 2 * MAX_MESSAGE_SIZE
# An inbound stream with no message for this long is closed (the sender opens a fresh one when it
# has something to say; ours closes its own stream after _SEND_IDLE_S, well before this).
INBOUND_IDLE_S = 120.0
# A message, once its first byte is in, must be complete within this: 4 MiB at 1 MB/s takes 4 s.
MESSAGE_TIMEOUT_S = 30.0
# Our sender closes its stream to a peer after this long with nothing to send, before the peer's
# idle timeout (ours: INBOUND_IDLE_S) would reset it under a later write.
_SEND_IDLE_S = 60.0
# Closing our sender's stream to a peer we drop is shielded from cancellation (so the peer sees the
# stream end) but bounded: a close is one frame on an open connection (milliseconds), and a peer
# that does not take it within a second is dead or hostile; the stream is given up then.
_CLOSE_TIMEOUT_S = 1.0


class BlockSource(Protocol):
    """What the exchange needs of a block store (:class:`~p2ptrain.ipfs.blockstore.BlockStore` fits).

    ``get`` must verify what it returns; ``put`` must verify and write atomically. Both are called
    from worker threads.
    """

    def has(self, cid: CID) -> bool: ...

    def get(self, cid: CID) -> bytes: ...

    def put(self, cid: CID, data: bytes) -> None: ...


class FetchError(Exception):
    """A DAG could not be fetched: names the block, and what each provider did wrong."""

    def __init__(self, cid: CID, root: CID, reasons: dict[str, str]) -> None:
        self.cid = cid
        self.root = root
        self.reasons = reasons
        tried = "; ".join(f"{peer}: {why}" for peer, why in reasons.items()) or "no providers given"
        super().__init__(f"cannot fetch block {cid_str(cid)} of {cid_str(root)}: {tried}")


@dataclass
class FetchStats:
    """What one :meth:`BlockExchange.fetch_dag` did."""

    blocks: int = 0  # fetched over the network
    bytes: int = 0
    local_blocks: int = 0  # already held (a resumed fetch)
    seconds: float = 0.0
    per_provider: dict[str, int] = field(default_factory=dict)  # short peer id -> bytes received
    failed: dict[str, str] = field(default_factory=dict)  # short peer id -> why it was dropped


class _Peer:
    """Our side of one peer: the stream we opened to it, and what waits to be sent on it."""

    def __init__(self, peer_id: ID) -> None:
        self.id = peer_id
        self.wants: dict[bytes, WantEntry] = {}  # our wants/cancels, by CID bytes (last one wins)
        self.serve: dict[bytes, tuple[CID, str]] = {}  # what they asked of us: "block"|"have"|"dont"
        self.wake = trio.Event()
        self.stream: INetStream | None = None
        self.protocol: str = PROTOCOLS[0]
        self.done = False

    def poke(self) -> None:
        self.wake.set()


class BlockExchange:
    """Bitswap for one host: serves blocks of ``store`` to any peer, fetches DAGs into it.

    Run it for the life of the host (``await nursery.start(exchange.run)`` or :func:`open_exchange`);
    while it runs its stream handlers are installed.
    """

    def __init__(self, host: IHost, store: BlockSource) -> None:
        self.host = host
        self.store = store
        self.strikes: collections.Counter[str] = collections.Counter()  # short peer id -> offences
        self._peers: dict[ID, _Peer] = {}
        self._sessions: set[_Session] = set()
        self._recent: dict[bytes, None] = {}  # ordered set of digests we asked for
        self._nursery: trio.Nursery | None = None
        self._guard = StreamGuard("bitswap", MAX_INBOUND_STREAMS_PER_PEER)
        self._budgets: dict[ID, tuple[ByteBudget, int]] = {}  # peer -> (budget, readers using it)
        self.rejected: collections.Counter[str] = collections.Counter()  # inbound refusals, by reason

    def stats(self) -> dict[str, int]:
        """Inbound refusals by reason, and what peers hold with us now (for node status)."""
        return {
            **self._guard.stats(),
            **{f"rejected_{why}": n for why, n in self.rejected.items()},
            "inbound_bytes_held": sum(budget.used for budget, _ in self._budgets.values()),
            "offences": sum(self.strikes.values()),
        }

    def inbound_bytes(self, peer_id: ID) -> int:
        """Bytes of inbound messages ``peer_id`` holds with us now (at most MAX_INBOUND_BYTES_PER_PEER)."""
        entry = self._budgets.get(peer_id)
        return entry[0].used if entry else 0

    def inbound_streams(self, peer_id: ID) -> int:
        """Inbound Bitswap streams ``peer_id`` has open with us now."""
        return self._guard.open_streams(peer_id)

    # ---- life cycle ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Install the Bitswap handlers and run the per-peer senders until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                handler = self._guard.wrap(self._handle_inbound)
                for protocol in PROTOCOLS:
                    self.host.set_stream_handler(protocol, handler)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for protocol in PROTOCOLS:
                self.host.remove_stream_handler(protocol)
            for peer in self._peers.values():
                peer.done = True

    # ---- receiving -----------------------------------------------------------------------------

    async def _handle_inbound(self, stream: INetStream) -> None:
        """A stream a peer opened to us: read it until it ends or idles out (behind the guard)."""
        await self._handle_stream(stream, idle_timeout=INBOUND_IDLE_S)

    async def _handle_stream(
        self, stream: INetStream, idle_timeout: float = math.inf, *, ours: bool = False
    ) -> None:
        """Read every message a peer sends us on a stream it opened (or on ours, if it answers there).

        What the peer holds here is bounded by its byte budget; a bad, oversize, over-budget or
        too slow message resets the stream and is counted in :attr:`rejected`.

        The end of the peer's side is only the end of *its* writing: on a stream it opened we close
        ours too (we never write there), but on a stream we opened (``ours``) the write side stays
        open for our sender. js-libp2p 3 (Helia) half-closes every incoming Bitswap stream at once.
        """
        peer_id = stream.muxed_conn.peer_id
        budget, users = self._budgets.get(peer_id, (None, 0))
        if budget is None:
            budget = ByteBudget(MAX_INBOUND_BYTES_PER_PEER)
        self._budgets[peer_id] = (budget, users + 1)
        reader = MessageReader(
            stream, budget, idle_timeout=idle_timeout, message_timeout=MESSAGE_TIMEOUT_S
        )
        try:
            while (body := await reader.next_body()) is not None:
                self._on_message(peer_id, decode_message(body))
        except WireError as exc:
            count_rejection(self.rejected, "bad_message", logger, logging.WARNING,
                            "bitswap: peer %s sent a bad message: %s", short_id(peer_id), exc)
            self._offence(peer_id)
            await _reset(stream)
        except _STREAM_ENDED as exc:  # the sessions notice through the connection
            logger.debug("bitswap: stream from %s ended: %r", short_id(peer_id), exc)
        finally:
            reader.release()
            budget, users = self._budgets[peer_id]
            if users > 1:
                self._budgets[peer_id] = (budget, users - 1)
            else:
                del self._budgets[peer_id]
            if not ours:  # our sender closes its own stream when it is done with it
                await _close(stream)

    def _on_message(self, peer_id: ID, msg: Received) -> None:
        if msg.wants or msg.full_wantlist:
            self._on_wants(peer_id, msg)
        for block in msg.blocks:
            self._on_block(peer_id, block)
        if msg.dropped_blocks:
            self._on_unsolicited(peer_id, f"{msg.dropped_blocks} block(s) with an unverifiable CID prefix")
        for cid in msg.dont_haves:
            for session in list(self._sessions):
                session.on_dont_have(peer_id, cid)

    def _on_block(self, peer_id: ID, block: WireBlock) -> None:
        claimed = False
        for session in list(self._sessions):
            claimed |= session.on_block(peer_id, block)
        if not claimed and block.multihash not in self._recent:
            self._on_unsolicited(peer_id, f"block {cid_str(block.cid())} that was never asked for")

    def _on_unsolicited(self, peer_id: ID, what: str) -> None:
        # A corrupted block hashes to a CID nobody wanted, so it lands here too.
        logger.warning("bitswap: peer %s sent %s", short_id(peer_id), what)
        self._offence(peer_id)
        for session in list(self._sessions):
            session.on_bad_provider(peer_id, f"sent {what}")

    def _offence(self, peer_id: ID) -> None:
        self.strikes[short_id(peer_id)] += 1

    # ---- serving -------------------------------------------------------------------------------

    def _on_wants(self, peer_id: ID, msg: Received) -> None:
        peer = self._peer(peer_id)
        if msg.full_wantlist:
            peer.serve.clear()
        for want in msg.wants:
            key = bytes(want.cid)
            if want.cancel:
                peer.serve.pop(key, None)
            elif len(peer.serve) >= MAX_PEER_WANTS:
                # What a peer may queue with us is bounded; the rest it can ask again (Kubo re-sends).
                logger.info("bitswap: peer %s wants more than %d blocks; ignoring the rest",
                            short_id(peer_id), MAX_PEER_WANTS)
                break
            elif self.store.has(want.cid):
                peer.serve[key] = (want.cid, "have" if want.want_have else "block")
            elif want.send_dont_have:
                peer.serve[key] = (want.cid, "dont")
            # else: Kubo would remember the want until it gets the block; we do not fetch for others.
        if peer.serve:
            peer.poke()

    def _load(self, items: list[tuple[CID, str]]) -> list[tuple[CID, str, bytes | None]]:
        """Read the blocks to send (in a worker thread); a block gone or corrupt becomes a DontHave."""
        out = []
        for cid, kind in items:
            data = None
            if kind == "block":
                try:
                    data = self.store.get(cid)
                except Exception as exc:
                    logger.warning("bitswap: cannot serve %s: %s", cid_str(cid), exc)
                    kind = "dont"
            out.append((cid, kind, data))
        return out

    # ---- sending -------------------------------------------------------------------------------

    def _peer(self, peer_id: ID) -> _Peer:
        peer = self._peers.get(peer_id)
        if peer is None:
            if self._nursery is None:
                raise RuntimeError("BlockExchange is not running (start it with exchange.run)")
            peer = self._peers[peer_id] = _Peer(peer_id)
            self._nursery.start_soon(self._send_loop, peer)
        return peer

    def send_wants(self, peer_id: ID, wants: Iterable[WantEntry]) -> None:
        peer = self._peer(peer_id)
        for want in wants:
            peer.wants[bytes(want.cid)] = want
            if not want.cancel:
                self._remember(want.cid)
        peer.poke()

    def _remember(self, cid: CID) -> None:
        self._recent[cid.digest] = None
        if len(self._recent) > _RECENT_WANTS:
            del self._recent[next(iter(self._recent))]

    async def _send_loop(self, peer: _Peer) -> None:
        """Everything we send to one peer, on one long-lived stream; a failure drops the peer.

        Packing (reading blocks from disk, encoding) and writing run as two tasks with one message
        between them, so the next message is read from disk while the current one is on the wire.
        """
        try:
            async with trio.open_nursery() as nursery:
                packed, to_write = trio.open_memory_channel[bytes](1)
                nursery.start_soon(self._pack_loop, peer, packed)
                async with to_write:
                    async for message in to_write:
                        await self._write(peer, message)
        except Exception as exc:
            reason = f"stream failed: {exc!r}"
            logger.info("bitswap: dropping peer %s: %s", short_id(peer.id), reason)
            for session in list(self._sessions):
                session.on_bad_provider(peer.id, reason, offence=False)
        finally:
            if self._peers.get(peer.id) is peer:
                del self._peers[peer.id]
            if peer.stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT_S):
                    await _close(peer.stream)

    async def _pack_loop(self, peer: _Peer, packed: trio.MemorySendChannel[bytes]) -> None:
        async with packed:
            while not peer.done:
                with trio.move_on_after(_SEND_IDLE_S):
                    await peer.wake.wait()
                if not peer.wake.is_set():
                    # Idle: leave, closing our stream before the peer's idle timeout resets it; a
                    # later want starts a fresh _Peer and stream.
                    peer.done = True
                    if self._peers.get(peer.id) is peer:
                        del self._peers[peer.id]
                    return
                peer.wake = trio.Event()
                if peer.stream is None:
                    await self._open(peer)
                while peer.wants or peer.serve:
                    for message in await self._next_messages(peer):
                        await packed.send(message)

    async def _write(self, peer: _Peer, message: bytes) -> None:
        """Write one message on our stream to ``peer``; if the peer ended that stream, once more on a
        fresh one.

        A peer may end a stream we opened while it idles: Helia resets an incoming Bitswap stream
        with no message for 10 s (5 s in older versions), well before our _SEND_IDLE_S. That is not
        a failure of the peer, so the message goes on a new stream; a second failure in a row is.
        """
        assert peer.stream is not None
        try:
            await peer.stream.write(message)
            return
        except _STREAM_ENDED as exc:
            logger.debug("bitswap: our stream to %s ended (%r); opening a fresh one",
                         short_id(peer.id), exc)
        await _reset(peer.stream)
        await self._open(peer)
        await peer.stream.write(message)

    async def _open(self, peer: _Peer) -> None:
        with trio.fail_after(DIAL_TIMEOUT):
            stream = await self.host.new_stream(peer.id, list(PROTOCOLS))
        peer.stream = stream
        peer.protocol = str(stream.get_protocol() or PROTOCOLS[0])
        # A peer may answer on the stream we opened (py-libp2p's Bitswap does); Kubo never writes on it.
        assert self._nursery is not None
        self._nursery.start_soon(self._read_own, stream)

    async def _read_own(self, stream: INetStream) -> None:
        """Read what a peer answers on the stream we opened, behind the same exception boundary as
        inbound streams (this task runs in the exchange's nursery: an escape would end it)."""
        try:
            await self._handle_stream(stream, ours=True)
        except Exception:
            count_rejection(self._guard.counters, "handler_error", logger, logging.ERROR,
                            "bitswap: reading our stream to %s failed; stream reset",
                            short_id(stream.muxed_conn.peer_id), exc_info=True)
            await _reset(stream)

    async def _next_messages(self, peer: _Peer) -> list[bytes]:
        """Take queued wants and up to one batch of served blocks; pack them into messages."""
        # At most MAX_ENTRIES wants a message: a receiver refuses more (ours does, bitswap_wire);
        # the rest go in the next message.
        wants = []
        while peer.wants and len(wants) < MAX_ENTRIES:
            wants.append(peer.wants.pop(next(iter(peer.wants))))
        items = []
        while peer.serve and len(items) < _SERVE_BATCH:
            key = next(iter(peer.serve))
            items.append(peer.serve.pop(key))
        loaded = await trio.to_thread.run_sync(self._load, items) if items else []
        messages = []
        blocks: list[tuple[CID, bytes]] = []
        haves: list[CID] = []
        donts: list[CID] = []
        size = 0
        for cid, kind, data in loaded:
            if data is not None and blocks and size + len(data) > TARGET_MESSAGE_SIZE:
                messages.append(encode_message(wants=wants, blocks=blocks, protocol=peer.protocol))
                wants, blocks, size = [], [], 0
            if data is not None:
                blocks.append((cid, data))
                size += len(data)
            elif kind == "have":
                haves.append(cid)
            else:
                donts.append(cid)
        if wants or blocks or haves or donts:
            messages.append(
                encode_message(
                    wants=wants, blocks=blocks, haves=haves, dont_haves=donts, protocol=peer.protocol
                )
            )
        assert all(len(m) <= MAX_MESSAGE_SIZE + 8 for m in messages)
        return messages

    # ---- fetching ------------------------------------------------------------------------------

    async def fetch_dag(
        self,
        root: CID | str,
        providers: Sequence[ID | PeerInfo],
        *,
        window: int = DEFAULT_WINDOW,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        max_bytes: int | None = None,
        progress: Callable[[int], None] | None = None,
        more_providers: trio.MemoryReceiveChannel[ID] | None = None,
        root_settled: trio.Event | None = None,
    ) -> FetchStats:
        """Make the whole DAG under ``root`` local: every block verified, written to the store.

        Blocks already held are not fetched again (an interrupted fetch resumes). ``providers`` are peer
        IDs the host can reach, or :class:`PeerInfo` with addresses. Raises :class:`FetchError` when a
        block cannot be had from any provider, or when the DAG grows past ``max_bytes``.

        ``more_providers``: peers found while the fetch runs (the content service's DHT lookup, in
        parallel with the connected peers). Each one received joins the fetch at once; until the
        channel is closed, a block every provider so far refused waits for them instead of failing
        the fetch, so the fetch fails only once the search is over too. ``root_settled`` is set once
        the root block is in (or held) or every provider so far refused it (or there is none): the
        moment a search beside the fetch is worth its cost.
        """
        session = _Session(
            self, parse_cid(root), self._provider_ids(providers), window, stall_timeout, max_bytes,
            progress, recursive=True, more_providers=more_providers, root_settled=root_settled,
        )
        return await self._run_session(session)

    async def fetch_block(
        self,
        cid: CID | str,
        providers: Sequence[ID | PeerInfo],
        *,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    ) -> bytes:
        """One block, verified and stored (the store's copy if it already holds it).

        For callers that read a DAG block by block, such as the embedded store's ``fetch_block``
        hook; :meth:`fetch_dag` is much faster for a whole file.
        """
        cid = parse_cid(cid)
        session = _Session(
            self, cid, self._provider_ids(providers), 1, stall_timeout, None, None, recursive=False
        )
        await self._run_session(session)
        return await trio.to_thread.run_sync(self.store.get, cid)

    def _provider_ids(self, providers: Sequence[ID | PeerInfo]) -> list[ID]:
        ids = []
        for provider in providers:
            if isinstance(provider, PeerInfo):
                self.host.get_peerstore().add_addrs(provider.peer_id, provider.addrs, 600)
                provider = provider.peer_id
            if provider != self.host.get_id() and provider not in ids:
                ids.append(provider)
        return ids

    async def _run_session(self, session: _Session) -> FetchStats:
        self._sessions.add(session)
        try:
            return await session.run()
        finally:
            self._sessions.discard(session)


class _Session:
    """One fetch_dag: which blocks are wanted, who was asked for what, who is out."""

    def __init__(
        self,
        exchange: BlockExchange,
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
            held = await trio.to_thread.run_sync(lambda: [self.ex.store.has(c) for c in batch])
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
            links = decode_node(data).links
        except DecodeError as exc:
            # The block matches its hash, so the content itself is malformed: no provider can help.
            self.error = FetchError(cid, self.root, {"content": f"not a valid dag-pb node: {exc}"})
            return
        depth = self.depth[cid.digest] + 1
        for link in links:
            if link.cid.digest in self.depth:
                continue
            if depth > MAX_DEPTH:
                self.error = FetchError(link.cid, self.root, {"content": f"DAG deeper than {MAX_DEPTH} levels"})
                return
            self.depth[link.cid.digest] = depth
            self.unchecked.append(link.cid)

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
                wanted, self.root, {"content": f"DAG is larger than the {self.max_bytes} byte limit"}
            )
        self._queue_children(wanted, data)
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
            elif self.ex._peers.get(peer_id) and not network.get_connections(peer_id):
                peer = self.ex._peers[peer_id]
                if peer.stream is not None:
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
        if cancel and owed and peer_id in self.ex._peers:
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


@asynccontextmanager
async def open_exchange(host: IHost, store: BlockSource) -> AsyncIterator[BlockExchange]:
    """Run a :class:`BlockExchange` for the duration of the ``async with`` block."""
    exchange = BlockExchange(host, store)
    async with trio.open_nursery() as nursery:
        await nursery.start(exchange.run)
        try:
            yield exchange
        finally:
            nursery.cancel_scope.cancel()


# What a stream read raises when the peer closed, reset or went away: an end, not a fault.
_STREAM_ENDED: tuple[type[BaseException], ...] = (
    StreamError, MuxedStreamError, MuxedConnError, IOException, OSError, trio.BrokenResourceError,
    trio.ClosedResourceError,
)


async def _close(stream: INetStream) -> None:
    try:
        await stream.close()
    except Exception:
        pass


async def _reset(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception:
        pass
