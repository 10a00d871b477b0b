"""The replicas of a stage end a step with the same gradient: their sum, by the existing ring.

Each replica of a stage holds the gradients of the microbatches it served (every microbatch of the
step exactly once across the stage's live replicas, weighted by its share of the step:
:meth:`p2ptrain.pipeline.Driver.finish`), so the stage's gradient of the whole step is their *sum*.
The exact dense all-reduce (:class:`p2ptrain.collective.Collective`) gives every replica of the ring
the same bits, so the same optimizer step keeps the replicas bitwise identical.

Under the task's ``robust = "clip"`` (``[compression]``, as for a data-parallel run's rounds) the
sum is the direct exchange's instead: each chunk's owner, drawn from a seed no member chooses,
clips every replica's contribution to the median of their norms and a verifier recomputes it
(:mod:`p2ptrain.collective._robust`): a hostile replica weighs at most what an honest one does, and
an owner that writes a chunk of its own is named. In the plain sum a replica's contribution counts
whatever its size. (Clipping costs honest replicas too where their shares differ: a replica that
served more microbatches has the larger norm.)

With a ``reducer`` (each replica's own :class:`~p2ptrain.collective.SparseAllReducer` for its stage,
op ``"sum"``: the data-parallel rounds' top-k with error feedback) the stage's sum is sparse: every
replica contributes its values at the round's agreed indices, receives the same summed entries (the
same bits on every replica, so they stay identical), and keeps what it did not send in its own
residual for the next step. At a size where the link matters the dense fp32 sum is most of a step's
bytes (docs/benchmarks.md: 97% at 47.6M parameters); this sends ``density`` of it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from p2ptrain.collective import Collective, RoundSpec, SparseAllReducer
from p2ptrain.pipeline._partition import Stage


async def sum_stage_gradients(
    collective: Collective, stage: Stage, ring: Sequence[Hashable], round_id: int, *, timeout: float = 10.0,
    robust: str = "none", owner_seed: int | None = None, reducer: SparseAllReducer | None = None,
    seed: int | None = None,
) -> None:
    """Replace every parameter's gradient of ``stage`` by its sum over ``ring`` (this replica
    included; a ring of one leaves it as it is). ``round_id`` is fresh for every stage and step.
    ``robust``: the task's rule (``"none"``, ``"clip"``); ``owner_seed``: in a robust round, the
    seed that draws each chunk's owner and verifier (:func:`p2ptrain.protocol.owner_seed`).
    ``reducer``: a sparse sum with error feedback instead (its spec's op must be ``"sum"``; it
    carries the robust rule itself); ``seed``: the round's top-k draw, the same on every replica."""
    params = list(stage.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    if reducer is not None:
        if reducer.spec.op != "sum":
            raise ValueError("a stage's replicas sum their gradients: the reducer's op must be 'sum'")
        flat = await reducer.allreduce(flat, list(ring), round_id, seed=seed, owner_seed=owner_seed)  # type: ignore[arg-type]
    elif len(ring) > 1:
        spec = RoundSpec(op="sum", robust=robust, timeout=timeout)
        flat = await collective.allreduce(flat, list(ring), round_id, spec, owner_seed=owner_seed)  # type: ignore[arg-type]
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
