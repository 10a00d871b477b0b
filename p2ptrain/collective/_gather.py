"""Every member's own bytes to every member, signed: a gather in which each slot is its member's alone.

An exact sum moves under any member: a ring member adds what it likes to any slot in passing (and
a chunk's owner sets its chunk), so a value that must be one member's (a driver's step summary, a
stage's CIDs) is whatever the last member to touch it made it, and nobody can tell who. Here each
member broadcasts its own payload to every other (one hop,
:func:`~p2ptrain.collective._direct.witnessed_broadcast`, signed with its peer key), and the CONFIRM
exchange (:mod:`p2ptrain.collective._witness`) compares what every member received: a member can
only say its own piece, and one that says different things to different members is named
(:class:`~p2ptrain.collective.Misbehaved`). A payload the caller's ``check`` refuses fails the round
as :class:`~p2ptrain.collective.BadPayload` naming its sender, at every member that received it.

Volume: each member sends its payload (plus a 64-byte signature) to P - 1 others and a CONFIRM of
96 bytes per member to each: for small payloads, a few KiB per member and round.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from p2ptrain.collective._direct import witnessed_broadcast
from p2ptrain.collective._failures import single_failure
from p2ptrain.collective._links import RoundLinks
from p2ptrain.collective._witness import Witness
from p2ptrain.wire import Said


def gather_description(max_bytes: int) -> str:
    """What the members of a gather must agree on (hashed into the round digest)."""
    return f"gather max_bytes={max_bytes} witnessed"


async def witnessed_gather(
    links: RoundLinks, payload: bytes, witness: Witness, *, max_bytes: int, check: Callable[[int, bytes], object],
    segment_bytes: int,
) -> list[bytes]:
    """Every member's payload, in ring order (ours is ``payload``); ``check(member, raw)`` raises
    ``ValueError`` for a payload of ring member ``member`` that the caller refuses. The caller runs
    ``witness.confirm()`` after it, within the round."""
    out: list[bytes | None] = [None] * links.size
    out[links.me] = payload

    async def one(member: int) -> None:
        # Said.VALUES: a member's own values, broadcast to every member (the statement's key is the
        # member); the round's digest names this a gather, so no other round's statement matches.
        got = await witnessed_broadcast(
            links, member, payload if member == links.me else None, witness=witness, said=Said.VALUES,
            max_bytes=max_bytes, check=lambda raw: check(member, raw), segment_bytes=segment_bytes,
        )
        out[member] = got

    if links.size > 1:
        with single_failure():
            async with trio.open_nursery() as nursery:
                for member in range(links.size):
                    nursery.start_soon(one, member)
    gathered = [part for part in out if part is not None]
    assert len(gathered) == links.size  # every broadcast completed, or the round raised
    return gathered
