"""Robust aggregation against Byzantine members: each contribution's norm clipped to the median norm.

A member that sends finite but scaled (x100) or sign-flipped values passes every wire check and,
in a plain mean, moves the result by its own norm / P: one member of four at x100 moves it 25x
further than the honest signal. ``clip`` bounds that: the member that reduces a part (the owner of
a chunk in the direct exchange, :mod:`p2ptrain.collective._direct`) has every member's contribution
to that part, computes their norms, takes the lower median ``tau`` and scales every contribution
whose norm exceeds ``tau`` down to ``tau`` before summing, in the ring's order, as before. This is
one step of BTARD's CenteredClip (Gorbunov et al., 2022) with the centre at 0 and the clipping
radius taken from the round itself rather than set by hand, so a task needs no scale-dependent
threshold.

Why the lower median: with f members Byzantine of P, the value at sorted position (P-1)//2 is at
most the largest honest norm whenever f <= P/2, so a hostile contribution weighs at most what the
largest honest one does. It is computed where the contributions already are (at the owner), from the
received bytes, so nobody reports a norm it could lie about, no extra message is sent, and the
owner's bytes are what every member copies: the result stays bitwise identical everywhere. With
quantized values there is no owner (every member all-gathers every contribution,
:mod:`p2ptrain.collective._quantized_gather`): every member clips, with :func:`exact_norm`, a norm that is
the same float on every CPU, so their results agree bit for bit too.

What it does not do: a sign-flipped contribution of honest norm is within the radius and counts
fully (it cancels at most one honest member's share). The owner itself is not trusted in a robust
round: it is drawn per round and its chunk recomputed by a verifier (:mod:`p2ptrain.collective._owners`,
docs/collective.md, "No trusted owner").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ROBUST_RULES = ("none", "clip")
"""``none``: the plain mean; ``clip``: each contribution's norm clipped to the round's median norm
(a round's :class:`~p2ptrain.collective.RoundSpec` checks it)."""


def contribution_norm(parts: Sequence[torch.Tensor]) -> float:
    """The L2 norm of one member's contribution, given as consecutive pieces, in float64.

    float64 so that no finite float32 value can overflow the sum of squares (a hostile 1e30 gives
    a norm of 1e30, not inf, and is scaled like any other).
    """
    total = 0.0
    for part in parts:
        total += float(torch.linalg.vector_norm(part, dtype=torch.float64)) ** 2
    return math.sqrt(total)


def exact_norm(values: torch.Tensor) -> float:
    """The L2 norm of float32 ``values``, the same float on every machine, whatever its SIMD width.

    Where every member clips by itself (the quantized all-gather, :mod:`p2ptrain.collective._quantized_gather`)
    every member must compute the same radius and the same factors from the same bytes, or their
    results differ by an ulp and no checkpoint is attested. A vectorized reduction's order (and so its
    rounding) depends on the CPU; here every square is exact in float64 (24 bits of mantissa squared
    fit in 53, and no float32's square leaves float64's range) and :func:`math.fsum` rounds their sum
    once, correctly, so the result depends on the values alone. (~10 ms per 100,000 values.)
    """
    squares = torch.square(values.detach().reshape(-1).to(torch.float32).to(torch.float64))
    return math.sqrt(math.fsum(squares.tolist()))


def median_radius(norms: Sequence[float]) -> float:
    """The clipping radius: the lower median of the members' norms (sorted position (P-1)//2)."""
    ordered = sorted(norms)
    return ordered[(len(ordered) - 1) // 2]


def clip_scales(norms: Sequence[float]) -> list[float]:
    """Per member, the factor that brings its norm down to :func:`median_radius` (1.0 if within)."""
    tau = median_radius(norms)
    return [tau / n if n > tau else 1.0 for n in norms]


def scaled(part: torch.Tensor, scale: float) -> torch.Tensor:
    """``part`` times ``scale`` in its own dtype (a new tensor; ``part`` itself when 1.0)."""
    return part if scale == 1.0 else torch.mul(part, scale)
