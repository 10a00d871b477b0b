"""Rounds: who talks to whom for one all-reduce, with deadlines and abort notices.

A round is identified by its round id and agreed by digest (round id, ring order, shape, dtype,
algorithm). Each member sends on one channel to each peer it feeds (its right neighbour in a ring,
everyone in a mesh) and receives on one channel from each peer that feeds it. A round starts on a
channel with HELLO (round id + digest), answered by READY once the receiving member has joined.

Channels outlive rounds: opening a libp2p stream costs protocol negotiation round trips (15-25 ms of
a round on a loaded 2-core box, most of a small round), so after a round that ended cleanly on a
member its channels wait for the next HELLO instead of closing. Only a clean round leaves a channel
at a message boundary (every frame of the schedule consumed), so a member whose round failed or was
cancelled resets its channels: frames of an aborted round never reach a later one (and every frame
carries its round id besides). A sender whose idle channel turns out dead (the receiver's side of
the last round failed, or it dropped the idle channel) opens a fresh one: HELLO is safe to repeat.

When a member sees a neighbour die, stall past the hop deadline, or send a bad frame, it tells every
other member with an ABORT notice naming that peer, then leaves. Members that were merely waiting on
a healthy neighbour therefore fail within milliseconds with the true culprit named, instead of each
timing out and blaming whoever sits to its left.

The culprit is told too when it was silent or late rather than gone (a dial to a dead peer would
only hold up the report), and a member asked to join a round that already failed here answers
with the same notice. A member that is merely late (it got the plan after the
others gave up on it) then learns that it was the one named, instead of finding its neighbours gone
and blaming them: a healthy peer wrongly blamed would be left out of the next rings it plans.

One exception: in a sampled robust round, the notices of the owner of a chunk drawn for checking
wait for its verifier's verdict (:mod:`p2ptrain.collective._notice_hold`): otherwise the owner
could end the round naming someone else as soon as it learns that its chunk is checked.
"""

from __future__ import annotations

import collections
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from p2ptrain.collective._failures import CollectiveError, PeerFailed, single_failure
from p2ptrain.collective._dialing import Dialer
from p2ptrain.collective._inbox import Arrival, Inbox
from p2ptrain.collective._links import RoundLinks, wait_for_abort_notice
from p2ptrain.collective._notice_hold import NoticeHold
from p2ptrain.base import count_rejection, short_id
from p2ptrain.net import Channel, ChannelError, StreamGuard, open_channel, serve_channels
from p2ptrain.wire import HEADER, MAX_FIRST_FRAME, PROTOCOL, Kind, abort_frame, busy_frame, parse_abort, parse_header, ready_frame

logger = logging.getLogger(__name__)

_ABORT_SEND_S = 2.0
# Bound on telling a dialer whose round digest differs from ours (it may not be reading).
_MISMATCH_NOTICE_S = 1.0
# The notice to the culprit itself is bounded tighter: it is often dead, and a dial to a vanished
# machine hangs where a live one answers in milliseconds.
_CULPRIT_NOTICE_S = 0.5
# How long a fresh inbound channel may take to send its first frame (HELLO or ABORT).
_FIRST_FRAME_S = 10.0
# A dialer told BUSY waits this long before it says HELLO again on a fresh channel (until its start
# deadline): the receiver has not yet seen the plan naming us, and nothing tells us when it will.
_BUSY_RETRY_S = 0.05
# Rings of the last rounds opened here whose members may park HELLOs (besides RoundHub.expect).
_RECENT_RINGS = 4
# Open inbound collective streams per peer: a mesh round uses one per peer, plus up to
# _IDLE_PER_PEER idle ones, _PENDING_PER_PEER parked ones and a few abort notices.
_STREAMS_PER_PEER = 16
_MEMORY = 1024
# How long a channel waits for its next round. A sender stops reusing a channel well before the
# receiver drops it, so the two rarely cross (and when they do, the sender opens a fresh one).
_IDLE_S = 120.0
_REUSE_S = _IDLE_S - 20.0
# Idle channels kept per peer and direction (concurrent rounds with one peer open more).
_IDLE_PER_PEER = 2


@dataclass
class _Round:
    round_id: int
    ring: list[ID]
    scope: trio.CancelScope
    abort: PeerFailed | None = None
    notices: NoticeHold | None = None  # set once the round opens

    def end(self, failure: PeerFailed) -> None:
        """A member's notice ends the round here (the first one only)."""
        if self.abort is None:
            logger.info("collective: round %d aborted: %s", self.round_id, failure)
            self.abort = failure
            self.scope.cancel()


