"""Dialer: one host's outbound round channels: HELLO until READY, and the idle ones kept for reuse.

Split from :mod:`p2ptrain.collective._round_hub` (whose docstring says why channels outlive rounds);
its limits stay named there (``_REUSE_S``, ``_IDLE_PER_PEER``, ``_BUSY_RETRY_S``) and are passed in.
"""

from __future__ import annotations

import logging
import time

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from p2ptrain.collective._failures import BadPayload, PeerFailed
from p2ptrain.collective._links import wait_for_abort_notice
from p2ptrain.base import short_id
from p2ptrain.net import Channel, ChannelError, has_direct_connection, open_channel, over_relay
from p2ptrain.wire import MAX_FIRST_FRAME, Kind, hello_frame, is_busy, parse_abort, parse_header

logger = logging.getLogger(__name__)


class Dialer:
    """Opens a host's round channels to its peers, reusing the idle ones young enough."""

    def __init__(self, host: IHost, protocol: str, *, reuse_s: float, per_peer: int, busy_retry_s: float) -> None:
        self.host = host
        self.protocol = protocol
        self._reuse_s = reuse_s  # an idle channel older than this is closed, not reused
        self._per_peer = per_peer  # idle channels kept per peer
        self._busy_retry_s = busy_retry_s  # wait before saying HELLO again after BUSY
        self.idle: dict[ID, list[tuple[Channel, float]]] = {}  # per peer: (channel, idle since), oldest first
        self.opened = 0  # channels opened so far (reuse keeps this low)

    async def dial(self, round_id: int, right: ID, digest: bytes, timeout: float) -> Channel:
        """A channel to ``right`` on which it has joined round ``round_id`` (answered READY)."""
        hello = hello_frame(round_id, digest)
        try:
            with trio.fail_after(timeout):
                while True:
                    channel = await self._take_idle(right)
                    reused = channel is not None
                    if channel is None:
                        channel = await open_channel(self.host, right, self.protocol)
                        self.opened += 1
                    try:
                        await channel.send(hello)
                        frame = await channel.recv(MAX_FIRST_FRAME)
                        if is_busy(frame, round_id):
                            # It has not seen the plan naming us yet: ask again on a fresh channel.
                            await channel.aclose()
                            await trio.sleep(self._busy_retry_s)
                            continue
                        break
                    except ChannelError as error:
                        await channel.reset()
                        if not reused:
                            raise
                        logger.debug("collective: idle channel to %s was gone: %s", short_id(right), error)
                    except BaseException:
                        await channel.reset()
                        raise
        except trio.TooSlowError:
            raise PeerFailed(right, f"did not join round {round_id} within {timeout:g} s") from None
        except ChannelError as error:
            # Also what a member sees when the peer took our HELLO and then its round failed for
            # another reason: the reset of this stream outruns the notice, which needs a stream
            # of its own. Give the notice time to arrive before blaming the peer.
            await wait_for_abort_notice()
            raise PeerFailed(right, f"cannot reach it: {error}", gone=True) from error
        try:
            header = parse_header(frame)
            if header.kind == Kind.ABORT:
                culprit, reason = parse_abort(frame, header)
                if culprit == right:
                    raise PeerFailed(right, f"refused the round: {reason}")
                raise PeerFailed(culprit, reason, reported_by=right)  # the round failed there already
            if header.kind != Kind.READY or header.round_id != round_id:
                raise ValueError(f"expected READY for round {round_id}, got {header}")
        except ValueError as error:
            await channel.reset()
            raise BadPayload(right, str(error)) from None
        except PeerFailed:
            await channel.reset()
            raise
        return channel

    async def _take_idle(self, peer: ID) -> Channel | None:
        """An idle channel to ``peer`` young enough to reuse, if any (older ones are closed, and so
        is one over a relay once a direct connection to ``peer`` exists: after a hole punch the
        relayed connection is kept, and reusing its channels would hold every later round on the
        relay; a fresh stream takes the direct connection)."""
        pool = self.idle.get(peer, [])
        while pool:
            channel, since = pool.pop()
            if not pool and self.idle.get(peer) is pool:
                del self.idle[peer]
            superseded = over_relay(channel.connection) and has_direct_connection(self.host, peer)
            if time.monotonic() - since < self._reuse_s and not superseded:
                return channel
            await channel.aclose()
        return None

    async def release(self, peer: ID, channel: Channel) -> None:
        """Keep a channel whose round ended cleanly for the next round with ``peer``; close the
        idle channels too old to reuse (so peers that left the run leave nothing behind)."""
        now = time.monotonic()
        for other, idle in list(self.idle.items()):
            while idle and now - idle[0][1] >= self._reuse_s:  # oldest first
                await idle.pop(0)[0].aclose()
            if not idle and self.idle.get(other) is idle:  # (another round may have replaced it)
                del self.idle[other]
        pool = self.idle.setdefault(peer, [])
        if len(pool) >= self._per_peer:
            await channel.aclose()
        else:
            pool.append((channel, now))
