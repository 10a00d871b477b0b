"""A stage's gradient sum over its replicas under the task's robust rule, on real libp2p hosts
(127.0.0.1): a hostile replica's contribution is bounded by the honest ones' (h-redteam's F2, first
half). In the plain exact sum it counts at whatever size it is sent."""

from __future__ import annotations

import pytest
import torch
import trio

from p2ptrain.collective import Collective
from p2ptrain.models._registry import build_model
from p2ptrain.pipeline import partition, sum_stage_gradients
from p2ptrain.testing import connected_hosts

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}
HOSTILE, SCALE = 1, 100.0
DEADLINE_S = 60


def replica_stage(k: int):
    """Stage 1 of 2 with gradients of replica ``k``'s own microbatch (honest: similar norms)."""
    stage = partition(build_model("transformer_lm", LM, seed=5), 2)[1]
    g = torch.Generator().manual_seed(k)
    x = torch.randn(2, LM["context"], LM["width"], generator=g)
    y = torch.randint(0, LM["vocab_size"], (2, LM["context"]), generator=g)
    torch.nn.functional.cross_entropy(stage(x).reshape(-1, LM["vocab_size"]), y.reshape(-1)).backward()
    return stage


def flat_grad(stage) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in stage.parameters()])


async def stage_sum(robust: str, replicas: int) -> tuple[list[torch.Tensor], torch.Tensor, float]:
    """Every replica's summed gradient, the honest sum (the hostile replica's true share included),
    and the largest honest contribution's norm."""
    stages = [replica_stage(k) for k in range(replicas)]
    honest = [flat_grad(s) for s in stages]
    for p in stages[HOSTILE].parameters():
        p.grad.mul_(SCALE)  # the hostile replica sends 100x its gradient: finite, well-formed
    async with connected_hosts(replicas) as hosts:
        ring = [h.id for h in hosts]
        collectives = [Collective(h.host) for h in hosts]
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                for c, s in zip(collectives, stages):
                    nursery.start_soon(lambda c=c, s=s: sum_stage_gradients(c, s, ring, 17, robust=robust, owner_seed=3))
    return [flat_grad(s) for s in stages], sum(honest), max(float(h.norm()) for h in honest)


@pytest.mark.parametrize(("robust", "replicas"), [("none", 3), ("clip", 2), ("clip", 3)])
async def test_a_hostile_replicas_share_of_the_stage_sum_is_bounded_under_clip(robust, replicas):
    sums, truth, largest = await stage_sum(robust, replicas)
    assert all(torch.equal(s, sums[0]) for s in sums)  # the replicas stay bitwise identical
    off = float((sums[0] - truth).norm())
    if robust == "none":
        assert off > 50 * largest  # the plain sum takes the 100x as it is
    else:
        # Each chunk's contributions clipped to their median norm: the hostile one weighs at most
        # an honest one's, so the sum is off by at most about two honest contributions.
        assert off < 2 * largest
