"""Our side of the Bitswap streams: one sender per peer, on the one long-lived stream we open to it.

As Kubo does, we write to a peer only on the stream *we* opened (:mod:`p2ptrain.ipfs._exchange`
reads the ones it opened). A sender packs what waits in the peer's :class:`Outbox` (our wants, the
blocks it asked of us) into messages and writes them, the next message read from disk while the
current one is on the wire; it closes its stream when idle, before the peer's idle timeout would
reset it, and a failure drops the peer (its wants go to the other providers of a fetch).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.io.exceptions import IOException
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import MuxedConnError, MuxedStreamError

from p2ptrain.base import short_id
from p2ptrain.ipfs._bitswap_wire import PROTOCOLS
from p2ptrain.ipfs._serving import Outbox, Packed, next_messages
from p2ptrain.ipfs._store import BlockSource

logger = logging.getLogger(__name__)

DIAL_TIMEOUT = 10.0
# Our sender closes its stream to a peer after this long with nothing to send, before the peer's
# idle timeout (ours: INBOUND_IDLE_S) would reset it under a later write.
_SEND_IDLE_S = 60.0
# Closing our sender's stream to a peer we drop is shielded from cancellation (so the peer sees the
# stream end) but bounded: a close is one frame on an open connection (milliseconds), and a peer
# that does not take it within a second is dead or hostile; the stream is given up then.
_CLOSE_TIMEOUT_S = 1.0

# What a stream read raises when the peer closed, reset or went away: an end, not a fault.
STREAM_ENDED: tuple[type[BaseException], ...] = (
    StreamError, MuxedStreamError, MuxedConnError, IOException, OSError, trio.BrokenResourceError,
    trio.ClosedResourceError,
)


class Senders:
    """The senders of one exchange, by peer. They run in ``nursery`` (the exchange's, set while it
    runs); ``read_own`` reads what a peer answers on a stream we opened, and ``dropped(peer, reason)``
    hears of a peer whose stream failed."""

    def __init__(
        self, host: IHost, store: BlockSource, read_own: Callable[[INetStream], Awaitable[None]],
        dropped: Callable[[ID, str], None],
    ) -> None:
        self.host = host
        self.store = store
        self._read_own = read_own
        self._dropped = dropped
        self.peers: dict[ID, Outbox] = {}
        self.nursery: trio.Nursery | None = None
        # Blocks we served to peers (written on our stream to them), and their data bytes.
        self.served_blocks = 0
        self.served_bytes = 0

    @property
    def running(self) -> bool:
        """Whether senders may start (the exchange runs): not once it stopped."""
        return self.nursery is not None

    def outbox(self, peer_id: ID) -> Outbox:
        """``peer_id``'s outbox, starting a sender for it if none runs."""
        peer = self.peers.get(peer_id)
        if peer is None:
            if self.nursery is None:
                raise RuntimeError("BlockExchange is not running (start it with exchange.run)")
            peer = self.peers[peer_id] = Outbox(peer_id)
            self.nursery.start_soon(self._send_loop, peer)
        return peer

    def stop(self) -> None:
        """The exchange stopped: no sender starts any more, and those left end."""
        self.nursery = None
        for peer in self.peers.values():
            peer.done = True

    async def _send_loop(self, peer: Outbox) -> None:
        """Everything we send to one peer, on one long-lived stream; a failure drops the peer.

        Packing (reading blocks from disk, encoding) and writing run as two tasks with one message
        between them, so the next message is read from disk while the current one is on the wire.
        """
        try:
            async with trio.open_nursery() as nursery:
                packed, to_write = trio.open_memory_channel[Packed](1)
                nursery.start_soon(self._pack_loop, peer, packed)
                async with to_write:
                    async for item in to_write:
                        await self._write(peer, item.message)
                        self.served_blocks += item.blocks
                        self.served_bytes += item.block_bytes
        except Exception as exc:
            reason = f"stream failed: {exc!r}"
            logger.info("bitswap: dropping peer %s: %s", short_id(peer.id), reason)
            self._dropped(peer.id, reason)
        finally:
            if self.peers.get(peer.id) is peer:
                del self.peers[peer.id]
            if peer.stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT_S):
                    await close_quietly(peer.stream)

    async def _pack_loop(self, peer: Outbox, packed: trio.MemorySendChannel[Packed]) -> None:
        async with packed:
            while not peer.done:
                with trio.move_on_after(_SEND_IDLE_S):
                    await peer.wake.wait()
                if not peer.wake.is_set():
                    # Idle: leave, closing our stream before the peer's idle timeout resets it; a
                    # later want starts a fresh Outbox and stream.
                    peer.done = True
                    if self.peers.get(peer.id) is peer:
                        del self.peers[peer.id]
                    return
                peer.wake = trio.Event()
                if peer.stream is None:
                    await self._open(peer)
                while peer.wants or peer.serve:
                    for item in await next_messages(peer, self.store):
                        await packed.send(item)

    async def _write(self, peer: Outbox, message: bytes) -> None:
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
        except STREAM_ENDED as exc:
            logger.debug("bitswap: our stream to %s ended (%r); opening a fresh one",
                         short_id(peer.id), exc)
        await reset_quietly(peer.stream)
        await self._open(peer)
        await peer.stream.write(message)

    async def _open(self, peer: Outbox) -> None:
        with trio.fail_after(DIAL_TIMEOUT):
            stream = await self.host.new_stream(peer.id, list(PROTOCOLS))
        peer.stream = stream
        peer.protocol = str(stream.get_protocol() or PROTOCOLS[0])
        # A peer may answer on the stream we opened (py-libp2p's Bitswap does); Kubo never writes on it.
        assert self.nursery is not None
        self.nursery.start_soon(self._read_own, stream)


async def close_quietly(stream: INetStream) -> None:
    """Close ``stream``; a stream that cannot be closed any more is done with all the same."""
    try:
        await stream.close()
    except Exception:
        pass


async def reset_quietly(stream: INetStream) -> None:
    """Reset ``stream``, whatever state it is in."""
    try:
        await stream.reset()
    except Exception:
        pass
