"""The summary of a pipelined step: each driver's own loss share and whether its step failed.

It is also the step's barrier: the replicas learn there that the drivers are done, and every member
then drops the step or applies it alike. It was an exact sum over the plan's members, which any
member could move: one that added 1 to the failures failed every step, unnamed; one that took 1
away had a failed driver's partial gradient applied. Now it is a gather
(:meth:`~p2ptrain.collective.Collective.gather`): each driver signs and sends its own entry to
every member, each replica an empty one, and every member compares what the others received before
it reads them. A member can say only its own entry; an entry that is not one (a replica's that is
not empty, a driver's that is no finite loss share and failure flag) fails the round naming its
sender, and so does a driver that tells members different things. Every member reads the same
entries in plan order, so every member computes the same loss and the same verdict.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from libp2p.peer.id import ID

from p2ptrain.collective import Collective
from p2ptrain.protocol import round_id, stage_rings
from p2ptrain.wire import RoundPlan

# A driver's entry: its share of the step's mean loss (float64) and whether its step failed (0 or 1).
ENTRY = struct.Struct("<dB")


@dataclass(frozen=True)
class StepSummary:
    """What every member learns of a step: the step's mean loss (the drivers' shares summed in plan
    order) and the drivers (base58) whose step failed."""

    loss: float
    failed: tuple[str, ...]


def entry_bytes(loss: float, failed: bool) -> bytes:
    return ENTRY.pack(loss, int(failed))


def read_entry(raw: bytes) -> tuple[float, bool]:
    """A driver's entry; ``ValueError`` for bytes that are not one."""
    if len(raw) != ENTRY.size:
        raise ValueError(f"a driver's summary has {ENTRY.size} bytes, not {len(raw)}")
    loss, failed = ENTRY.unpack(raw)
    if not (math.isfinite(loss) and loss >= 0.0) or failed > 1:
        raise ValueError(f"a driver's summary is a finite loss share >= 0 and a flag 0 or 1, not ({loss}, {failed})")
    return loss, bool(failed)


async def gather_summary(
    collective: Collective, plan: RoundPlan, index: int, me: str, loss: float, failed: bool, *, timeout: float,
    start_timeout: float,
) -> StepSummary:
    """Round ``index`` of ``plan``'s summary, with this member's entry (``loss``, ``failed``: a
    driver's; a replica passes 0 and False and says nothing). Raises ``CollectiveError``
    (:class:`~p2ptrain.collective.PeerFailed` naming a member gone, or one whose entry is refused)."""
    drivers = set(stage_rings(plan)[0])

    def check(member: int, raw: bytes) -> None:
        if plan.members[member] in drivers:
            read_entry(raw)
        elif raw:
            raise ValueError("a replica says nothing in the step's summary")

    mine = entry_bytes(loss, failed) if me in drivers else b""
    ring = [ID.from_base58(m) for m in plan.members]
    parts = await collective.gather(mine, ring, round_id(plan, index), max_bytes=ENTRY.size, check=check,
                                    timeout=timeout, start_timeout=start_timeout)
    total, failures = 0.0, []
    for member, raw in zip(plan.members, parts, strict=True):
        if member in drivers:
            share, fail = read_entry(raw)
            total += share
            if fail:
                failures.append(member)
    return StepSummary(total, tuple(failures))
