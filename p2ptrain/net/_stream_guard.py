"""The boundary around every inbound stream handler we register: :class:`StreamGuard`.

A peer can open streams to us for free, and libp2p calls a protocol's handler for each one; the guard
caps how many one peer holds open and turns anything a handler raises into a counted reset of that one
stream. :func:`p2ptrain.net.serve_channels` puts every channel protocol behind one; Bitswap uses one
directly. Apart from :mod:`p2ptrain.net._streams` (the framed channel) because it guards any stream,
framed or not.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from p2ptrain.base import count_rejection, short_id

logger = logging.getLogger(__name__)

# Longest a close or reset may take (it queues one small frame behind at most one in flight).
CLOSE_TIMEOUT_S = 2.0


StreamHandler = Callable[[INetStream], Awaitable[None]]


class StreamGuard:
    """The boundary around one protocol's inbound stream handler: a per-peer cap on open streams,
    and any unexpected exception turned into a counted, logged reset of that one stream.

    Why here: a handler is called by libp2p's stream machinery, where an escaping exception tears
    down the whole connection to the peer (or worse), and a peer can open streams for free: without
    a cap each one holds a task, a receive window and whatever the handler buffers.
    """

    def __init__(self, protocol: str, max_streams_per_peer: int) -> None:
        self.protocol = protocol
        self.max_streams_per_peer = max_streams_per_peer
        self._open: dict[ID, int] = {}
        # What was refused or failed, by reason; read by ``stats()`` (node status).
        self.counters: collections.Counter[str] = collections.Counter()

    def open_streams(self, peer_id: ID) -> int:
        """Inbound streams of this protocol now open from ``peer_id``."""
        return self._open.get(peer_id, 0)

    def wrap(self, handler: StreamHandler) -> StreamHandler:
        """``handler`` behind the cap and the exception boundary."""

        async def guarded(stream: INetStream) -> None:
            peer = stream.muxed_conn.peer_id
            if self._open.get(peer, 0) >= self.max_streams_per_peer:
                count_rejection(
                    self.counters, "over_stream_cap", logger, logging.INFO,
                    "%s: peer %s already has %d streams open; reset the new one",
                    self.protocol, short_id(peer), self.max_streams_per_peer,
                )
                await reset_stream(stream)
                return
            self._open[peer] = self._open.get(peer, 0) + 1
            try:
                await handler(stream)
            except Exception:
                count_rejection(
                    self.counters, "handler_error", logger, logging.ERROR,
                    "%s: handler for a stream from %s failed; stream reset",
                    self.protocol, short_id(peer), exc_info=True,
                )
                await reset_stream(stream)
            finally:
                self._open[peer] -= 1
                if not self._open[peer]:
                    del self._open[peer]

        return guarded

    def stats(self) -> dict[str, int]:
        """Counters plus the number of inbound streams open now (all peers)."""
        return {**self.counters, "open_streams": sum(self._open.values())}


async def reset_stream(stream: INetStream) -> None:
    """Reset ``stream``, bounded and shielded; a stream whose connection is gone is fine."""
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
        try:
            await stream.reset()
        except Exception as error:
            logger.debug("reset of a stream failed: %s", error)
