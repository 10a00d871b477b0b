"""Which replica stalls a driver's steps: its answers' times against its stage's, as a pure object.

Why: a driver waits for a hop's answer up to a deadline learned from the hops it measured
(pipeline/_deadlines.py), and at every step's end for every replica's HOLDINGS. A replica that
answers just under that deadline is never timed out, never routed around for good, and never left out
of a plan: red team's H1 measured a run slowed to x0.014 of its steps/s by one replica stalling its
HOLDINGS 4.5 s (the floor is 5 s), and to x0.002 by one stalling every answer, whose slow hops grew
its own deadline to the 60 s ceiling (bench/stage_staller.py). Routing hops around it is not enough:
every replica of the ring is asked its HOLDINGS every step.

So each driver judges, after each step, how long each replica of a stage took against the others of
that stage in the same step: a replica whose slowest answer (a hop's seconds over one plus the hops
this driver had queued there when it was sent; a HOLDINGS's seconds; a timeout counts as endless)
is over ``factor`` times the median of the other replicas' slowest answers, and over it by more
than ``margin_s``, was *slow* that step. A replica slow in ``strikes`` of the last ``window`` steps
this driver observed is a straggler: the driver accuses it in the step's summary (it does not
distrust it: slowness is no evidence of who caused it), where, as for a replica caught lying, a
majority of the drivers convicts it and every member leaves it out of the next plans for the
quarantine (protocol/_stage_verdicts.py).

What it bounds: a replica can stall a driver's steps by at most ``factor`` times its stage's
others (plus ``margin_s``) each step, or by up to a deadline in at most ``strikes - 1`` of every
``window`` steps, before it is accused. An honest replica on a slower machine is judged the same:
left out for the quarantine, as SWARM routes around a slow peer. A stage with one replica is not
judged (nobody to compare with, and nobody to route to).
No clock is read here: the caller passes each step's seconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping

from p2ptrain.base import StrikeWindows

FACTOR = 4.0  # slower than this many times its stage's other replicas, in the same step
MARGIN_S = 1.0  # and by more than this: a loaded machine's jitter on millisecond hops is no stall
STRIKES = 3  # slow steps, of the last WINDOW a driver observed, that make a straggler
WINDOW = 10
MAX_TRACKED = 1024  # replicas whose record is kept (the oldest dropped first): plans change members


class Stragglers:
    """One driver's judgement of which replicas stall its steps, kept across its steps and plans."""

    def __init__(self, *, factor: float = FACTOR, margin_s: float = MARGIN_S, strikes: int = STRIKES,
                 window: int = WINDOW) -> None:
        if factor < 1 or margin_s < 0:
            raise ValueError("stragglers need a factor >= 1 and a margin >= 0")
        self.factor, self.margin_s, self.strikes, self.window = factor, margin_s, strikes, window
        self._slow = StrikeWindows(strikes, window, MAX_TRACKED)  # per replica, its last steps: slow or not
        self._step: dict[int, dict[Hashable, float]] = {}  # this step's slowest answer, {stage: {replica: seconds}}

    def new_step(self) -> None:
        """A new step (the last one's answers, not judged, are dropped: it failed before its end)."""
        self._step.clear()

    def took(self, stage: int, peer: Hashable, seconds: float) -> None:
        """An answer of ``peer`` for ``stage`` took ``seconds`` this step (``math.inf``: none came
        within its deadline)."""
        times = self._step.setdefault(stage, {})
        times[peer] = max(seconds, times.get(peer, 0.0))

    def judge(self) -> dict[Hashable, int]:
        """The step's answers judged (:meth:`observe`); the next step starts empty."""
        found = self.observe(self._step)
        self._step.clear()
        return found

    def is_slow(self, seconds: float, others: list[float]) -> bool:
        """Whether an answer of ``seconds`` is a stall beside its stage's ``others`` (their slowest)."""
        if not others:
            return False
        reference = statistics.median(others)
        return seconds > self.factor * reference and seconds - reference > self.margin_s

    def observe(self, step: Mapping[int, Mapping[Hashable, float]]) -> dict[Hashable, int]:
        """One step's answers: ``{stage: {replica: its slowest answer's seconds}}`` (``math.inf``: it
        timed out), every replica of the stage that was asked something. Returns the replicas that
        became stragglers with this step, with their stage (their record starts again)."""
        found: dict[Hashable, int] = {}
        for stage, times in step.items():
            if len(times) < 2:
                continue
            for peer, seconds in times.items():
                others = [s for p, s in times.items() if p != peer and math.isfinite(s)]
                if self._slow.note(peer, self.is_slow(seconds, others)):
                    found[peer] = stage
                    self._slow.forget(peer)
        return found
