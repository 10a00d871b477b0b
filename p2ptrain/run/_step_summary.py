"""The summary of a pipelined step: each driver's own loss share and whether its step failed.

It is also the step's barrier: the replicas learn there that the drivers are done, and every member
then drops the step or applies it alike (in local-SGD mode, each inner step has its own summary).
It was an exact sum over the plan's members, which any member could move: one that added 1 to the
failures failed every step, unnamed; one that took 1 away had a failed driver's partial gradient
applied. Now it is a gather
(:meth:`~p2ptrain.collective.Collective.gather`): each driver signs and sends its own entry to
every member, each replica an empty one, and every member compares what the others received before
it reads them. A member can say only its own entry; an entry that is not one (a replica's that is
not empty, a driver's that is no finite loss share and failure flag) fails the round naming its
sender, and so does a driver that tells members different things. Every member reads the same
entries in plan order, so every member computes the same loss and the same verdict.

A driver's entry also lists the replicas a third opinion outvoted at that driver (their indices in
the plan, 2 bytes each, at most MAX_ACCUSED; the entry's bytes are declared in
wire/_summary_entries.py): its accusations, which every member weighs alike
(:func:`~p2ptrain.protocol.convicted`: a replica accused by more than half the drivers is convicted).
Under ``[pipeline] balance = "measured"`` it is a timed entry: also each stage's microseconds per
microbatch as that driver measured them, of which every member takes the median over the drivers
(:func:`~p2ptrain.protocol.median_micros`: what the next plans weigh the stages by).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.collective import Collective, Misbehaved
from p2ptrain.protocol import Convictions, convicted, inner_round_id, median_micros, round_id, stage_rings
from p2ptrain.wire import (MAX_ACCUSED, MAX_SUMMARY_ENTRY_BYTES, MAX_TIMED_ENTRY_BYTES, read_summary_entry, RoundPlan,
                           summary_entry_bytes)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSummary:
    """What every member learns of a step: the step's mean loss (the drivers' shares summed in plan
    order) and the drivers (base58) whose step failed."""

    loss: float
    failed: tuple[str, ...]
    # {driver: the replicas it accuses}, drivers with none left out; and the replicas convicted.
    accusations: tuple[tuple[str, tuple[str, ...]], ...] = ()
    convicted: tuple[str, ...] = ()
    # Per stage, the median over the drivers of their measured microseconds per microbatch (0: none
    # measured it); empty but under balance = "measured".
    micros: tuple[int, ...] = ()


async def gather_summary(
    collective: Collective, plan: RoundPlan, index: int, me: str, loss: float, failed: bool, *, timeout: float,
    start_timeout: float, accused: tuple[str, ...] = (), inner: int | None = None, timed: bool = False,
    micros: tuple[int, ...] = (), joined: Callable[[], object] | None = None,
) -> StepSummary:
    """Round ``index`` of ``plan``'s summary, with this member's entry (``loss``, ``failed``,
    ``accused``: a driver's, the replicas of the plan it accuses; a replica passes 0 and False and
    says nothing); in local-SGD mode, that of the round's ``inner``-th inner step. ``timed``: the
    task measures its stages (``micros``: this driver's times, one per stage); a driver's entry that
    carries times in a task that does not, or none in one that does, is refused. ``joined()``:
    called once every member joined it, before this member sends its entry (Collective.gather). Raises
    ``CollectiveError`` (:class:`~p2ptrain.collective.PeerFailed` naming a member gone, or one whose
    entry is refused)."""
    drivers = stage_rings(plan)[0]

    def check(member: int, raw: bytes) -> None:
        if plan.members[member] in drivers:
            if bool(read_summary_entry(raw, plan).micros) != timed:
                raise ValueError("a driver's summary carries stage times in a task that measures none"
                                 if not timed else "a driver's summary carries no stage times in a task that measures them")
        elif raw:
            raise ValueError("a replica says nothing in the step's summary")

    replicas = {m: i for i, m in enumerate(plan.members) if m not in drivers}
    indices = tuple(sorted(replicas[r] for r in set(accused) if r in replicas))[:MAX_ACCUSED]
    mine = summary_entry_bytes(loss, failed, indices, micros if timed else ()) if me in drivers else b""
    ring = [ID.from_base58(m) for m in plan.members]
    gather_id = round_id(plan, index) if inner is None else inner_round_id(plan, index, inner)
    parts = await collective.gather(mine, ring, gather_id, check=check,
                                    max_bytes=MAX_TIMED_ENTRY_BYTES if timed else MAX_SUMMARY_ENTRY_BYTES,
                                    timeout=timeout, start_timeout=start_timeout, joined=joined)
    total, failures, accusations, timings = 0.0, [], [], []
    for member, raw in zip(plan.members, parts, strict=True):
        if member in drivers:
            share, fail, named, times = read_summary_entry(raw, plan)
            timings.append(times)
            total += share
            if fail:
                failures.append(member)
            if named:
                accusations.append((member, tuple(plan.members[i] for i in named)))
    stages = len(stage_rings(plan))
    return StepSummary(total, tuple(failures), tuple(accusations), convicted(drivers, dict(accusations)),
                       median_micros(timings, stages) if timed else ())


def convicted_failure(
    plan: RoundPlan, step: int, convicted: tuple[str, ...], suspects: dict[str, dict[str, Any]], log_prefix: str,
    *, convictions: Convictions, now: float, me: str,
) -> Misbehaved:
    """The failure of ``step``, whose summary convicted the replicas ``convicted`` (base58, of
    ``plan``): :class:`Misbehaved` naming the first (those convicted with it are left out all the same), so that
    the run's usual round failure leaves it out of the next plans; each one counted in ``suspects``
    (``task status``'s ``stage_suspects``), left out by ``convictions`` (the book's of member ``me``,
    at ``now``: longer each time it is convicted again, even where that leaves the run short of
    ``peers.min``) and logged, naming its stage, the step and for how long it is out. ``me`` too:
    convicted, it stands for no election while it is out, and a coordinator steps down
    (run/_leading.py). Before, its own book skipped it, and a coordinator convicted as a replica
    planned the retry with itself, never left out, however often the drivers convicted it."""
    assert plan.stages is not None
    for peer in convicted:
        stage = plan.stages[plan.members.index(peer)]
        seen = suspects.setdefault(peer, {"peer": peer, "stage": stage, "times": 0, "step": step})
        seen.update(stage=stage, step=step, times=seen["times"] + 1)
        out = f"left out of plans for {convictions.convict(peer, now):.0f} s, even if the run must wait for a peer meanwhile"
        if peer == me:
            out = f"this member: {out}; it leads no plan meanwhile"
        logger.warning("%s: step %d: stage %d replica %s accused by a majority of the drivers (altered activations or "
                       "gradients a third opinion outvoted, or steps it stalled; %d time(s) in this run); %s",
                       log_prefix, step, stage, short_id(peer), seen["times"], out)
    first = convicted[0]
    return Misbehaved(ID.from_base58(first), f"altered its answers or stalled the steps as a replica of stage "
                                             f"{plan.stages[plan.members.index(first)]} in step {step}")
