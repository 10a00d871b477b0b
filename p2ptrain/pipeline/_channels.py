"""A sender's channels to the replicas it asks, kept open and reused hop after hop.

Why: opening a channel per hop (a yamux stream and a multistream-select negotiation, then a close)
was a fixed cost of every request of the stage protocol, paid 5 times per microbatch by every driver
(docs/benchmarks.md, "where a pipelined step goes"). Since ``/p2ptrain/pipeline/1.1.0`` a channel
carries any number of requests, one at a time, each followed by its answer (the frames are the same),
so a sender keeps the channels whose last exchange completed and takes one of them for its next hop
to that replica, step after step and plan after plan.

A channel goes back to the pool only after a whole exchange that the sender accepted: a request
whose answer failed, was refused, came too late (a cancelled hop: its answer may still be on its way
and would be read as the next request's) or did not answer the request is reset, never reused, so
an answer is always the answer to the request just sent on that channel. A channel idle for
``idle_s`` is closed instead of reused, well before the replica gives up on it
(:data:`~p2ptrain.pipeline._replica.IDLE_TIMEOUT_S`): a hop never lands on a channel the replica is
closing. At most ``keep`` idle channels are kept per replica (the hops a sender has in flight there);
more would only hold streams against the replica's per-peer cap.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from libp2p.abc import IHost
from libp2p.peer.id import ID

from p2ptrain.net import Channel, open_channel
from p2ptrain.pipeline._replica import IDLE_TIMEOUT_S

# Longest a sender keeps an idle channel for reuse: half the time a replica waits on it.
POOL_IDLE_S = IDLE_TIMEOUT_S / 2
# Idle channels kept per replica: the runtime's microbatches in flight per driver (run/_stages.py).
KEEP_PER_PEER = 4


class ChannelPool:
    """Idle channels of one protocol to each peer, reused by :meth:`channel`. ``clock``: seconds,
    monotonic (the sender's, injected)."""

    def __init__(
        self, host: IHost, protocol: str, *, clock: Callable[[], float], idle_s: float = POOL_IDLE_S,
        keep: int = KEEP_PER_PEER,
    ) -> None:
        self.host, self.protocol, self.clock = host, protocol, clock
        self.idle_s, self.keep = idle_s, keep
        self._idle: dict[ID, collections.deque[tuple[Channel, float]]] = {}  # newest last, with when it idled
        self.opened = 0  # channels opened (the rest of the hops reused one)
        self.reused = 0

    @asynccontextmanager
    async def channel(self, peer: ID) -> AsyncIterator[Channel]:
        """A channel to ``peer`` for one request and its answer: an idle one, or a new one. It goes
        back to the pool when the block ends normally, and is reset when the block raises (or is
        cancelled): whatever the peer may still send on it is never read as another answer."""
        channel = await self._take(peer)
        try:
            yield channel
        except BaseException:
            await channel.reset()
            raise
        idle = self._idle.setdefault(peer, collections.deque())
        idle.append((channel, self.clock()))
        while len(idle) > self.keep:
            await idle.popleft()[0].aclose()

    async def _take(self, peer: ID) -> Channel:
        idle = self._idle.get(peer)
        now = self.clock()
        while idle:
            channel, since = idle.pop()
            if now - since < self.idle_s:
                self.reused += 1
                return channel
            await channel.aclose()
            while idle:  # the older ones idled longer still
                await idle.popleft()[0].aclose()
        self.opened += 1
        return await open_channel(self.host, peer, self.protocol)

    def idle(self, peer: ID) -> int:
        """Idle channels kept to ``peer``."""
        return len(self._idle.get(peer, ()))

    async def aclose(self) -> None:
        """Close every idle channel (the sender is done with the protocol)."""
        idle, self._idle = self._idle, {}
        for channels in idle.values():
            for channel, _ in channels:
                await channel.aclose()
