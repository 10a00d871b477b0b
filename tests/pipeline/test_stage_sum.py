"""A stage's gradient sum over its replicas under the task's robust rule, on real libp2p hosts
(127.0.0.1): a hostile replica's contribution is bounded by the honest ones' (h-redteam's F2, first
half). In the plain exact sum it counts at whatever size it is sent. A sparse sum (top-k with error
feedback) keeps the replicas identical and loses nothing."""

from __future__ import annotations

import math

import pytest
import torch
import trio

from p2ptrain.collective import Collective, RoundSpec, SparseAllReducer
from p2ptrain.models._registry import build_model
from p2ptrain.pipeline import partition, partition_at, sum_stage_gradients
from p2ptrain.testing import connected_hosts

LM = {"vocab_size": 50, "context": 8, "width": 16, "depth": 2, "heads": 2}
HOSTILE, SCALE = 1, 100.0
DEADLINE_S = 60


def replica_stage(k: int, cut: tuple[int, ...] | None = None):
    """Stage 1 of 2 (of the cut by parameters, or at the bounds ``cut``) with gradients of replica
    ``k``'s own microbatch (honest: similar norms)."""
    model = build_model("transformer_lm", LM, seed=5)
    stage = (partition(model, 2) if cut is None else partition_at(model, cut))[1]
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


@pytest.mark.parametrize("replicas", [2, 3])
async def test_a_sparse_stage_sum_keeps_the_replicas_identical_and_loses_nothing(replicas):
    """Top-k with error feedback (each replica's own SparseAllReducer, op "sum"): every step the
    replicas receive the same bits, a small share of the entries, and what nobody sent yet stays in
    the residuals, so the steps' sums and the residuals add up to the true sums."""
    density, steps = 0.05, 3
    spec = RoundSpec(op="sum", density=density, timeout=10.0)
    async with connected_hosts(replicas) as hosts:
        ring = [h.id for h in hosts]
        reducers = [SparseAllReducer(Collective(h.host), spec) for h in hosts]
        applied, truth = None, None
        for step in range(steps):
            stages = [replica_stage(10 * step + k) for k in range(replicas)]
            step_truth = sum(flat_grad(s) for s in stages)
            with trio.fail_after(DEADLINE_S):
                async with trio.open_nursery() as nursery:
                    for r, s in zip(reducers, stages):
                        nursery.start_soon(lambda r=r, s=s: sum_stage_gradients(
                            r.collective, s, ring, 100 + step, reducer=r, seed=step))
            sums = [flat_grad(s) for s in stages]
            assert all(torch.equal(s, sums[0]) for s in sums)  # the replicas stay bitwise identical
            assert 0 < int((sums[0] != 0).sum()) <= replicas * math.ceil(density * sums[0].numel())
            applied = sums[0] if applied is None else applied + sums[0]
            truth = step_truth if truth is None else truth + step_truth
        residuals = sum(r.feedback.residual for r in reducers)
        torch.testing.assert_close(applied + residuals, truth, rtol=1e-5, atol=1e-6)
        assert float(residuals.norm()) > 0  # something was held back: the sum was sparse


async def test_a_stage_sum_refuses_a_reducer_that_averages():
    async with connected_hosts(1) as hosts:
        reducer = SparseAllReducer(Collective(hosts[0].host), RoundSpec(density=0.1))
        with pytest.raises(ValueError, match="sum"):
            await sum_stage_gradients(reducer.collective, replica_stage(0), [hosts[0].id], 1, reducer=reducer)


async def test_a_members_sparse_stage_sum_keeps_its_residual_only_on_its_stage_and_step():
    """run/_stage_sum.py: the residual is carried from step to step on one stage, taken back to what
    it was when the trainer rolls a step back (the retry does not count that step's unsent entries
    twice), and dropped when the member's stage (or its step, otherwise) changes, or its pieces
    (a plan moved the cut: the same stage index at the same step is another stage)."""
    from p2ptrain.run._stage_sum import SparseStageSum
    from p2ptrain.task import load_task

    from .conftest import LM_TASK

    task = load_task(LM_TASK + '[pipeline]\nstages = 2\nstage_sum = "sparse"\n[compression]\ndensity = 0.1\n')
    async with connected_hosts(1) as hosts:
        ring = [hosts[0].id]
        member = SparseStageSum(task, Collective(hosts[0].host), timeout=10.0)
        assert member.spec.op == "sum" and member.spec.density == 0.1 and member.residual() is None

        rounds = iter(range(100, 200))  # a fresh round id for every sum (a retry's too)

        async def step(stage_index: int, step: int, k: int,
                       cut: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            stage = replica_stage(k, cut)
            grad = flat_grad(stage)
            with trio.fail_after(DEADLINE_S):
                await member.sum(stage, stage_index, step, ring, next(rounds), seed=step, owner_seed=step)
            residual = member.residual()
            assert residual is not None
            return grad, flat_grad(stage) + residual  # the gradient and what it became: sent + kept

        grad, total = await step(1, 0, k=0)
        torch.testing.assert_close(total, grad)  # a first step: nothing carried in
        kept = member.residual().clone()
        assert float(kept.norm()) > 0
        # Step 1 on the same stage carries step 0's residual in.
        grad, total = await step(1, 1, k=1)
        torch.testing.assert_close(total, grad + kept)
        after = member.residual().clone()
        # Step 1 rolled back and redone with the same gradient: step 0's residual carried in again (not
        # dropped, not step 1's), so the same residual after it, without step 1's unsent part twice.
        grad, total = await step(1, 1, k=1)
        torch.testing.assert_close(total, grad + kept)
        torch.testing.assert_close(member.residual(), after)
        # Moved to another stage (its gradient happens to have the same size here): nothing carried.
        grad, total = await step(0, 2, k=2)
        torch.testing.assert_close(total, grad)
        # The trainer at another step than the residual's (a checkpoint loaded, a resync): dropped too.
        grad, total = await step(0, 7, k=3)
        torch.testing.assert_close(total, grad)
        # Stage 1 at step 9 of the cut by parameters (pieces 2..3), then at step 10 of a moved cut
        # (pieces 1..3: the same index and step as the residual's, other parameters): nothing carried.
        await step(1, 9, k=4)
        grad, total = await step(1, 10, k=5, cut=(0, 1, 4))
        torch.testing.assert_close(total, grad)
