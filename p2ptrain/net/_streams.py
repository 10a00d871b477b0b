"""Message-framed bulk channels over libp2p streams.

A :class:`Channel` wraps one long-lived libp2p stream (Noise-secured, yamux-multiplexed) and carries
whole messages: each message is an 8-byte big-endian length followed by that many bytes. Nothing on
the wire is ever unpickled; a receiver states the largest message it will accept, and a larger one
closes the channel with a clear error before the body is assembled (what is buffered meanwhile is
bounded by the stream's yamux window, at most 16 MiB).

Errors are ours (:class:`ChannelClosed`, :class:`ChannelError`) and name the remote peer, so callers
never handle libp2p's internal exception zoo.

On hosts from :func:`p2ptrain.net.make_host` the channel runs on our yamux and Noise classes
(:mod:`p2ptrain.net._muxer` and :mod:`~p2ptrain.net._yamux_stream`, :mod:`p2ptrain.net._noise`): large frames, no copies
of message bodies on
the way out, one join on the way in. With any other libp2p stream it falls back to plain
``read``/``write``.

How callers must behave (flow control): ``send`` blocks once the receiver's window is full, i.e.
while the receiver is not calling ``recv``. Our muxer lets it wait as long as the caller's deadline
allows (put one around ``send``/``recv`` with ``trio.fail_after``). py-libp2p's stock yamux instead
fails a writer whose reader has not read for 5 s: when the sender is a stock peer, a receiver that
computes for longer must keep a task reading, or not leave unread data in flight.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Awaitable, Callable
from types import TracebackType

import trio
from libp2p.abc import IHost, IMuxedConn, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.net._relay import has_direct_connection
from p2ptrain.net._stream_guard import CLOSE_TIMEOUT_S, StreamGuard
from p2ptrain.net._yamux_stream import FastYamuxStream

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">Q")
# Default cap on one peer's open inbound streams of one protocol (serve_channels): 32 concurrent
# long-lived channels is far more than any of our protocols opens to one peer, while each
# refused stream costs the attacker as much as us.
MAX_STREAMS_PER_PEER = 32


# How long closing a dead relayed connection may take (its circuit may not answer at all).
_DROP_CLOSE_S = 5.0

class ChannelError(Exception):
    """A channel failed: protocol violation, oversize message, or the transport broke."""

    def __init__(self, peer_id: ID | None, message: str) -> None:
        self.peer_id = peer_id
        who = short_id(peer_id) if peer_id is not None else "?"
        super().__init__(f"peer {who}: {message}")


class ChannelClosed(ChannelError):
    """The channel is closed: the peer closed or reset it, or we did."""


class MessageTooLarge(ChannelError):
    """The peer announced a message over the receiver's ``max_len``; the channel is closed."""


