"""A yamux stream with large frames, batched window credit and an event-driven writer.

The stream half of our yamux (``net/_muxer.py`` holds the connection: frame reader, writer lock,
control frames). Writers send DATA frames of up to :data:`MAX_FRAME` within the peer's window and
sleep on an event while it is empty; readers take zero-copy slices of decrypted Noise messages
(:class:`_Pieces`) and return credit in batches of half the window, doubling it up to
:data:`~p2ptrain.net._yamux_frames.RECV_WINDOW` (go-yamux's rule).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import trio
from libp2p.stream_muxer.exceptions import (
    MuxedStreamEOF,
    MuxedStreamError,
    MuxedStreamReset,
)
from libp2p.stream_muxer.yamux.yamux import (
    DEFAULT_WINDOW_SIZE,
    TYPE_DATA,
    TYPE_WINDOW_UPDATE,
    YamuxStream,
)

from p2ptrain.net._yamux_frames import RECV_WINDOW

if TYPE_CHECKING:
    from p2ptrain.net._muxer import FastYamux

__all__ = ["FastYamuxStream", "MAX_FRAME"]

# Largest DATA frame we send. Bigger frames amortize per-frame Python work; the peer's window
# still bounds every frame.
MAX_FRAME = 1 << 20


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
