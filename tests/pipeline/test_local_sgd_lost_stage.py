"""A pipelined task in local-SGD mode whose stage lost its last replica mid-run (issue 31): another
member takes the stage by CID, its weights and its outer momentum, and the run goes on in that mode.

tests/pipeline/test_lost_stage_run.py's run (four full peers in this process, a `transformer_lm` cut
into 3 stages, the middle one of two replicas) in ``training.mode = "local_sgd"`` (H = 2, Nesterov
outer steps): after the first checkpoint, while every member waits at the next outer step, the lone
replica of a stage (not the coordinator) stops. The coordinator's next plan moves a member of the
middle stage there and takes every stage back to the checkpoint; the moved member loads that stage's
files, whose optimizer file holds its outer momentum, and the run trains to its end.

Checked: the moved member serves the orphaned stage and loaded its outer momentum at the
checkpoint's step, bit for bit what the lost replica held there; every outer step after the
recovery is a local-SGD round (H inner steps); the chain is confirmed to the end with no
``stage_diverged``; the loss keeps falling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.api import split_shards
from p2ptrain.protocol import stage_rings
from p2ptrain.run import LocalSGDStagedTrainer
from p2ptrain.run._stages import StageRounds
from p2ptrain.testing import local_peers

from .test_local_sgd_pipeline_resume import momentum_bits
from .test_lost_stage_run import TASK
from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins", "no_missed_plan")  # tests/conftest.py: quick waits, slow grace

DEADLINE_S = 300.0
STEP_S = 120.0
STEPS, INTERVAL, INNER = 4, 2, 2
LOCAL = (TASK.replace("total_steps = 12", f"total_steps = {STEPS}")
         .replace("checkpoint_interval = 4", f"checkpoint_interval = {INTERVAL}")
         .replace("batch_size = 4\n", f'batch_size = 4\nmode = "local_sgd"\ninner_steps = {INNER}\n')
         .replace("check_fraction = 0.0\n", "")
         + '[outer]\noptimizer = "nesterov"\nlr = 0.7\nmomentum = 0.5\n')


async def test_a_local_sgd_stage_that_lost_its_last_replica_is_taken_with_its_outer_momentum(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert 'mode = "local_sgd"' in LOCAL and f"total_steps = {STEPS}" in LOCAL and "stages = 3" in LOCAL
    gate = trio.Event()  # every member waits at the outer step after the first checkpoint until the victim is stopped
    momentum: dict[int, dict[int, bytes]] = {}  # outer step -> {index: bits}, as the members held them
    loads: dict[str, list[tuple[int, dict[int, bytes]]]] = {}  # member -> (step, momentum) its trainer loaded
    inner: dict[int, set[int]] = {}  # outer step -> the inner steps taken in it
    losses: dict[int, float] = {}
    step, load, inner_step_stage = StageRounds.step, LocalSGDStagedTrainer._load_tensors, \
        LocalSGDStagedTrainer.inner_step_stage
    owners: dict[int, str] = {}  # id(trainer) -> its member

    async def gated(self: StageRounds, plan: Any, index: int, batches: Any) -> Any:
        trainer = self._trainer()
        owners[id(trainer)] = self.run.me
        if trainer.step == INTERVAL + 1:
            await gate.wait()
        result = await step(self, plan, index, batches)
        assert isinstance(trainer, LocalSGDStagedTrainer)
        momentum.setdefault(trainer.step, {}).update(momentum_bits(trainer))
        losses[result.step] = result.local_loss
        return result

    def loaded(self: LocalSGDStagedTrainer, model_t: Any, optim_t: Any, at: int) -> None:
        load(self, model_t, optim_t, at)
        if id(self) in owners:
            loads.setdefault(owners[id(self)], []).append((at, momentum_bits(self)))

    def stepped(self: LocalSGDStagedTrainer, stage: int, i: int, held: int, total: int) -> bool:
        inner.setdefault(self.step, set()).add(i)
        return inner_step_stage(self, stage, i, held, total)

    monkeypatch.setattr(StageRounds, "step", gated)
    monkeypatch.setattr(LocalSGDStagedTrainer, "_load_tensors", loaded)
    monkeypatch.setattr(LocalSGDStagedTrainer, "inner_step_stage", stepped)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            manifest, task_cid = await publish(peers, LOCAL)
            for peer in peers[1:]:  # every peer holds the training shards: peer 0 may be the one stopped
                for cid in split_shards(peers[0].content.store, manifest, "train"):
                    await peer.content.fetch(cid)
            await peers.join_all(task_cid)
            ids = [p.node.peer_id.to_base58() for p in peers]

            def past_checkpoint() -> tuple[int, int, list[int]] | None:
                """Every member at the gate after the first checkpoint, all four in the plan: (victim,
                orphaned stage, the orphaned stage's parameter indices)."""
                run = peers[0].tasks.runs[task_cid].shared
                plan = run.book.last_plan if run.book else None
                if plan is None or plan.stages is None or len(plan.members) < 4 or not run.book.chain.records:
                    return None
                statuses = [peers.status(i, task_cid) for i in range(4)]
                if not all(s.get("step") == INTERVAL + 1 and s.get("version") == 1 for s in statuses):
                    return None
                rings = stage_rings(plan)
                lone = [(s, ring[0]) for s, ring in enumerate(rings) if len(ring) == 1
                        and ring[0] != run.election.coordinator]
                if not lone:
                    return None
                orphan, victim = lone[-1]
                indices = sorted(peers[ids.index(victim)].tasks.runs[task_cid].shared.trainer._stage_indices(orphan))
                return ids.index(victim), orphan, indices

            victim, orphan, indices = await peers.wait_until(past_checkpoint, STEP_S, what="the gate after v1")
            before = peers[0].tasks.runs[task_cid].shared.book.last_plan
            moved = max(next(ring for ring in stage_rings(before) if len(ring) == 2))
            await peers.stop_peer(victim)
            gate.set()
            alive = [i for i in range(4) if i != victim]
            final = await peers.wait_done(task_cid, STEP_S, alive, what="the run done on the three left")
            chains = {tuple((c["version"], c["step"], c["model_cid"]) for c in s["chain"]) for s in final}
            assert len(chains) == 1 and [c[1] for c in next(iter(chains))] == list(range(INTERVAL, STEPS + 1, INTERVAL))
            assert not any("stage_diverged" in s["rejected"] for s in final)
            status = peers.status(ids.index(moved), task_cid)
            assert status["stage"] == orphan and status["stages"][orphan]["replicas"] == [moved]
            assert status["stage_recovery"]["moved"] and status["stage_recovery"]["stages"] == [orphan]

    # The moved member loaded the orphaned stage at the checkpoint's step: its outer momentum, the
    # bits the lost replica held there (Nesterov: not zeros).
    took = [bits for at, bits in loads.get(moved, []) if at == INTERVAL and set(indices) <= set(bits)]
    assert took, loads.get(moved)
    assert all(took[-1][i] == momentum[INTERVAL][i] for i in indices)
    assert any(any(b) for b in took[-1].values())
    # Every outer step, those after the recovery too, was a local-SGD round; and the loss fell.
    assert all(inner.get(s) == set(range(INNER)) for s in range(STEPS)), inner
    assert losses[STEPS - 1] < losses[0], losses