class RoundHub:
    """Accepts round channels and abort notices for one host, and opens rounds for its callers."""

    def __init__(self, host: IHost, protocol: str = PROTOCOL) -> None:
        self.host = host
        self.protocol = protocol
        self.me = host.get_id()
        self._active: dict[int, _Round] = {}
        self._inbox = Inbox()
        self._early_aborts: OrderedDict[int, tuple[ID, PeerFailed]] = OrderedDict()
        # Rounds ended here, with the failure that ended each (None: it completed).
        self._finished: OrderedDict[int, PeerFailed | None] = OrderedDict()
        self._idle_in: dict[ID, int] = {}
        self.dialer = Dialer(
            host, protocol, reuse_s=_REUSE_S, per_peer=_IDLE_PER_PEER, busy_retry_s=_BUSY_RETRY_S
        )
        # Who may park a HELLO: the members of the plan the caller follows, and of recent rings.
        self._expected: frozenset[ID] = frozenset()
        self._recent_rings: deque[frozenset[ID]] = deque(maxlen=_RECENT_RINGS)
        self.refused: collections.Counter[str] = collections.Counter()
        self._guard: StreamGuard = serve_channels(
            host, protocol, self._on_channel, max_streams_per_peer=_STREAMS_PER_PEER
        )

    @property
    def channels_opened(self) -> int:
        """Outbound channels opened so far (reuse keeps this low)."""
        return self.dialer.opened

    def expect(self, members: Iterable[ID]) -> None:
        """The members of the plan this host follows now: only they (and the members of its last
        rounds) may open round channels before the round opens here. A HELLO from anyone else is
        answered BUSY at once and counted; a member this hub has not heard of yet retries."""
        self._expected = frozenset(members)

    def announce(self, round_id: int, within: float) -> None:
        """``round_id`` opens here within ``within`` seconds, maybe after the collective's parking
        window: its members' channels that arrive first wait for it (:meth:`Inbox.announce`)."""
        self._inbox.announce(round_id, within)

    def stats(self) -> dict[str, int]:
        """What the inbound side refused, by reason, and what it holds now (for node status)."""
        return {
            **self._guard.stats(),
            **{f"refused_{why}": n for why, n in self.refused.items()},
            "parked": len(self._inbox),
        }

    def _known(self, peer: ID) -> bool:
        if peer in self._expected:
            return True
        if any(peer in state.ring for state in self._active.values()):
            return True
        return any(peer in ring for ring in self._recent_rings)

    # ---- inbound -------------------------------------------------------------------------------

    async def _on_channel(self, channel: Channel) -> None:
        """Serve one inbound channel: a round per HELLO, for as long as its rounds end cleanly."""
        peer = channel.remote_peer
        idle = False
        while True:
            frame = await self._next_frame(channel, idle)
            if not frame:
                return
            try:
                header = parse_header(frame)
            except ValueError as error:
                count_rejection(self.refused, "bad_frame", logger, logging.INFO,
                                "collective: refused a channel from %s: %s", short_id(peer), error)
                return
            if header.kind == Kind.ABORT:
                try:
                    culprit, reason = parse_abort(frame, header)
                except ValueError as error:
                    count_rejection(self.refused, "bad_frame", logger, logging.INFO,
                                    "collective: bad abort notice from %s: %s", short_id(peer), error)
                    return
                self._on_abort(header.round_id, peer, PeerFailed(culprit, reason, reported_by=peer))
                return
            if header.kind != Kind.HELLO:
                count_rejection(self.refused, "bad_frame", logger, logging.INFO,
                                "collective: %s from %s as a channel's first frame", header, short_id(peer))
                return
            if not await self._park(header.round_id, peer, channel, frame[HEADER.size :]):
                await channel.reset()  # possibly mid-message: the sender must not reuse it
                return
            idle = True

    async def _next_frame(self, channel: Channel, idle: bool) -> bytes:
        """The first frame of the channel's next round; empty if it ends or stays silent."""
        peer = channel.remote_peer
        if idle:
            if self._idle_in.get(peer, 0) >= _IDLE_PER_PEER:
                return b""
            self._idle_in[peer] = self._idle_in.get(peer, 0) + 1
        try:
            with trio.move_on_after(_IDLE_S if idle else _FIRST_FRAME_S):
                return await channel.recv(MAX_FIRST_FRAME)
            return b""
        except ChannelError:
            return b""  # the sender dropped it, or went away
        finally:
            if idle:
                self._idle_in[peer] -= 1
                if not self._idle_in[peer]:
                    del self._idle_in[peer]

    async def _park(self, round_id: int, peer: ID, channel: Channel, digest: bytes) -> bool:
        """Hold an inbound round channel until its round claims it (:class:`Inbox`), then until it
        ends.

        True if the round ended cleanly here, so the channel can carry the next one.
        """
        busy = self._busy_reason(round_id, peer)
        if busy is not None:
            count_rejection(self.refused, busy, logger, logging.INFO,
                            "collective: answered BUSY to a round %d channel from %s", round_id,
                            short_id(peer))
            await self._answer_busy(channel, round_id)
            return False
        if round_id in self._finished or (round_id, peer) in self._inbox:
            count_rejection(self.refused, "stale_hello", logger, logging.INFO,
                            "collective: refused round %d channel from %s", round_id, short_id(peer))
            failure = self._finished.get(round_id)
            if failure is not None:  # a late member: tell it why the round is over
                with trio.move_on_after(_CULPRIT_NOTICE_S):
                    try:
                        await channel.send(abort_frame(round_id, failure.peer_id, failure.reason))
                    except ChannelError:
                        pass
            return False
        arrival = await self._inbox.park(round_id, peer, channel, digest)
        if arrival is None:
            count_rejection(self.refused, "park_expired", logger, logging.INFO,
                            "collective: round %d channel from %s expired unclaimed", round_id,
                            short_id(peer))
            return False
        await arrival.released.wait()
        return arrival.reusable

    def _busy_reason(self, round_id: int, peer: ID) -> str | None:
        """Why a HELLO may not park now (a counter name), or None if it may."""
        active = self._active.get(round_id)
        if active is not None:
            # The round is open here: only its own members may join it, and they are awaited.
            return None if peer in active.ring else "hello_not_member"
        if not self._known(peer):
            return "hello_not_member"
        return self._inbox.full_for(peer)

    async def _answer_busy(self, channel: Channel, round_id: int) -> None:
        """Tell the dialer to retry later (bounded: it may not be reading), then close."""
        with trio.move_on_after(_CULPRIT_NOTICE_S):
            try:
                await channel.send(busy_frame(round_id))
            except ChannelError:
                pass

    def _on_abort(self, round_id: int, reporter: ID, failure: PeerFailed) -> None:
        if not self._known(reporter):
            # Only a member may abort a round, and only members' early notices are kept: a stranger
            # must not push real ones out of the bounded memory.
            count_rejection(self.refused, "abort_not_member", logger, logging.INFO,
                            "collective: ignored an abort notice from %s (no plan names it)",
                            short_id(reporter))
            return
        current = self._active.get(round_id)
        if current is not None:
            if reporter in current.ring and current.abort is None and current.notices is not None:
                current.notices.notice(reporter, failure)  # acted on now, unless its sender is held
        elif round_id not in self._finished:
            self._early_aborts[round_id] = (reporter, failure)
            while len(self._early_aborts) > _MEMORY:
                self._early_aborts.popitem(last=False)

    # ---- outbound ------------------------------------------------------------------------------

    async def broadcast_abort(
        self, ring: list[ID], round_id: int, culprit: ID, reason: str, *, tell_culprit: bool = True
    ) -> None:
        """Tell every other member that the round failed, and the culprit too unless its channel
        broke (it is gone, or left the round itself); best effort, bounded."""
        frame = abort_frame(round_id, culprit, reason)

        async def tell(peer: ID) -> None:
            with trio.move_on_after(_CULPRIT_NOTICE_S if peer == culprit else _ABORT_SEND_S):
                try:
                    channel = await open_channel(self.host, peer, self.protocol)
                    async with channel:
                        await channel.send(frame)
                except ChannelError as error:
                    logger.debug("collective: abort notice to %s failed: %s", short_id(peer), error)

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for peer in ring:
                    if peer != self.me and (tell_culprit or peer != culprit):
                        nursery.start_soon(tell, peer)

    async def _accept(self, round_id: int, left: ID, digest: bytes, timeout: float) -> Arrival:
        arrival = await self._inbox.claim(round_id, left, timeout)
        if arrival is None:
            raise PeerFailed(left, f"did not open its round {round_id} channel within {timeout:g} s")
        if arrival.digest != digest:
            with trio.move_on_after(_MISMATCH_NOTICE_S):
                # Naming ourselves: the dialer cannot tell which side's parameters are stale either.
                await arrival.channel.send(abort_frame(round_id, self.me, "round parameters differ"))
            arrival.released.set()
            raise PeerFailed(
                left, "disagrees on the round (ring order, size, dtype, density or op differ)"
            )
        return arrival

    @asynccontextmanager
    async def open_round(
        self, ring: list[ID], round_id: int, digest: bytes, *, timeout: float, start_timeout: float,
        mesh: bool = False,
    ) -> AsyncIterator[RoundLinks]:
        """Join round ``round_id`` of ``ring``: connect the links, then yield them.

        Ring rounds link each member to its two neighbours; ``mesh`` rounds to every other member.
        Any failure inside (ours or a notice from another member) leaves as :class:`PeerFailed`; a
        failure we detected ourselves is first announced to the other members.
        """
        if self.me not in ring:
            raise CollectiveError("this host is not a member of the ring")
        if len(set(ring)) != len(ring):
            raise CollectiveError("the ring lists a peer twice")
        if not 0 <= round_id < 2**64:
            raise CollectiveError("round id must fit in 64 bits")
        if round_id in self._active or round_id in self._finished:
            raise CollectiveError(f"round {round_id} was already used here; use a fresh round id")
        me = ring.index(self.me)
        size = len(ring)
        state = _Round(round_id, ring, trio.CancelScope())
        state.notices = NoticeHold(self.me, state.end, self.refused)
        early = self._early_aborts.pop(round_id, None)
        if early is not None and early[0] in ring:
            self._remember(round_id, early[1])
            raise early[1]
        self._active[round_id] = state
        self._recent_rings.append(frozenset(ring))
        if mesh:
            sources = targets = [p for p in ring if p != self.me]
        else:
            sources, targets = [ring[(me - 1) % size]], [ring[(me + 1) % size]]
        if size == 1:
            sources = targets = []
        arrivals: dict[ID, Arrival] = {}
        outbound: dict[ID, Channel] = {}
        detected: PeerFailed | None = None
        completed = False
        try:
            with state.scope:
                try:

                    async def connect(peer: ID) -> None:
                        outbound[peer] = await self.dialer.dial(round_id, peer, digest, start_timeout)

                    async def accept(peer: ID) -> None:
                        arrivals[peer] = arrival = await self._accept(
                            round_id, peer, digest, start_timeout
                        )
                        try:
                            with trio.fail_after(timeout):
                                await arrival.channel.send(ready_frame(round_id))
                        except ChannelError as error:
                            # A channel parked before we joined, which its sender has since reset:
                            # its round failed there, and the notice saying why may be on its way.
                            await wait_for_abort_notice()
                            raise PeerFailed(
                                peer, f"its channel broke before the round began: {error}", gone=True
                            ) from error

                    with single_failure():
                        async with trio.open_nursery() as nursery:
                            for peer in targets:
                                nursery.start_soon(connect, peer)
                            for peer in sources:
                                nursery.start_soon(accept, peer)
                    inbound = {peer: arrival.channel for peer, arrival in arrivals.items()}
                    yield RoundLinks(ring, me, round_id, timeout, inbound, outbound, state.notices)
                    completed = True
                except PeerFailed as failure:
                    if failure.reported_by is None and failure.peer_id != self.me:
                        detected = failure
                    raise
                except trio.TooSlowError:
                    detected = PeerFailed(ring[(me - 1) % size], "did not answer within the deadline")
                    raise detected from None
                except ChannelError as error:
                    detected = PeerFailed(error.peer_id or ring[(me + 1) % size], str(error), gone=True)
                    raise detected from error
                except Exception as error:
                    # Our own failure: name ourselves so the others stop waiting for us at once.
                    detected = PeerFailed(self.me, f"local error: {type(error).__name__}: {error}")
                    raise
        finally:
            if detected is not None and state.abort is None:
                logger.info("collective: round %d failed here: %s", round_id, detected)
                # A culprit whose channel broke is dead or has left the round: a dial to a vanished
                # host would only hold up our own report (0.5 s in the fault test). One that was
                # silent or late is alive and must hear that it was named.
                await self.broadcast_abort(
                    ring, round_id, detected.peer_id, detected.reason, tell_culprit=not detected.gone
                )
            del self._active[round_id]
            self._remember(round_id, detected or state.abort)
            # Only a round that ran to its end leaves every channel at a message boundary.
            reusable = completed and detected is None and state.abort is None
            for peer, channel in outbound.items():
                if reusable:
                    await self.dialer.release(peer, channel)
                else:
                    await channel.reset()
            for arrival in arrivals.values():
                arrival.reusable = reusable
                arrival.released.set()
        if state.abort is not None and state.scope.cancelled_caught:
            raise state.abort

    def _remember(self, round_id: int, failure: PeerFailed | None) -> None:
        self._finished[round_id] = failure
        while len(self._finished) > _MEMORY:
            self._finished.popitem(last=False)

