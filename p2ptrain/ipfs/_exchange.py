"""Block exchange over Bitswap: serve the blocks we hold, fetch whole DAGs from several providers at once.

Why standard Bitswap (``/ipfs/bitswap/1.2.0``, falling back to 1.1 and 1.0) rather than our own protocol:
a Kubo or Helia peer can then fetch our blocks and we theirs, with no gateway in between. We speak the
protocol as Kubo does: each side sends messages only on the one long-lived stream *it* opened to the
other, and reads every stream the other opened. Wants go out on our stream, blocks come back on theirs.
Helia (js-libp2p 3) differs in ways we allow for: it sends each message on a fresh stream, half-closes
every stream it accepts at once, and resets one that idles 10 s; see docs/content.md, "Interop rules".

Why our own implementation rather than ``libp2p.bitswap.BitswapClient``: that client names multi-chunk
files with the wrong CIDs, logs per block at INFO, polls, and stalled against a real Kubo node; its
protobuf schema is sound and is what :mod:`p2ptrain.ipfs._bitswap_wire` uses.

Trust: nothing a provider says is believed. A block's CID is computed from its bytes
(:mod:`~p2ptrain.ipfs._bitswap_wire`), so a block is accepted only when that hash is one we asked for.
Anything else from a provider we are fetching from (a corrupted or unsolicited block) costs that
provider its place in the fetch: its outstanding wants go to the others, and :attr:`BlockExchange.strikes`
counts the offence. A provider that disconnects, goes silent for ``stall_timeout`` or says DontHave
loses its outstanding wants the same way, so a fetch finishes as long as one honest provider remains.

Speed: a fetch keeps ``window`` blocks outstanding per provider; a server packs blocks into ~2 MiB
messages, written with one call each, and reads its store off the event loop. See docs/benchmarks.md.

Layout: this module holds the inbound streams (handlers behind their bounds) and the public API;
our one sender per peer is :mod:`p2ptrain.ipfs._senders`, a fetch's want-list logic
:mod:`p2ptrain.ipfs._fetch_session`, what peers ask of us and how the answers are packed
:mod:`p2ptrain.ipfs._serving`.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2ptrain.ipfs._bitswap_wire import (
    MAX_MESSAGE_SIZE,
    ByteBudget,
    PROTOCOLS,
    MessageReader,
    Received,
    WantEntry,
    WireBlock,
    WireError,
    decode_message,
)
from p2ptrain.ipfs._cid import CID, cid_str, parse_cid
from p2ptrain.ipfs._fetch_session import DEFAULT_STALL_TIMEOUT, DEFAULT_WINDOW, FetchError, FetchSession, FetchStats
from p2ptrain.ipfs._senders import STREAM_ENDED, Senders, close_quietly, reset_quietly
from p2ptrain.ipfs._serving import queue_wants
from p2ptrain.ipfs._store import BlockSource
from p2ptrain.base import count_rejection, short_id
from p2ptrain.net import StreamGuard

__all__ = ["BlockExchange", "FetchError", "FetchStats", "open_exchange"]

logger = logging.getLogger(__name__)

_RECENT_WANTS = 1 << 16  # digests we asked for lately: a late duplicate of one is not an offence
# Inbound Bitswap streams one peer may have open with us (all Bitswap versions together). Kubo and
# we open one long-lived stream per peer; 4 leaves room for a reconnect overlapping the old one.
MAX_INBOUND_STREAMS_PER_PEER = 4
# Bytes of inbound messages one peer may hold with us at once over all its streams, counted from a
# message's length prefix (before its body is in): two whole messages of the 4 MiB maximum, e.g.
# a block message on its stream and one on ours. A message over the budget resets its stream.
MAX_INBOUND_BYTES_PER_PEER = 2 * MAX_MESSAGE_SIZE
# An inbound stream with no message for this long is closed (the sender opens a fresh one when it
# has something to say; ours closes its own stream after _senders._SEND_IDLE_S, well before this).
INBOUND_IDLE_S = 120.0
# A message, once its first byte is in, must be complete within this: 4 MiB at 1 MB/s takes 4 s.
MESSAGE_TIMEOUT_S = 30.0


class BlockExchange:
    """Bitswap for one host: serves blocks of ``store`` to any peer, fetches DAGs into it.

    Run it for the life of the host (``await nursery.start(exchange.run)`` or :func:`open_exchange`);
    while it runs its stream handlers are installed.
    """

    def __init__(self, host: IHost, store: BlockSource) -> None:
        self.host = host
        self.store = store
        self.strikes: collections.Counter[str] = collections.Counter()  # short peer id -> offences
        self._senders = Senders(host, store, self._read_own, self._on_dropped)
        self._sessions: set[FetchSession] = set()
        self._recent: dict[bytes, None] = {}  # ordered set of digests we asked for
        self._guard = StreamGuard("bitswap", MAX_INBOUND_STREAMS_PER_PEER)
        self._budgets: dict[ID, tuple[ByteBudget, int]] = {}  # peer -> (budget, readers using it)
        self.rejected: collections.Counter[str] = collections.Counter()  # inbound refusals, by reason

    def stats(self) -> dict[str, int]:
        """Inbound refusals by reason, what peers hold with us now, and what we served (for node status)."""
        return {
            **self._guard.stats(),
            **{f"rejected_{why}": n for why, n in self.rejected.items()},
            "inbound_bytes_held": sum(budget.used for budget, _ in self._budgets.values()),
            "offences": sum(self.strikes.values()),
            "served_blocks": self._senders.served_blocks,
            "served_bytes": self._senders.served_bytes,
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
                self._senders.nursery = nursery
                handler = self._guard.wrap(self._handle_inbound)
                for protocol in PROTOCOLS:
                    self.host.set_stream_handler(protocol, handler)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._senders.stop()
            # Replaced, not removed: libp2p looks a protocol's handler up again once a stream has
            # agreed on it, and a stream that arrived while a stopping node removed it found none
            # (KeyError out of the swarm's task: the node's run ended with an error). The host
            # usually stops next; until then a peer's stream is reset.
            for protocol in PROTOCOLS:
                self.host.set_stream_handler(protocol, reset_quietly)

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
            await reset_quietly(stream)
        except STREAM_ENDED as exc:  # the sessions notice through the connection
            logger.debug("bitswap: stream from %s ended: %r", short_id(peer_id), exc)
        finally:
            reader.release()
            budget, users = self._budgets[peer_id]
            if users > 1:
                self._budgets[peer_id] = (budget, users - 1)
            else:
                del self._budgets[peer_id]
            if not ours:  # our sender closes its own stream when it is done with it
                await close_quietly(stream)

    def _on_message(self, peer_id: ID, msg: Received) -> None:
        # A stream opened before the exchange stopped may still bring wants: nothing sends now.
        if (msg.wants or msg.full_wantlist) and self._senders.running:
            queue_wants(self._senders.outbox(peer_id), msg, self.store)
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

    # ---- sending -------------------------------------------------------------------------------

    def has_outbox(self, peer_id: ID) -> bool:
        """Whether we are talking to ``peer_id`` now (a sender runs for it)."""
        return peer_id in self._senders.peers

    def has_stream(self, peer_id: ID) -> bool:
        """Whether our sender to ``peer_id`` has opened its stream."""
        peer = self._senders.peers.get(peer_id)
        return peer is not None and peer.stream is not None

    def send_wants(self, peer_id: ID, wants: Iterable[WantEntry]) -> None:
        """Queue wants (or cancels) for ``peer_id``, starting a sender for it if none runs."""
        peer = self._senders.outbox(peer_id)
        for want in wants:
            peer.wants[bytes(want.cid)] = want
            if not want.cancel:
                self._remember(want.cid)
        peer.poke()

    def _remember(self, cid: CID) -> None:
        self._recent[cid.digest] = None
        if len(self._recent) > _RECENT_WANTS:
            del self._recent[next(iter(self._recent))]

    async def _read_own(self, stream: INetStream) -> None:
        """Read what a peer answers on the stream we opened, behind the same exception boundary as
        inbound streams (this task runs in the exchange's nursery: an escape would end it)."""
        try:
            await self._handle_stream(stream, ours=True)
        except Exception:
            count_rejection(self._guard.counters, "handler_error", logger, logging.ERROR,
                            "bitswap: reading our stream to %s failed; stream reset",
                            short_id(stream.muxed_conn.peer_id), exc_info=True)
            await reset_quietly(stream)

    def _on_dropped(self, peer_id: ID, reason: str) -> None:
        """Our stream to ``peer_id`` failed: the fetches take their wants elsewhere."""
        for session in list(self._sessions):
            session.on_bad_provider(peer_id, reason, offence=False)

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
        session = FetchSession(
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
        session = FetchSession(
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

    async def _run_session(self, session: FetchSession) -> FetchStats:
        self._sessions.add(session)
        try:
            return await session.run()
        except FetchError as exc:
            if exc.refused and session.fetched:
                # Refused content (over its size bound, malformed) is not kept: a task naming a
                # 2 GiB "model" must not leave what arrived before the bound was met on the disk.
                # A block another fetch under way has too (fetched or held) stays.
                others = {d for other in self._sessions if other is not session for d in other.done}
                doomed = [cid for cid in session.fetched if cid.digest not in others]

                def remove() -> None:
                    for cid in doomed:
                        self.store.delete(cid)

                await trio.to_thread.run_sync(remove)
                logger.info("bitswap: refused %s: removed the %d block(s) it had stored", cid_str(exc.root),
                            len(doomed))
            raise
        finally:
            self._sessions.discard(session)



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
