"""A driver's second opinions, asked once its step's hops are all done (issues 27 and 31).

Why after the step and not in line: a second opinion asked while the microbatch is on its way (a
second FORWARD before the output goes on, a CHECK_LOSS before the gradient comes back) makes a
checked microbatch's BACKWARD reach the replica that served its FORWARD one hop later than an
unchecked one's. A replica that times that gap knows which of its answers nobody will check, and
alters only those: it is never outvoted (tests/pipeline/test_check_timing.py). So every microbatch
travels alike, and the driver, which keeps every boundary it relays until the step ends, asks the
second opinions on the drawn microbatches (``is_checked``, from a key no replica can compute) at
``Driver.finish``: by then every answer that counts was given.

Each checked hop is asked again of another replica of its stage, from the same tensors (a FORWARD
again; a LOSS or BACKWARD as ``CHECK_LOSS`` or ``CHECK_BACKWARD``, which accumulate nothing), and the
two answers compared bit for bit; on a difference a third replica decides, and the one outvoted is
a liar (:attr:`Opinions.liars`). When the liar is the replica whose answer went on down the pipeline,
the step's gradients hold its lie: :meth:`Opinions.check` returns those hops, and the driver fails
the step (the driver distrusts the liar from then on, :meth:`Wiring.distrust`, and everyone
leaves it out once the drivers convict it). A liar that only answered a
check poisoned nothing: it is named, and the step stands. Without a third replica, or with three
different answers, nobody is named and the step stands on the first answer, as it would unchecked.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import struct
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

import torch
import trio
from libp2p.peer.id import ID

from p2ptrain.base import short_id
from p2ptrain.wire.activations import Frame, Kind

logger = logging.getLogger(__name__)

# Second opinions asked at once at the step's end: within what a replica takes from one peer at once
# (pipeline MAX_STREAMS_PER_PEER, 8), as many as the runtime keeps microbatches in flight.
CHECKS_IN_FLIGHT = 4

# (kind, stage, microbatch, tensors, value, besides) -> (the replica that answered, its answer): the
# driver's hop, rerouted until a replica of the stage (none of ``besides``) answers; None when no
# replica of the stage is left to ask.
Ask = Callable[[Kind, int, int, tuple[torch.Tensor, ...], float, Collection[Hashable]],
               Awaitable[tuple[Hashable, Frame] | None]]


def is_checked(key: bytes, step: int, mb: int, fraction: float) -> bool:
    """Whether microbatch ``mb`` of ``step`` gets a second opinion: a hash of ``key``, the step and the
    microbatch id below ``fraction`` of its range. The same key, step and id give the same answer on
    every machine, so who knows the key can recompute which microbatches a driver had to check."""
    digest = hashlib.sha256(key + struct.pack(">QQ", step, mb)).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


@dataclass(frozen=True, eq=False)  # its tensors compare by identity, never by value
class Hop:
    """One hop of a checked microbatch, kept until the step's second opinions: the request as it
    would be asked again (``kind``: FORWARD, CHECK_LOSS or CHECK_BACKWARD; its tensors are the
    boundaries the driver keeps anyway), and the replica whose answer went on with that answer."""

    kind: Kind
    stage: int
    microbatch: int
    tensors: tuple[torch.Tensor, ...]
    value: float
    peer: Hashable
    answer: Frame


class Opinions:
    """A driver's second and third opinions and what they found, kept across its steps."""

    def __init__(self) -> None:
        self.checked = 0  # FORWARD second opinions asked
        self.gradients_checked = 0  # CHECK_LOSS and CHECK_BACKWARD second opinions asked
        # {(stage, the replica that answered, the replica that answered differently): times}
        self.disagreements: collections.Counter[tuple[int, Hashable, Hashable]] = collections.Counter()
        # {(stage, replica): times a third opinion outvoted it}, and {replica: its stage} of every
        # replica outvoted (kept across steps until the caller takes them: the driver's accusations).
        self.outvoted: collections.Counter[tuple[int, Hashable]] = collections.Counter()
        self.liars: dict[Hashable, int] = {}
        # {(stage, replica, replica): times} of the disagreements nobody could decide (no third
        # replica, or three different answers): reported as the pair's, nobody named.
        self.undecided: collections.Counter[tuple[int, Hashable, Hashable]] = collections.Counter()

    async def check(self, ask: Ask, step: int, hops: Sequence[Hop]) -> list[Hop]:
        """Ask a second opinion on every hop of ``hops`` (a few at once: :data:`CHECKS_IN_FLIGHT`);
        the hops whose answer, the one that went on, a third opinion outvoted."""
        poisoned: list[Hop] = []
        limiter = trio.CapacityLimiter(CHECKS_IN_FLIGHT)

        async def one(hop: Hop) -> None:
            async with limiter:
                if await self._second_opinion(ask, step, hop) == hop.peer:
                    poisoned.append(hop)

        async with trio.open_nursery() as nursery:
            for hop in hops:
                nursery.start_soon(one, hop)
        return sorted(poisoned, key=lambda h: (h.microbatch, h.stage))

    async def _second_opinion(self, ask: Ask, step: int, hop: Hop) -> Hashable | None:
        """Ask another replica of the hop's stage and compare with the answer that went on; on a
        difference, a third replica decides. The replica outvoted, or None (the answers agreed, no
        other replica is left, or nobody could be named)."""
        first, answer, stage, mb = hop.peer, hop.answer, hop.stage, hop.microbatch
        asked = await ask(hop.kind, stage, mb, hop.tensors, hop.value, (first,))
        if asked is None:
            return None  # a stage with no other replica left goes unchecked
        other, second = asked
        if hop.kind == Kind.FORWARD:
            self.checked += 1
        else:
            self.gradients_checked += 1
        if _same(second, answer):
            return None
        what = "outputs" if hop.kind == Kind.FORWARD else "gradients"
        self.disagreements[(stage, first, other)] += 1
        logger.warning("pipeline step %d: microbatch %d: stage %d replicas %s and %s disagree on its %s (largest "
                       "difference %.3g)", step, mb, stage, _name(first), _name(other), what,
                       float((second.tensors[0] - answer.tensors[0]).abs().max()))
        asked = await ask(hop.kind, stage, mb, hop.tensors, hop.value, (first, other))
        if asked is None:
            self.undecided[(stage, first, other)] += 1
            logger.warning("pipeline step %d: microbatch %d: stage %d has no third replica to tell which of %s and "
                           "%s lied; nobody is named", step, mb, stage, _name(first), _name(other))
            return None
        third, tie = asked
        if _same(tie, answer):
            liar = other
        elif _same(tie, second):
            liar = first
        else:
            self.undecided[(stage, first, other)] += 1
            logger.warning("pipeline step %d: microbatch %d: stage %d replicas %s, %s and %s answered three different "
                           "%s; nobody is named", step, mb, stage, _name(first), _name(other), _name(third), what)
            return None
        self.outvoted[(stage, liar)] += 1
        self.liars[liar] = stage
        honest = [p for p in (first, other, third) if p != liar]
        logger.warning("pipeline step %d: microbatch %d: stage %d replica %s outvoted by %s and %s: it sent altered "
                       "%s%s", step, mb, stage, _name(liar), _name(honest[0]), _name(honest[1]),
                       "activations" if hop.kind == Kind.FORWARD else "gradients",
                       " into the step" if liar == first else " as a second opinion")
        return liar


def _same(a: Frame, b: Frame) -> bool:
    """Two answers to one request are the same: their tensor bit for bit, and their value (a LOSS's
    loss)."""
    return torch.equal(a.tensors[0], b.tensors[0]) and a.value == b.value


def _name(peer: Hashable) -> str:
    return short_id(peer) if isinstance(peer, ID) else str(peer)
