"""Fixed-bucket histograms of a run's round times, kept by the run and read by the metrics exporter.

A leaf (imports nothing of ours, nor prometheus-client): the runtime records every round's compute,
sync and apply time here whether or not the node serves metrics, at the cost of a few integer
additions per round, and :mod:`p2ptrain.services._metrics` turns a snapshot into Prometheus histograms only
when ``node start --metrics`` asks for it. Memory is constant: one counter per bucket, never a list
of samples.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Upper bounds (seconds) of the round-time buckets: a round's compute, sync or apply on the demo
# takes 1-50 ms, a large model's seconds; 14 buckets from 1 ms to 60 s cover both with a factor of
# about 2.5 between neighbours (Prometheus adds +Inf itself).
ROUND_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0,
)


@dataclass(frozen=True)
class HistogramSnapshot:
    """Cumulative counts per upper bound (the last one is +Inf), the sum and the count."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    total: float
    count: int


class Histogram:
    """Counts of observations per bucket; :meth:`snapshot` gives Prometheus' cumulative form."""

    def __init__(self, bounds: tuple[float, ...] = ROUND_SECONDS_BUCKETS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self._total = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for n in self._counts:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self._total, running)


class RoundHistograms:
    """A run's round times by phase: ``compute`` (the local gradient), ``sync`` (the all-reduce),
    ``apply`` (the optimizer step), each observed once per completed round."""

    PHASES = ("compute", "sync", "apply")

    def __init__(self) -> None:
        self.phases = {phase: Histogram() for phase in self.PHASES}

    def observe(self, compute_s: float, sync_s: float, apply_s: float) -> None:
        for phase, value in zip(self.PHASES, (compute_s, sync_s, apply_s)):
            self.phases[phase].observe(value)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        return {phase: h.snapshot() for phase, h in self.phases.items()}
