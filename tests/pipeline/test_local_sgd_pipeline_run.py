"""A pipelined task in local-SGD mode run end to end by four full peers in this process, two stages
of two replicas each (tests/pipeline/test_pipelined_run.py's helpers, its small text and its task in
that mode): each round is H passes of the drivers' batch through the stages, each replica stepping
its own optimizer on what went through it, then the stage's replicas sum their pseudo-gradients and
take the outer step (Nesterov: its momentum is shared state too).

Between outer steps the replicas of a stage differ; after every outer step they must hold the same
bits, weights and outer momentum alike (the records attest exactly that: every replica signs its
stage's files, which hold both), the records are confirmed to the run's end in outer steps, no
stage diverged, and the loss goes down. On main the task parser refused the mode for a pipelined
task, so this test fails there.

``sparse``: the same run with the stage sum sparse with error feedback (``stage_sum = "sparse"`` at
density 0.05: the pseudo-gradients summed as top-k, each replica's residual its own): the same
bits after every outer step, and every member kept part of its pseudo-gradient back in its residual."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain.run import LocalSGDStagedTrainer
from p2ptrain.run._stages import StageRounds
from p2ptrain.testing import local_peers

from .test_pipelined_run import DEADLINE_S, publish, small_text, STEP_S, TASK

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins", "no_missed_plan")  # tests/conftest.py: quick waits, slow grace

__all__ = ["small_text"]  # the fixture (autouse): the small text, one thread

STEPS, INNER = 4, 2
# max 4: the four members of its runs (and of test_local_sgd_pipeline_takeover.py's), all from the start
LOCAL = (TASK.replace("min = 3", "min = 4").replace("max = 8", "max = 4").replace("total_steps = 16", f"total_steps = {STEPS}")
         .replace("batch_size = 4\n", f'batch_size = 4\nmode = "local_sgd"\ninner_steps = {INNER}\n')
         .replace("check_fraction = 0.0\n", "")
         + '[outer]\noptimizer = "nesterov"\nlr = 0.7\nmomentum = 0.5\n')
assert "max = 4" in LOCAL
SPARSE = (LOCAL.replace('activations = "fp32"\n', 'activations = "fp32"\nstage_sum = "sparse"\n')
          + "[compression]\ndensity = 0.05\n")


def shared_digest(rounds: StageRounds, stage: int) -> str:
    """SHA-256 of the bits of ``stage``'s parameters and of its outer state as this member holds them."""
    digest = hashlib.sha256()
    trainer = rounds._trainer()
    for p in trainer.stages[stage].parameters():
        digest.update(p.detach().numpy().tobytes())
    for name, t in sorted(trainer.optimizer_tensors().items()):
        digest.update(name.encode() + t.numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("stage_sum", ["dense", "sparse"])
async def test_local_sgd_stages_hold_the_same_bits_after_every_outer_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage_sum: str) -> None:
    assert 'mode = "local_sgd"' in LOCAL and "check_fraction" not in LOCAL and "min = 4" in LOCAL
    assert 'stage_sum = "sparse"' in SPARSE and "density = 0.05" in SPARSE
    task_text = SPARSE if stage_sum == "sparse" else LOCAL
    # (outer step after, stage) -> {member: digest of its stage's shared state}; each outer step's loss.
    held: dict[tuple[int, int], dict[str, str]] = {}
    losses: dict[int, float] = {}
    step = StageRounds.step
    inner_step_stage = LocalSGDStagedTrainer.inner_step_stage
    mid_round: dict[tuple[int, int, int], dict[int, bytes]] = {}  # (step, inner, stage) -> {trainer: its bits}
    residuals: dict[str, float] = {}  # member -> the norm of its sparse residual after its last outer step
    shaped: dict[str, tuple[int | None, int]] = {}  # member -> its stage's requests' microbatch, and refused for shape

    def stepped(self: LocalSGDStagedTrainer, stage: int, inner: int, count: int, total: int) -> bool:
        done = inner_step_stage(self, stage, inner, count, total)
        bits = b"".join(p.detach().numpy().tobytes() for p in self.stages[stage].parameters())
        mid_round.setdefault((self.step, inner, stage), {})[id(self)] = bits
        return done

    async def recorded(self: StageRounds, plan: Any, index: int, batches: Any) -> Any:
        result = await step(self, plan, index, batches)
        stage = self.stage_of(plan)
        held.setdefault((self._trainer().step, stage), {})[self.run.me] = shared_digest(self, stage)
        losses[result.step] = result.local_loss
        assert self._evaluee is not None
        shapes = self._evaluee.shapes
        shaped[self.run.me] = (shapes.microbatch if shapes else None, self._evaluee.refused["shape"])
        if self._sparse is not None:
            residual = self._sparse.residual()
            residuals[self.run.me] = 0.0 if residual is None else float(residual.norm())
        return result

    monkeypatch.setattr(StageRounds, "step", recorded)
    monkeypatch.setattr(LocalSGDStagedTrainer, "inner_step_stage", stepped)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            _, task_cid = await publish(peers, task_text)
            await peers.join_all(task_cid)

            final = await peers.wait_done(task_cid, STEP_S, range(4), what="the local-SGD pipelined run done on every member")
            run = peers[0].tasks.runs[task_cid].shared
            task = run.task
            assert task.pipeline is not None and task.training.local_sgd and task.pipeline.check_fraction == 0.0
            assert task.pipeline.sparse_sum == (stage_sum == "sparse")
            # Every checkpoint has test metrics: the coordinator evaluated the outer step's weights
            # through the stages before any replica's weights moved on.
            assert run.book is not None
            records = [entry.record for entry in run.book.chain.records]
            assert [r.step for r in records] == list(range(2, STEPS + 1, 2))
            assert all({"loss", "accuracy"} <= set(r.metrics) for r in records), [r.metrics for r in records]

    # Every outer step applied by the plan's four members: each stage's two replicas, the same bits.
    assert {s for s, _ in held} == set(range(1, STEPS + 1))
    for (after, stage), digests in sorted(held.items()):
        assert len(digests) == 2, (after, stage, digests)
        assert len(set(digests.values())) == 1, f"stage {stage}'s replicas differ after outer step {after}"
    # In between they trained apart: after an inner step, a stage's two replicas held different bits.
    assert any(len(set(bits.values())) == 2 for bits in mid_round.values()), "the replicas never trained apart"
    assert {inner for _, inner, _ in mid_round} == set(range(INNER))
    if stage_sum == "sparse":  # the sum was sparse: every member kept part of its pseudo-gradient back
        assert len(residuals) == 4 and all(norm > 0 for norm in residuals.values()), residuals
    else:
        assert not residuals
    # The records are confirmed to the run's end, in outer steps, the same chain everywhere, no stage diverged.
    chains = {tuple((c["version"], c["step"], c["model_cid"]) for c in s["chain"]) for s in final}
    assert len(chains) == 1 and next(iter(chains))[-1][1] == STEPS, chains
    assert not any(s["rejected"].get("stage_diverged") for s in final)
    # Every member's stage took requests of the task's shapes only (its microbatch of 2), and refused none.
    assert shaped == {m: (2, 0) for m in shaped} and len(shaped) == 4, shaped
    # And it learns: the last outer step's loss is below the first's.
    assert losses[STEPS - 1] < losses[0], losses
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