class Channel:
    """Whole messages, in order, over one libp2p stream.

    One task may ``send`` while another ``recv``s; concurrent sends (or concurrent recvs) are
    serialized so messages never interleave.

    Cancellation: a cancelled ``recv`` loses nothing (the next ``recv`` continues the same
    message), so ``with trio.move_on_after(t): await ch.recv(n)`` is a safe poll. A cancelled
    ``send`` resets the channel, because the peer may already hold part of the message; on our
    muxer the connection and its other channels carry on (a frame already on its way is finished
    by the muxer, never torn).
    """

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self.remote_peer: ID = stream.muxed_conn.peer_id
        muxed = getattr(stream, "muxed_stream", None)
        self._fast: FastYamuxStream | None = muxed if isinstance(muxed, FastYamuxStream) else None
        # Bytes of the message being received, kept across a cancelled recv.
        self._pending: list[bytes | memoryview] = []
        self._pending_len = 0
        self._incoming: int | None = None  # its announced length, once the header is in
        self._send_lock = trio.Lock()
        self._recv_lock = trio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"<Channel to {short_id(self.remote_peer)}>"

    @property
    def connection(self) -> IMuxedConn:
        """The muxed connection this channel's stream runs on (e.g. to tell a relayed one)."""
        return self._stream.muxed_conn

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send one message (may be empty). Returns once the muxer has taken all of it."""
        if self._closed:
            raise ChannelClosed(self.remote_peer, "send on a closed channel")
        view = memoryview(data).cast("B")
        async with self._send_lock:
            try:
                if self._fast is not None:
                    # Our yamux sends the length inside the first frame, without copying the body.
                    await self._fast.write(view, prefix=_LENGTH.pack(len(view)))
                else:
                    await self._stream.write(_LENGTH.pack(len(view)) + view)
            except trio.Cancelled:
                await self.reset()
                raise
            except Exception as error:
                await self.reset()
                raise ChannelClosed(
                    self.remote_peer, f"send failed ({type(error).__name__}: {error})"
                ) from error

    async def recv(self, max_len: int) -> bytes:
        """Receive one whole message of at most ``max_len`` bytes.

        A larger announced length raises :class:`MessageTooLarge` and closes the channel before the
        body is assembled. End of stream, before or inside a message, raises :class:`ChannelClosed`.
        """
        if self._closed:
            raise ChannelClosed(self.remote_peer, "recv on a closed channel")
        async with self._recv_lock:
            length = await self._header()
            if length > max_len:
                await self.reset()
                raise MessageTooLarge(
                    self.remote_peer,
                    f"message of {length} bytes exceeds the limit of {max_len}; channel closed",
                )
            body = await self._take(length, f"message of {length} bytes")
            self._incoming = None
            return body

    async def announced(self) -> int:
        """The length the next message announces: its header read, its body not yet (a :meth:`recv`
        then takes it). For a receiver that decides what it buffers from a peer before the body is
        assembled. Cancellation loses nothing, as for ``recv``; the stream's end raises :class:`ChannelClosed`."""
        if self._closed:
            raise ChannelClosed(self.remote_peer, "recv on a closed channel")
        async with self._recv_lock:
            return await self._header()

    async def _header(self) -> int:
        """The announced length of the message being received, its header read once (under the recv lock)."""
        if self._incoming is None:
            (self._incoming,) = _LENGTH.unpack(await self._take(_LENGTH.size, "message header"))
        return self._incoming

    async def _take(self, n: int, what: str) -> bytes:
        """Exactly ``n`` bytes, or :class:`ChannelClosed` if the stream ends first.

        Never reads past ``n``, so nothing of the next message is held here between calls.
        """
        while self._pending_len < n:
            try:
                more = await self._read_some(n - self._pending_len)
            except trio.Cancelled:
                raise  # what arrived stays in self._pending for the next recv
            except Exception as error:
                await self.reset()
                raise ChannelClosed(
                    self.remote_peer,
                    f"stream ended with {self._pending_len} of {n} bytes of a {what} "
                    f"({type(error).__name__})",
                ) from error
            if not more:
                await self.reset()
                raise ChannelClosed(
                    self.remote_peer,
                    f"stream ended with {self._pending_len} of {n} bytes of a {what}",
                )
            self._pending.extend(more)
            self._pending_len += sum(len(piece) for piece in more)
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_len = 0
        return data

    async def _read_some(self, n: int) -> list[bytes | memoryview]:
        """Between 1 and ``n`` bytes from the stream, as pieces; empty at a clean end."""
        if self._fast is not None:
            return list(await self._fast.read_pieces(n))
        chunk = await self._stream.read(n)
        return [chunk] if chunk else []

    async def reset(self) -> None:
        """End the channel with a reset: the peer sees a reset, not a clean end, and its next
        ``recv`` raises :class:`ChannelClosed`. For a channel that failed or may hold part of a
        message in either direction, which must not be reused. Idempotent, shielded, bounded."""
        if self._closed:
            return
        self._closed = True
        # Shielded so a cancelled caller still tells the peer; bounded in case the connection is
        # wedged.
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            try:
                await self._stream.reset()
            except Exception as error:  # the connection may already be gone
                logger.debug("reset of channel to %s failed: %s", short_id(self.remote_peer), error)

    async def aclose(self) -> None:
        """Close our side cleanly; the peer's ``recv`` then raises :class:`ChannelClosed`."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            try:
                await self._stream.close()
            except Exception as error:
                logger.debug("close of channel to %s failed: %s", short_id(self.remote_peer), error)

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.aclose()
        else:
            await self.reset()


async def open_channel(host: IHost, peer_id: ID, protocol: str) -> Channel:
    """Open a channel to ``peer_id`` (already connected or in the peerstore) for ``protocol``."""
    try:
        stream = await host.new_stream(peer_id, [TProtocol(protocol)])
    except trio.Cancelled:
        raise
    except Exception as error:
        await _drop_dead_relayed(host, peer_id)
        raise ChannelError(
            peer_id, f"cannot open {protocol} ({type(error).__name__}: {error})"
        ) from error
    return Channel(stream)


async def _drop_dead_relayed(host: IHost, peer_id: ID) -> None:
    """Close the connections to ``peer_id`` when all of them go through a relay and a stream just
    failed to open on them, so the next open dials a fresh circuit.

    Why: a relayed connection can die at the relay (its circuit gone) while both ends keep it. No
    stream opens on it any more: one end's muxer refuses, the other's negotiation times out. Nothing
    else notices, since the two peers' heartbeats reach each other by gossip through other peers.
    Seen in tests/wan/test_training_behind_nat.py: two private peers behind different NATs, every
    collective round between them failed "cannot open" for minutes, and no redial happened because
    the dead connection was still listed. A direct connection is left alone: a refused stream there
    (a protocol the peer does not serve) says nothing about the connection.
    """
    connections = host.get_network().get_connections(peer_id)
    if not connections or has_direct_connection(host, peer_id):
        return
    logger.info("closing the relayed connection to %s: a stream failed to open on it (the next open dials "
                "a fresh circuit)", short_id(peer_id))
    with trio.move_on_after(_DROP_CLOSE_S):
        for connection in connections:
            try:
                await connection.close()
            except Exception as exc:  # already half gone: what matters is that it is no longer listed
                logger.debug("closing a relayed connection to %s: %r", short_id(peer_id), exc)


def serve_channels(
    host: IHost,
    protocol: str,
    handler: Callable[[Channel], Awaitable[None]],
    *,
    max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
) -> StreamGuard:
    """Run ``handler`` for every inbound channel on ``protocol``, at most ``max_streams_per_peer``
    at once per peer; returns the guard whose counters say what was refused.

    The channel is closed when the handler returns and reset if it raises. A handler's
    :class:`ChannelError` (a peer went away) is logged, not raised; any other exception is counted
    by the guard (``handler_error``) and resets only that channel.
    """
    guard = StreamGuard(protocol, max_streams_per_peer)

    async def _on_stream(stream: INetStream) -> None:
        channel = Channel(stream)
        try:
            await handler(channel)
        except ChannelError as error:
            logger.info("%s handler on %s ended: %s", protocol, channel, error)
            await channel.reset()
        except BaseException:
            await channel.reset()
            raise  # the guard counts and logs it
        else:
            await channel.aclose()

    host.set_stream_handler(TProtocol(protocol), guard.wrap(_on_stream))
    return guard
