"""Which replica of a stage gets the next hop: SWARM's stochastic wiring, as a pure state machine.

Each sender keeps its own view of every replica of the stages it sends to: an exponentially weighted
throughput (hops per second it saw completed there) and the hops it has in flight there. A replica is
drawn at random with probability proportional to ``throughput / (1 + in_flight)``: fast, idle replicas
get more of the work, no scheduler is needed, and many senders drawing at random do not all herd onto
the replica that looked best a moment ago. A replica not measured yet counts at its stage's mean
throughput (1 hop/s when none is measured), so a newcomer is tried.

A replica whose hop failed (its channel closed, or no answer within the hop's deadline) is *out* for
the rest of the step: nothing more is sent to it, and :meth:`Wiring.choose` answers ``None`` once a
stage has no replica left, which the caller reports as the stage being unavailable. No clock is read
here: the caller passes each hop's seconds; randomness comes from the caller's seeded ``Random``.

A replica this sender caught lying (a third opinion outvoted it) is *distrusted* for good: it is sent
none of this sender's hops, step after step, though it stays in the stage's ring (asked what it holds:
it serves the other senders). First-hand evidence needs no majority to be acted on by the one who saw
it; only leaving the replica out of everyone's plans does (protocol/_stage_verdicts.py).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass

# Weight of the newest hop in a replica's throughput: about the last 5 hops count.
SMOOTHING = 0.2


@dataclass
class _Replica:
    throughput: float | None = None  # hops per second, smoothed; None until one completes
    in_flight: int = 0
    out: bool = False  # a hop to it failed: nothing more is sent to it this step
    left_out: bool = False  # out of this step's ring too (leave_out)
    distrusted: bool = False  # caught lying to this sender: none of its hops, every step (distrust)


class Wiring:
    """One sender's choice of replicas for every stage it sends to (``replicas[stage]``)."""

    def __init__(
        self, replicas: Mapping[int, Sequence[Hashable]], rng: random.Random, distrusted: Collection[Hashable] = (),
    ) -> None:
        """``distrusted``: the replicas this sender caught lying before (the runtime keeps them plan
        after plan: a retry's plan may name them again while the other senders have not caught them)."""
        self._stages = {stage: list(peers) for stage, peers in replicas.items()}
        self._state = {peer: _Replica() for peers in self._stages.values() for peer in peers}
        self._rng = rng
        for peer in distrusted:
            self.distrust(peer)

    def replicas(self, stage: int) -> list[Hashable]:
        """Every replica of ``stage`` in the plan, out or not."""
        return list(self._stages.get(stage, ()))

    def usable(self, stage: int) -> list[Hashable]:
        """The replicas of ``stage`` still in this step that this sender trusts."""
        return [p for p in self._stages.get(stage, ()) if not (self._state[p].out or self._state[p].distrusted)]

    def weight(self, peer: Hashable) -> float:
        """How much ``peer`` is preferred now: its throughput over one plus its hops in flight."""
        state = self._state[peer]
        stage = next(s for s, peers in self._stages.items() if peer in peers)
        measured = [t for p in self._stages[stage] if (t := self._state[p].throughput) is not None]
        mean = sum(measured) / len(measured) if measured else 1.0
        return (state.throughput or mean) / (1 + state.in_flight)

    def choose(self, stage: int, besides: Collection[Hashable] = ()) -> Hashable | None:
        """A usable replica of ``stage`` (none of ``besides``: those a second or third opinion
        already heard) drawn by weight, or None when the stage has none left."""
        usable = [p for p in self.usable(stage) if p not in besides]
        if not usable:
            return None
        return self._rng.choices(usable, weights=[self.weight(p) for p in usable])[0]

    def in_flight(self, peer: Hashable) -> int:
        """Hops this sender has in flight at ``peer`` now (queued there before a new one)."""
        return self._state[peer].in_flight

    def started(self, peer: Hashable) -> None:
        self._state[peer].in_flight += 1

    def finished(self, peer: Hashable, seconds: float) -> None:
        """A hop to ``peer`` was answered after ``seconds``."""
        state = self._state[peer]
        state.in_flight -= 1
        rate = 1.0 / max(seconds, 1e-6)
        state.throughput = rate if state.throughput is None else (1 - SMOOTHING) * state.throughput + SMOOTHING * rate

    def failed(self, peer: Hashable) -> None:
        """A hop to ``peer`` failed: it gets nothing more this step."""
        state = self._state[peer]
        state.in_flight -= 1
        state.out = True

    def leave_out(self, peer: Hashable) -> None:
        """Leave ``peer`` out of the rest of the step, for good: not even asked what it holds (another
        sender found it gone, and the senders of a step must agree on each stage's ring)."""
        state = self._state.get(peer)
        if state is not None:
            state.out = state.left_out = True

    def distrust(self, peer: Hashable) -> None:
        """This sender caught ``peer`` lying: none of its hops go there again, this step or later ones
        (it stays in the ring: its holdings are still asked, it still serves other senders)."""
        state = self._state.get(peer)
        if state is not None:
            state.distrusted = True

    def is_distrusted(self, peer: Hashable) -> bool:
        return self._state[peer].distrusted

    def is_left_out(self, peer: Hashable) -> bool:
        return self._state[peer].left_out

    def new_step(self) -> None:
        """A new step: every replica of the plan may be tried again (the plan left out the gone ones),
        but those this sender distrusts."""
        for state in self._state.values():
            state.out = state.left_out = False
            state.in_flight = 0
