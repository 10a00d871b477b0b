"""Inbound round channels parked until their round opens here, bounded per sender and in all.

Split from :mod:`p2ptrain.collective._round_hub` (which decides whether a HELLO may park at all:
only members of a plan it knows, never for a round that already ended here): a member may say HELLO
before this host has joined the round (it got the plan sooner, or computed its gradient faster), so
its channel waits here until the round claims it, at most ``_PARK_S``. One sender (honest or not)
can never take the whole inbox (issue 13, found #4).

A caller that knows it will open a round later than ``_PARK_S`` after the others (a pipelined step's
summary: the replicas join it as the step starts, the drivers once their whole step is done) announces
it (:meth:`Inbox.announce`): that round's channels then wait until the announced time, so a slow
step does not lose the round's early channels. The announcements are bounded (the newest
``_ANNOUNCED`` rounds, each at most ``_MAX_ANNOUNCE_S`` ahead), and so is what may park, as before.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import trio
from libp2p.peer.id import ID

from p2ptrain.net import Channel

# Inbound round channels parked (HELLO received, round not yet opened here), in all and per sender.
# Only peers of a plan this hub knows may park at all (see RoundHub.expect): 64 in all covers a
# 16-member mesh 4 rounds ahead; 4 per sender is one member running up to 4 rounds ahead of us,
# so one member (honest or not) can never take the whole inbox.
_MAX_PENDING = 64
_PENDING_PER_PEER = 4
# How long a parked channel waits for its round to open here before it is dropped: longer than
# a member's start timeout (15 s in the runtime) plus a gradient's compute.
_PARK_S = 30.0
# Rounds announced to open here later (the newest kept), and the furthest ahead one may be announced.
_ANNOUNCED = 16
_MAX_ANNOUNCE_S = 300.0


@dataclass
class Arrival:
    """An inbound round channel waiting for its round to start here."""

    channel: Channel
    digest: bytes
    claimed: trio.Event = field(default_factory=trio.Event)
    released: trio.Event = field(default_factory=trio.Event)
    reusable: bool = False  # set before ``released``: the round ended cleanly here


class Inbox:
    """The parked channels, keyed by (round id, sender), and the rounds waiting for them."""

    def __init__(self) -> None:
        self._parked: dict[tuple[int, ID], Arrival] = {}
        self._waiting: dict[tuple[int, ID], trio.Event] = {}
        self._pending_from: dict[ID, int] = {}
        self._announced: OrderedDict[int, float] = OrderedDict()  # round id -> opens here by (trio time)

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, key: tuple[int, ID]) -> bool:
        return key in self._parked

    def announce(self, round_id: int, within: float) -> None:
        """``round_id`` will open here within ``within`` seconds (at most ``_MAX_ANNOUNCE_S``): its
        channels parked here wait until then rather than ``_PARK_S``."""
        self._announced[round_id] = trio.current_time() + min(max(within, 0.0), _MAX_ANNOUNCE_S)
        self._announced.move_to_end(round_id)
        while len(self._announced) > _ANNOUNCED:
            self._announced.popitem(last=False)

    def full_for(self, peer: ID) -> str | None:
        """Why ``peer`` may not park one more channel now (a counter name), or None if it may."""
        if self._pending_from.get(peer, 0) >= _PENDING_PER_PEER:
            return "hello_over_peer_cap"
        if len(self._parked) >= _MAX_PENDING:
            return "hello_inbox_full"
        return None

    async def park(self, round_id: int, peer: ID, channel: Channel, digest: bytes) -> Arrival | None:
        """Hold ``channel`` until its round claims it (at most ``_PARK_S``, or until the time its round
        was announced to open by, if later: announced before or while it waits); None if it never did."""
        key = (round_id, peer)
        arrival = Arrival(channel, digest)
        self._parked[key] = arrival
        self._pending_from[peer] = self._pending_from.get(peer, 0) + 1
        if key in self._waiting:
            self._waiting[key].set()
        try:
            with trio.move_on_after(_PARK_S):
                await arrival.claimed.wait()
            until = self._announced.get(round_id)
            if not arrival.claimed.is_set() and until is not None:
                with trio.move_on_at(until):
                    await arrival.claimed.wait()
        finally:
            if self._parked.get(key) is arrival:
                del self._parked[key]
            self._pending_from[peer] -= 1
            if not self._pending_from[peer]:
                del self._pending_from[peer]
        return arrival if arrival.claimed.is_set() else None

    async def claim(self, round_id: int, peer: ID, timeout: float) -> Arrival | None:
        """``peer``'s channel for ``round_id``, waiting for it up to ``timeout``; None if it did not come."""
        key = (round_id, peer)
        if key not in self._parked:
            event = self._waiting.setdefault(key, trio.Event())
            try:
                with trio.move_on_after(timeout):
                    await event.wait()
            finally:
                self._waiting.pop(key, None)
            if key not in self._parked:
                return None
        arrival = self._parked.pop(key)
        arrival.claimed.set()
        return arrival
