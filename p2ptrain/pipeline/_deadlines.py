"""How long a driver waits for a hop's answer: from the measured times of recent hops, as a pure object.

A fixed deadline is wrong both ways: on a calm machine a hop of a 50M-parameter stage takes a second
or two and a fixed 5 s is generous, but on a loaded one the same hop (queued at a replica that
serves one request at a time, behind the other drivers' microbatches) takes longer, every hop
then runs past the deadline, the replica is dropped for the step, the step fails when its stage runs
out of replicas, and the retry throws away work that a slow but alive replica was doing.

So each hop's deadline comes from what the sender measured: for a replica of a stage,
``factor`` times a high ``quantile`` of its last ``window`` answered hops (each scaled up to the
request's size when it was smaller: a hop carries work in proportion to its bytes), never below
``floor`` (the configured deadline: a fast hop keeps it) nor above ``ceiling`` (a replica that hung
is still given up on, and rerouted, within that bound). A replica not measured yet counts with its
stage's hops to any replica; a stage not measured yet gets ``initial``. A hop that ran past its
deadline says the replica may just be slower than measured: its next deadline doubles (up to the
ceiling) until it answers once, so a replica that is slow, not dead, is timed out a few times at most,
not every step.

A replica's own slow hops raise its own deadline, so one that stalls each answer just under its
deadline grew it to the ceiling (red team's H1: steps of 16-108 s where its stage's other replicas
answered in milliseconds). So where other replicas of the stage were measured, a replica's deadline
is also at most ``peer_cap`` times what theirs would be (never below the floor): a replica far
slower than its stage's others is timed out and routed around instead of waited for, and each such
timeout counts against it (pipeline/_stragglers.py). A stage's only replica is still waited for as
measured (nobody to route to).

No clock is read here: the caller passes each hop's seconds, so a simulator or a test drives it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

# The deadline is this many times the hop time measured (its high quantile): room for a burst of load.
FACTOR = 3.0
QUANTILE = 0.9
WINDOW = 16  # hops kept per replica and per stage: the last few steps' worth
BACKOFF = 2.0  # a hop that ran past its deadline: the replica's next one is this many times longer
PEER_CAP = 4.0  # a replica's deadline is at most this many times its stage's other replicas' (measured)


@dataclass(frozen=True)
class _Hop:
    seconds: float
    size: int  # the request's bytes
    queued: int = 0  # the sender's hops in flight there when it was sent


class HopDeadlines:
    """One sender's deadlines for its hops to the replicas of every stage, from their measured times."""

    def __init__(
        self, floor: float, *, ceiling: float, initial: float | None = None, factor: float = FACTOR,
        quantile: float = QUANTILE, window: int = WINDOW, peer_cap: float = PEER_CAP,
    ) -> None:
        if not 0 < floor <= ceiling:
            raise ValueError(f"deadlines need 0 < floor <= ceiling, not {floor} and {ceiling}")
        if not 0 < quantile <= 1 or factor < 1 or window < 1 or peer_cap < 1:
            raise ValueError("deadlines need a quantile in (0, 1], a factor >= 1, a window >= 1 and a peer cap >= 1")
        self.floor, self.ceiling, self.factor, self.quantile = floor, ceiling, factor, quantile
        self.peer_cap = peer_cap
        self.initial = _clamp(floor if initial is None else initial, floor, ceiling)
        self._window = window
        self._replicas: dict[tuple[int, Hashable], collections.deque[_Hop]] = {}
        self._stages: dict[int, collections.deque[_Hop]] = {}
        self._backoff: dict[tuple[int, Hashable], float] = {}  # the deadline after one that passed

    def deadline(self, stage: int, peer: Hashable, size: int) -> float:
        """Seconds to wait for ``peer``'s answer to a request of ``size`` bytes to ``stage``."""
        hops = self._replicas.get((stage, peer)) or self._stages.get(stage)
        measured = self._measured(hops, size) if hops else self.initial
        deadline = _clamp(max(measured, self._backoff.get((stage, peer), 0.0)), self.floor, self.ceiling)
        others = [h for (s, p), kept in self._replicas.items() if s == stage and p != peer for h in kept]
        if others:
            deadline = min(deadline, max(self.floor, self.peer_cap * self._measured(others, size)))
        return deadline

    def _measured(self, hops: Iterable[_Hop], size: int) -> float:
        """``factor`` times the quantile of ``hops``, each scaled up to a request of ``size`` bytes."""
        return self.factor * _quantile([h.seconds * max(1.0, size / max(h.size, 1)) for h in hops], self.quantile)

    def answered(self, stage: int, peer: Hashable, seconds: float, size: int, queued: int = 0) -> None:
        """``peer`` answered a request of ``size`` bytes to ``stage`` after ``seconds``, sent while
        ``queued`` other hops of this sender were in flight there."""
        hop = _Hop(max(seconds, 0.0), size, max(queued, 0))
        self._replicas.setdefault((stage, peer), collections.deque(maxlen=self._window)).append(hop)
        self._stages.setdefault(stage, collections.deque(maxlen=self._window)).append(hop)
        self._backoff.pop((stage, peer), None)

    def stage_micros(self, stages: int) -> tuple[int, ...]:
        """What a microbatch takes at each of ``stages`` stages, in microseconds, as this sender
        measured it (its timed step summary entry under ``balance = "measured"``): the median of its
        last hops to the stage (to any replica), each over one plus the hops it had queued there
        before it (its share of the wait), twice at stage 0 and a middle stage (a FORWARD and a
        BACKWARD), once at the last (a LOSS); 0 where nothing was measured. Stage 0's "hops" are the
        driver's own forwards and backwards of it (``answered(0, None, ...)``: no deadline reads them)."""
        out = []
        for stage in range(stages):
            hops = self._stages.get(stage)
            typical = _quantile([h.seconds / (1 + h.queued) for h in hops], 0.5) if hops else 0.0
            out.append(min(round(typical * (1 if stage == stages - 1 else 2) * 1e6), 2**32 - 1))
        return tuple(out)

    def timed_out(self, stage: int, peer: Hashable, deadline: float) -> None:
        """``peer`` gave no answer to ``stage``'s request within ``deadline`` seconds: its next
        deadline is longer, until it answers."""
        self._backoff[(stage, peer)] = min(self.ceiling, BACKOFF * max(deadline, self._backoff.get((stage, peer), 0.0)))


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank: one of the values, never an interpolation)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))
