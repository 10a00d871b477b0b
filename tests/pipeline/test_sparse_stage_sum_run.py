"""A pipelined task whose stages sum their gradients sparsely (``[pipeline] stage_sum = "sparse"``:
top-k with error feedback at the task's ``[compression]`` density), run end to end by four full
peers in this process, two stages of two replicas each (tests/pipeline/test_pipelined_run.py's
helpers, its small text and its task with the option).

The replicas of a stage must hold the same bits after every step (the records attest exactly that:
every replica signs its stage's files), each replica must hold back part of its gradient in its own
residual (the sum was sparse), the records are confirmed to the run's end and the loss goes down.
On main the option is refused by the task parser (an unknown field), so this test fails there."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain.run._stages import StageRounds
from p2ptrain.testing import local_peers

from .test_pipelined_run import DEADLINE_S, publish, small_text, STEP_S, TASK

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

__all__ = ["small_text"]  # the fixture (autouse): the small text, one thread

STEPS = 8
SPARSE = (TASK.replace("min = 3", "min = 4").replace("max = 8", "max = 4").replace("total_steps = 16", f"total_steps = {STEPS}")
          .replace("checkpoint_interval = 2", "checkpoint_interval = 4")
          .replace('activations = "fp32"\n', 'activations = "fp32"\nstage_sum = "sparse"\n')
          + "[compression]\ndensity = 0.05\n")
assert "max = 4" in SPARSE


def stage_digest(rounds: StageRounds, stage: int) -> str:
    """SHA-256 of the bits of ``stage``'s parameters as this member holds them."""
    digest = hashlib.sha256()
    for p in rounds._trainer().stages[stage].parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
async def test_sparse_stage_sums_keep_the_replicas_identical_after_every_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert 'stage_sum = "sparse"' in SPARSE and "density = 0.05" in SPARSE and "min = 4" in SPARSE
    # (step after, stage) -> {member: digest of its stage's bits}; and each step's loss.
    held: dict[tuple[int, int], dict[str, str]] = {}
    losses: dict[int, float] = {}
    residuals: dict[str, float] = {}
    step = StageRounds.step

    async def recorded(self: StageRounds, plan: Any, index: int, batches: Any) -> Any:
        result = await step(self, plan, index, batches)
        stage = self.stage_of(plan)
        held.setdefault((self._trainer().step, stage), {})[self.run.me] = stage_digest(self, stage)
        losses[result.step] = result.local_loss
        assert self._sparse is not None
        residual = self._sparse.residual()
        residuals[self.run.me] = 0.0 if residual is None else float(residual.norm())
        return result

    monkeypatch.setattr(StageRounds, "step", recorded)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            _, task_cid = await publish(peers, SPARSE)
            await peers.join_all(task_cid)

            final = await peers.wait_done(task_cid, STEP_S, range(4), what="the sparse-summed run done on every member")
            task = peers[0].tasks.runs[task_cid].shared.task
            assert task.pipeline is not None and task.pipeline.sparse_sum

    # Every step applied by the plan's four members: each stage's two replicas, the same bits.
    assert {s for s, _ in held} == set(range(1, STEPS + 1))
    for (after, stage), digests in sorted(held.items()):
        assert len(digests) == 2, (after, stage, digests)
        assert len(set(digests.values())) == 1, f"stage {stage}'s replicas differ after step {after}"
    # The sum was sparse: every member kept part of its gradient back in its own residual.
    assert len(residuals) == 4 and all(norm > 0 for norm in residuals.values()), residuals
    # The records are confirmed to the run's end, the same chain on every member, no stage diverged.
    chains = {tuple((c["version"], c["step"], c["model_cid"]) for c in s["chain"]) for s in final}
    assert len(chains) == 1 and next(iter(chains))[-1][1] == STEPS, chains
    assert not any(s["rejected"].get("stage_diverged") for s in final)
    # And it learns: the last two steps' loss is below the first two's.
    first, last = sum(losses[s] for s in (0, 1)) / 2, sum(losses[s] for s in (STEPS - 2, STEPS - 1)) / 2
    assert last < first, losses
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
