"""Yamux with a bulk-transfer fast path, speaking the standard yamux wire format.

Profiling py-libp2p's yamux at bulk rates (docs/streams.md) puts the time in Python work per frame:
64 KiB frames, two socket reads per Noise message, a window update after every ``read()``, a
per-frame f-string log line, and a writer that polls every 10 ms and fails after 5 s without window.
This module keeps py-libp2p's :class:`~libp2p.stream_muxer.yamux.yamux.Yamux` (connection lifecycle,
close, reset, GO_AWAY, RTT pings, stale-stream sweeping) and replaces the data path:

* writers send DATA frames of up to :data:`~p2ptrain.net._yamux_stream.MAX_FRAME` bytes, within the peer's window (a frame up
  to the window is legal yamux; a stock py-libp2p receiver accepts up to 16 MiB);
* each stream returns credit in batches of half its window, as go-yamux does, and doubles the
  window with each batch from yamux's 256 KiB up to :data:`~p2ptrain.net._yamux_frames.RECV_WINDOW` (16 MiB);
* the frame reader takes whole decrypted socket reads from :class:`~p2ptrain.net._noise.NoiseSession`
  and hands payload slices to streams without copying them;
* a writer waiting for window sleeps on an event (woken by the window update, a close or a reset)
  and waits as long as its caller lets it: deadlines belong to the caller's cancel scope, not to a
  hidden 5 s timer.
* a cancelled writer never tears a frame: the unsent rest is finished first by the next writer or
  by a flusher task; control frames (window updates, ACKs, FIN/RST) are queued and go out before
  the next frame, so neither the frame reader nor a close ever waits on the socket.

The muxer class is installed by :func:`install`, because py-libp2p's muxer negotiation hard-codes
its own ``Yamux`` class for ``/yamux/1.0.0``.

Layout: this module is the connection (frame reader and writer, stream table, negotiation); the
stream is :mod:`p2ptrain.net._yamux_stream`, the checked frame header codec :mod:`p2ptrain.net._yamux_frames`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import trio
from libp2p.abc import IHost, IMuxedConn, ISecureConn
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError, IOException
from libp2p.network.connection.exceptions import RawConnError
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import MuxedStreamError
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import (
    FLAG_ACK,
    FLAG_FIN,
    FLAG_RST,
    FLAG_SYN,
    GO_AWAY_PROTOCOL_ERROR,
    HEADER_SIZE,
    PROTOCOL_ID,
    TYPE_DATA,
    TYPE_GO_AWAY,
    TYPE_PING,
    TYPE_WINDOW_UPDATE,
    Yamux,
)

from p2ptrain.base import count_rejection
from p2ptrain.net._noise import NoiseSession
from p2ptrain.net._yamux_frames import FRAME_HEADER, YamuxFrameError, parse_frame_header
from p2ptrain.net._yamux_stream import FastYamuxStream

logger = logging.getLogger(__name__)

# Inbound streams a peer may have open on one connection; a SYN beyond it is answered with RST.
# Every protocol handler caps its own streams per peer (collective 16, Bitswap 4), but a stream
# holds up to yamux's initial 256 KiB window of unread data before any handler sees it (during
# protocol negotiation): 128 streams bound that to 32 MiB per connection.
MAX_INBOUND_STREAMS = 128

# What a socket read or write raises when the connection is gone: an end, logged at DEBUG.
_CONNECTION_ERRORS = (
    ConnectionClosedError,
    RawConnError,
    IncompleteReadError,
    IOException,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


class FastYamux(Yamux):
    """py-libp2p's Yamux connection with our frame reader and writer (see module docstring)."""

    streams: dict[int, FastYamuxStream]  # type: ignore[assignment]

    def __init__(self, secured_conn: ISecureConn, peer_id: ID, *args: Any, **kwargs: Any) -> None:
        super().__init__(secured_conn, peer_id, *args, **kwargs)
        self._noise = secured_conn if isinstance(secured_conn, NoiseSession) else None
        # Control frames waiting for the next holder of the write lock (see send_control), and
        # the unsent rest of a frame whose writer was cancelled (see send_frame).
        self._control: list[bytes] = []
        self._unsent: list[bytes | memoryview] = []
        self._flush_wanted = trio.Event()
        self._flusher_running = False
        # Frame parser state, carried across socket reads.
        self._header = bytearray()
        self._body_left = 0
        self._body_stream: FastYamuxStream | None = None
        self._body_flags = 0
        # Inbound streams refused, by reason (over_inbound_streams: beyond MAX_INBOUND_STREAMS).
        self.refused: Counter[str] = Counter()

    # -- writing -------------------------------------------------------------------------------

    async def send_frame(
        self,
        typ: int,
        flags: int,
        stream_id: int,
        length: int,
        payload: Sequence[bytes | memoryview] = (),
    ) -> None:
        """Write one frame (header plus payload pieces) with one gathering socket send.

        Cancelling the caller never tears a frame: what is still unsent of it stays queued and is
        written first by the next holder of the write lock, or at once by the flusher task.
        """
        header = FRAME_HEADER.pack(0, typ, flags, stream_id, length)
        async with self._write_lock:
            await self._drain_locked()
            await self._send_locked(header, payload)

    def send_control(self, typ: int, flags: int, stream_id: int, length: int) -> None:
        """Queue a control frame without waiting (window updates, ACKs, RSTs, pings).

        The frame reader must never wait on a socket write: if both peers' readers waited on
        writes while both peers' writers waited on full socket buffers, neither would move.
        Queued frames go out, in order, before the next frame of any writer.
        """
        self._control.append(FRAME_HEADER.pack(0, typ, flags, stream_id, length))
        self._flush_wanted.set()

    async def _send_locked(
        self, header: bytes, payload: Sequence[bytes | memoryview] = ()
    ) -> None:
        if self._noise is None:
            await self.secured_conn.write(b"".join([header, *payload]))
            return
        parts: list[bytes | memoryview] = []
        self._noise.seal_frame(parts, header, payload)
        self._unsent = parts  # send_sealed consumes it as the kernel takes bytes
        try:
            await self._noise.send_sealed(parts)
        except trio.Cancelled:
            if parts:
                self._flush_wanted.set()
            raise

    async def _drain_locked(self) -> None:
        """Finish a frame a cancelled writer left half-sent, then send queued control frames."""
        if self._unsent:
            assert self._noise is not None
            try:
                await self._noise.send_sealed(self._unsent)
            except trio.Cancelled:
                self._flush_wanted.set()
                raise
        if self._control:
            # All queued control frames in one Noise message and one socket send.
            headers, self._control = self._control, []
            await self._send_locked(b"".join(headers))

    async def _flusher(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send queued control frames and finish torn frames when no writer is about to."""
        self._flusher_running = True
        task_status.started()
        try:
            while True:
                await self._flush_wanted.wait()
                self._flush_wanted = trio.Event()
                async with self._write_lock:
                    await self._drain_locked()
        except _CONNECTION_ERRORS as error:
            logger.debug("writing to %s failed: %s", self.peer_id, error)
        finally:
            self._flusher_running = False

    async def _write_frame(self, data: bytes) -> None:
        """Control frames from inherited code (FIN, RST, GO_AWAY, pings), minus the log cost.

        Queued while the connection runs, so a close or reset never waits behind a stalled
        frame; written directly before the flusher starts or after it stopped.
        """
        if self._flusher_running:
            self._control.append(bytes(data))
            self._flush_wanted.set()
            return
        async with self._write_lock:
            await self._send_locked(bytes(data))

    # -- streams -------------------------------------------------------------------------------

    def _register(self, stream_id: int, is_initiator: bool) -> FastYamuxStream:
        stream = FastYamuxStream(stream_id, self, is_initiator)
        self.streams[stream_id] = stream
        self.stream_buffers[stream_id] = stream.pieces  # type: ignore[assignment]
        self.stream_events[stream_id] = trio.Event()
        return stream

    async def open_stream(self) -> FastYamuxStream:
        await self.stream_backlog_semaphore.acquire()
        async with self.streams_lock:
            if self.event_shutting_down.is_set():
                self.stream_backlog_semaphore.release()
                raise MuxedStreamError("Connection is shutting down")
            stream_id = self.next_stream_id
            self.next_stream_id += 2
            stream = self._register(stream_id, True)
            stream._owns_backlog_slot = True
        try:
            await self.send_frame(TYPE_WINDOW_UPDATE, FLAG_SYN, stream_id, 0)
        except Exception as error:
            async with self.streams_lock:
                stream.closed = True
                self._finalize_stream_locked(stream, fully_closed=True)
            raise MuxedStreamError(f"Failed to send SYN: {error}") from error
        return stream

    # -- reading -------------------------------------------------------------------------------

    async def _read_plaintext(self) -> list[memoryview]:
        if self._noise is not None:
            return await self._noise.read_pieces()
        data = await self.secured_conn.read(None)
        if not data:
            raise ConnectionClosedError("Connection closed")
        return [memoryview(data)]

    async def handle_incoming(self) -> None:
        """Run the flusher task and parse frames from decrypted socket reads until the end."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._flusher)
            try:
                while not self.event_shutting_down.is_set():
                    for piece in await self._read_plaintext():
                        if not await self._consume(piece):
                            return
            except _CONNECTION_ERRORS as error:
                logger.debug("yamux connection to %s ended: %s", self.peer_id, error)
            except Exception:
                logger.exception("yamux frame reader for %s failed; closing", self.peer_id)
            finally:
                self.event_shutting_down.set()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await self._cleanup_on_error()
                nursery.cancel_scope.cancel()

    async def _consume(self, piece: memoryview) -> bool:
        """Advance the frame parser over ``piece``; False once the connection must end."""
        off, end = 0, len(piece)
        while off < end:
            if self._body_left:
                take = min(self._body_left, end - off)
                stream = self._body_stream
                if stream is not None:
                    stream.pieces.append(piece[off : off + take])
                    event = self.stream_events.get(stream.stream_id)
                    if event is not None:
                        event.set()
                off += take
                self._body_left -= take
                if not self._body_left:
                    self._apply_close_flags(stream, self._body_flags)
                continue
            header = self._header
            need = HEADER_SIZE - len(header)
            header += piece[off : off + need]
            off += min(need, end - off)
            if len(header) < HEADER_SIZE:
                continue
            try:
                typ, flags, stream_id, length = parse_frame_header(header)
            except YamuxFrameError as error:
                await self._protocol_error(str(error))
                return False
            header.clear()
            if not await self._on_frame(typ, flags, stream_id, length):
                return False
        return True

    async def _on_frame(self, typ: int, flags: int, stream_id: int, length: int) -> bool:
        """Act on one frame header (a DATA body follows it); False once the connection must end."""
        if typ == TYPE_DATA:
            stream = await self._on_open_flags(flags, stream_id)
            if stream is not None:
                if length > stream.recv_window:
                    await self._protocol_error(
                        f"DATA frame of {length} B exceeds the window "
                        f"({stream.recv_window} B) on stream {stream_id}"
                    )
                    return False
                stream.recv_window -= length
            if length:
                self._body_left, self._body_stream, self._body_flags = length, stream, flags
            else:
                self._apply_close_flags(stream, flags)
        elif typ == TYPE_WINDOW_UPDATE:
            stream = await self._on_open_flags(flags, stream_id)
            if stream is not None:
                stream.send_window = stream.send_window + length
            self._apply_close_flags(stream, flags)
        elif typ == TYPE_PING:
            await self._on_ping(flags, length)
        else:  # TYPE_GO_AWAY (parse_frame_header admits no other type)
            logger.debug("GO_AWAY (code %d) from %s", length, self.peer_id)
            return False
        return True

    async def _on_open_flags(self, flags: int, stream_id: int) -> FastYamuxStream | None:
        """Handle SYN (a new inbound stream) and find the frame's stream; None if unknown."""
        if flags & FLAG_SYN:
            if stream_id in self.streams or stream_id % 2 == self.next_stream_id % 2:
                logger.debug("bad SYN for stream %d from %s: reset", stream_id, self.peer_id)
                self.send_control(TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0)
                return None
            inbound = sum(1 for stream in self.streams.values() if not stream.is_initiator)
            if inbound >= MAX_INBOUND_STREAMS:
                count_rejection(self.refused, "over_inbound_streams", logger, logging.INFO,
                                "%s has %d inbound streams open; refused stream %d",
                                self.peer_id, inbound, stream_id)
                self.send_control(TYPE_WINDOW_UPDATE, FLAG_RST, stream_id, 0)
                return None
            stream = self._register(stream_id, False)
            if not flags & FLAG_RST:
                self.send_control(TYPE_WINDOW_UPDATE, FLAG_ACK, stream_id, 0)
            await self.new_stream_send_channel.send(stream)
            return stream
        return self.streams.get(stream_id)

    def _apply_close_flags(self, stream: FastYamuxStream | None, flags: int) -> None:
        if stream is None or not flags & (FLAG_FIN | FLAG_RST):
            return
        if flags & FLAG_FIN:
            stream.recv_closed = True
            if stream.send_closed:
                stream.closed = True
        if flags & FLAG_RST:
            stream.closed = True
            stream.reset_received = True
        event = self.stream_events.get(stream.stream_id)
        if event is not None:
            event.set()
        if stream.closed:
            self._finalize_stream_locked(stream, fully_closed=True)

    async def _on_ping(self, flags: int, opaque: int) -> None:
        if flags & FLAG_SYN:
            self.send_control(TYPE_PING, FLAG_ACK, 0, opaque)
        elif flags & FLAG_ACK:
            sample = trio.current_time() - self._ping_sent_time
            self._rtt = sample if self._rtt == 0.0 else (self._rtt + sample) / 2
            self._ping_event.set()

    async def _protocol_error(self, why: str) -> None:
        logger.warning("yamux protocol error from %s: %s; closing", self.peer_id, why)
        self.send_control(TYPE_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR)


class _MuxerMultistream(MuxerMultistream):
    """Muxer negotiation that builds the negotiated class (py-libp2p's builds its own Yamux)."""

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        protocol, muxer_class = await self._selector.select(
            conn, conn.is_initiator, self.negotiate_timeout
        )
        if protocol is None or muxer_class is None:
            raise MuxedStreamError("no stream muxer negotiated")
        return self._annotate_connection(muxer_class(conn, peer_id), conn, protocol)


def muxer_options() -> dict[TProtocol, type[IMuxedConn]]:
    """The muxer options for ``libp2p.new_host``: our yamux under the standard protocol ID."""
    return {TProtocol(PROTOCOL_ID): FastYamux}


def install(host: IHost) -> None:
    """Make ``host`` negotiate our yamux class (call before the host runs)."""
    upgrader = host.get_network().upgrader  # type: ignore[attr-defined]
    upgrader.muxer_multistream = _MuxerMultistream(
        muxer_options(), upgrader.muxer_multistream.negotiate_timeout
    )
