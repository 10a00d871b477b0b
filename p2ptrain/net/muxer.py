"""Yamux with a bulk-transfer fast path, speaking the standard yamux wire format.

Profiling py-libp2p's yamux at bulk rates (docs/streams.md) puts the time in Python work per frame:
64 KiB frames, two socket reads per Noise message, a window update after every ``read()``, a
per-frame f-string log line, and a writer that polls every 10 ms and fails after 5 s without window.
This module keeps py-libp2p's :class:`~libp2p.stream_muxer.yamux.yamux.Yamux` (connection lifecycle,
close, reset, GO_AWAY, RTT pings, stale-stream sweeping) and replaces the data path:

* writers send DATA frames of up to :data:`MAX_FRAME` bytes, within the peer's window (a frame up
  to the window is legal yamux; a stock py-libp2p receiver accepts up to 16 MiB);
* each stream returns credit in batches of half its window, as go-yamux does, and doubles the
  window with each batch from yamux's 256 KiB up to :data:`RECV_WINDOW` (16 MiB);
* the frame reader takes whole decrypted socket reads from :class:`~p2ptrain.net.noise.NoiseSession`
  and hands payload slices to streams without copying them;
* a writer waiting for window sleeps on an event (woken by the window update, a close or a reset)
  and waits as long as its caller lets it: deadlines belong to the caller's cancel scope, not to a
  hidden 5 s timer.
* a cancelled writer never tears a frame: the unsent rest is finished first by the next writer or
  by a flusher task; control frames (window updates, ACKs, FIN/RST) are queued and go out before
  the next frame, so neither the frame reader nor a close ever waits on the socket.

The muxer class is installed by :func:`install`, because py-libp2p's muxer negotiation hard-codes
its own ``Yamux`` class for ``/yamux/1.0.0``.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import trio
from libp2p.abc import IHost, IMuxedConn, ISecureConn
from libp2p.custom_types import TProtocol
from libp2p.io.exceptions import ConnectionClosedError, IncompleteReadError, IOException
from libp2p.network.connection.exceptions import RawConnError
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import (
    MuxedStreamEOF,
    MuxedStreamError,
    MuxedStreamReset,
)
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import (
    DEFAULT_WINDOW_SIZE,
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
    YAMUX_HEADER_FORMAT,
    Yamux,
    YamuxStream,
)

from p2ptrain.logs import count_rejection
from p2ptrain.net.noise import NoiseSession

logger = logging.getLogger(__name__)

# Largest DATA frame we send. Bigger frames amortize per-frame Python work; the peer's window
# still bounds every frame.
MAX_FRAME = 1 << 20
# Largest receive window per stream (go-yamux's maximum): the most unread data a stream can hold.
RECV_WINDOW = 16 << 20
# Inbound streams a peer may have open on one connection; a SYN beyond it is answered with RST.
# Every protocol handler caps its own streams per peer (collective 16, Bitswap 4), but a stream
# holds up to yamux's initial 256 KiB window of unread data before any handler sees it (during
# protocol negotiation): 128 streams bound that to 32 MiB per connection.
MAX_INBOUND_STREAMS = 128

_HEADER = struct.Struct(YAMUX_HEADER_FORMAT)
_KNOWN_FLAGS = FLAG_SYN | FLAG_ACK | FLAG_FIN | FLAG_RST
_KNOWN_TYPES = (TYPE_DATA, TYPE_WINDOW_UPDATE, TYPE_PING, TYPE_GO_AWAY)


class YamuxFrameError(ValueError):
    """A frame header that no yamux peer may send; the connection is ended with GO_AWAY."""


def parse_frame_header(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """``(type, flags, stream_id, length)`` of a 12-byte yamux frame header, checked as go-yamux
    checks it: version 0, a known type, only known flags, a stream ID on DATA and WINDOW_UPDATE,
    and no DATA frame longer than the largest window we ever grant (:data:`RECV_WINDOW`), so a
    frame is refused before any of its body is buffered. :class:`YamuxFrameError` is its only error.
    """
    if len(raw) != HEADER_SIZE:
        raise YamuxFrameError(f"frame header of {len(raw)} bytes (expected {HEADER_SIZE})")
    version, typ, flags, stream_id, length = _HEADER.unpack(raw)
    if version != 0:
        raise YamuxFrameError(f"yamux version {version}")
    if typ not in _KNOWN_TYPES:
        raise YamuxFrameError(f"unknown frame type {typ}")
    if flags & ~_KNOWN_FLAGS:
        raise YamuxFrameError(f"unknown flags {flags:#x}")
    if typ in (TYPE_DATA, TYPE_WINDOW_UPDATE) and stream_id == 0:
        raise YamuxFrameError("DATA or WINDOW_UPDATE on stream 0")
    if typ == TYPE_DATA and length > RECV_WINDOW:
        raise YamuxFrameError(f"DATA frame of {length} B exceeds any window ({RECV_WINDOW} B)")
    return typ, flags, stream_id, length
_CONNECTION_ERRORS = (
    ConnectionClosedError,
    RawConnError,
    IncompleteReadError,
    IOException,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


class _Pieces:
    """A stream's unread bytes as a queue of zero-copy slices of decrypted Noise messages.

    ``len()`` and truthiness count bytes, which is what py-libp2p's inherited bookkeeping asks of a
    stream buffer.
    """

    __slots__ = ("_queue", "_len")

    def __init__(self) -> None:
        self._queue: deque[memoryview] = deque()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, piece: memoryview) -> None:
        self._queue.append(piece)
        self._len += len(piece)

    def clear(self) -> None:
        self._queue.clear()
        self._len = 0

    def take(self, n: int) -> list[memoryview]:
        """Remove and return up to ``n`` bytes as slices."""
        out: list[memoryview] = []
        queue = self._queue
        while n > 0 and queue:
            piece = queue[0]
            if len(piece) <= n:
                queue.popleft()
                out.append(piece)
                n -= len(piece)
                self._len -= len(piece)
            else:
                out.append(piece[:n])
                queue[0] = piece[n:]
                self._len -= n
                n = 0
        return out


class FastYamuxStream(YamuxStream):
    """A yamux stream with large frames, batched window credit and an event-driven writer."""

    conn: FastYamux

    def __init__(self, stream_id: int, conn: FastYamux, is_initiator: bool) -> None:
        self._window_changed = trio.Event()
        super().__init__(stream_id, conn, is_initiator)
        self.pieces = _Pieces()
        self._write_lock = trio.Lock()
        self._unacked = 0  # bytes read but not yet credited back to the peer
        self._window_target = DEFAULT_WINDOW_SIZE  # the receive window we let the peer fill

    # send_window and closed wake a writer waiting for window; the inherited code and our frame
    # reader assign them directly.
    @property
    def send_window(self) -> int:
        return self._send_window

    @send_window.setter
    def send_window(self, value: int) -> None:
        self._send_window = value
        self._window_changed.set()

    @property
    def closed(self) -> bool:
        return self._closed_flag

    @closed.setter
    def closed(self, value: bool) -> None:
        self._closed_flag = value
        self._window_changed.set()

    # -- writing -------------------------------------------------------------------------------

    async def write(self, data: bytes | memoryview, *, prefix: bytes = b"") -> None:
        """Send ``prefix + data`` as DATA frames; waits for window as long as the caller allows."""
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        if prefix:
            # Sent inside the first frame, so a small header and its payload share a Noise message.
            total = len(prefix) + len(view)
        else:
            total = len(view)
        async with self._write_lock:
            sent = 0
            while sent < total:
                if self.send_closed:
                    raise MuxedStreamError("Stream is closed for sending")
                if self.closed or self.conn.event_shutting_down.is_set():
                    raise MuxedStreamReset("Stream is closed")
                if self._send_window <= 0:
                    self._window_changed = trio.Event()
                    await self._window_changed.wait()
                    continue
                n = min(self._send_window, MAX_FRAME, total - sent)
                self._send_window -= n
                if sent < len(prefix):
                    head = prefix[sent:]
                    if n < len(head):
                        chunk: list[bytes | memoryview] = [head[:n]]
                    else:
                        chunk = [head, view[: n - len(head)]]
                else:
                    start = sent - len(prefix)
                    chunk = [view[start : start + n]]
                await self.conn.send_frame(TYPE_DATA, 0, self.stream_id, n, chunk)
                sent += n

    # -- reading -------------------------------------------------------------------------------

    async def read_pieces(self, max_bytes: int) -> list[memoryview]:
        """Up to ``max_bytes`` of received data as zero-copy slices; waits for at least one byte.

        Raises :class:`MuxedStreamEOF` after a clean end and :class:`MuxedStreamReset` after a
        reset, once all data received before them has been read.
        """
        while True:
            if self.pieces:
                out = self.pieces.take(max_bytes)
                if self.closed and not self.pieces:
                    # Drained after a full close: drop the bookkeeping now, not at the next sweep.
                    await self.conn._finalize_stream(self, fully_closed=True)
                else:
                    await self._credit(sum(len(p) for p in out))
                return out
            if self.reset_received:
                raise MuxedStreamReset("Stream was reset")
            if self.recv_closed:
                raise MuxedStreamEOF("Stream is closed for receiving")
            if self.conn.event_shutting_down.is_set():
                raise MuxedStreamEOF("Connection shut down")
            event = self.conn.stream_events.get(self.stream_id)
            if event is None:
                raise MuxedStreamEOF("Stream was removed")
            await event.wait()
            if self.conn.stream_events.get(self.stream_id) is event:
                self.conn.stream_events[self.stream_id] = trio.Event()

    async def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            n = 1 << 62
        return b"".join(await self.read_pieces(n))

    async def _credit(self, n: int) -> None:
        """Return window to the peer once half of it has been read (go-yamux's batching rule).

        The window starts at yamux's 256 KiB and doubles with each update up to
        :data:`RECV_WINDOW`, so a stream only gets a large buffer once its reader has shown it
        drains one: a peer cannot park 16 MiB on every stream it opens.
        """
        self._unacked += n
        if self._unacked < self._window_target // 2 or self.recv_closed or self.closed:
            return
        increment, self._unacked = self._unacked, 0
        if self._window_target < RECV_WINDOW:
            increment += self._window_target
            self._window_target *= 2
        self.recv_window += increment
        self.conn.send_control(TYPE_WINDOW_UPDATE, 0, self.stream_id, increment)


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
        header = _HEADER.pack(0, typ, flags, stream_id, length)
        async with self._write_lock:
            await self._drain_locked()
            await self._send_locked(header, payload)

    def send_control(self, typ: int, flags: int, stream_id: int, length: int) -> None:
        """Queue a control frame without waiting (window updates, ACKs, RSTs, pings).

        The frame reader must never wait on a socket write: if both peers' readers waited on
        writes while both peers' writers waited on full socket buffers, neither would move.
        Queued frames go out, in order, before the next frame of any writer.
        """
        self._control.append(_HEADER.pack(0, typ, flags, stream_id, length))
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
