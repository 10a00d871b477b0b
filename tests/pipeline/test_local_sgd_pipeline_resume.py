"""A pipelined task in local-SGD mode survives losing every member (issue 31): three full peers in
this process, two stages, stopped together after the first checkpoint and started again on their
homes. Each resumes from the run's chain: it loads the manifest of the last record, then its
stage's files, whose optimizer file holds the stage's outer momentum (Nesterov), and the run goes
on from that record's outer step, not step 0, to its end.

Checked: every member's loaded outer momentum is, bit for bit, what the stage's replicas held at
that record's step before the stop (and not zeros); every outer step after the resume starts at or
after that step; after each of them the stage of two replicas holds the same bits (weights and
outer momentum) on both; the chain is confirmed to the end with no ``stage_diverged``.
(tests/pipeline/test_pipelined_resume.py is the same in sync mode.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain.run import LocalSGDStagedTrainer
from p2ptrain.run._stages import StageRounds
from p2ptrain.testing import local_peers

from .test_local_sgd_pipeline_run import LOCAL, shared_digest
from .test_pipelined_run import DEADLINE_S, publish, small_text, STEP_S

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins", "no_missed_plan")  # tests/conftest.py: quick waits, slow grace

__all__ = ["small_text"]  # the fixture (autouse): the small text, one thread

STEPS, INTERVAL = 4, 2
RESUMED = (LOCAL.replace("min = 4", "min = 3").replace("max = 4", "max = 3")  # its three members, restarted as themselves
           .replace("total_steps = 4", f"total_steps = {STEPS}"))
assert "max = 3" in RESUMED


def momentum_bits(trainer: LocalSGDStagedTrainer) -> dict[int, bytes]:
    """{parameter index: the bits of its outer momentum} as ``trainer`` holds them."""
    return {i: m.detach().numpy().tobytes() for i, m in trainer._momentum.items()}


async def test_a_local_sgd_pipelined_run_resumes_its_outer_momentum_from_the_stage_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert f"total_steps = {STEPS}" in RESUMED and "min = 3" in RESUMED and "checkpoint_interval = 2" in RESUMED
    resumed = False  # the members were restarted
    gate = trio.Event()  # never set: before the stop, every member waits at the step after the first checkpoint
    gated: set[str] = set()
    momentum: dict[int, dict[int, bytes]] = {}  # outer step -> {index: bits}, before the stop
    loads: list[tuple[int, dict[int, bytes]]] = []  # (step, momentum) each trainer loaded after the restart
    after: dict[tuple[int, int], dict[str, str]] = {}  # (outer step after, stage) -> {member: digest}, after it
    started: list[int] = []  # the outer step each round after the restart started from
    step, load = StageRounds.step, LocalSGDStagedTrainer._load_tensors

    async def recorded(self: StageRounds, plan: Any, index: int, batches: Any) -> Any:
        trainer = self._trainer()
        assert isinstance(trainer, LocalSGDStagedTrainer)
        if not resumed and trainer.step == INTERVAL + 1:
            gated.add(self.run.me)
            await gate.wait()  # cancelled by the stop
        if resumed:
            started.append(trainer.step)
        result = await step(self, plan, index, batches)
        stage = self.stage_of(plan)
        if resumed:
            after.setdefault((trainer.step, stage), {})[self.run.me] = shared_digest(self, stage)
        else:
            momentum.setdefault(trainer.step, {}).update(momentum_bits(trainer))
        return result

    def loaded(self: LocalSGDStagedTrainer, model_t: Any, optim_t: Any, at: int) -> None:
        load(self, model_t, optim_t, at)
        if resumed:
            loads.append((at, momentum_bits(self)))

    monkeypatch.setattr(StageRounds, "step", recorded)
    monkeypatch.setattr(LocalSGDStagedTrainer, "_load_tensors", loaded)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            _, task_cid = await publish(peers, RESUMED)
            await peers.join_all(task_cid)
            await peers.wait_version(task_cid, 1, STEP_S, what="the first checkpoint confirmed everywhere")
            await peers.wait_until(lambda: len(gated) == 3 or None, STEP_S, what="every member past it")
            for i in range(3):
                await peers.stop_peer(i)
            resumed = True
            for i in range(3):
                await peers.restart_peer(i, see_all=False)
            await peers.wait_connected()
            await peers.join_all(task_cid)

            final = await peers.wait_done(task_cid, STEP_S, what="the resumed run done on every member")
            for status in final:
                assert status["resumed_from"] is not None and status["resumed_from"]["version"] >= 1
                assert status["chain"][-1]["step"] == STEPS and not status["rejected"].get("stage_diverged")
            assert len({tuple(c["model_cid"] for c in s["chain"]) for s in final}) == 1
            assert all(peers[i].tasks.runs[task_cid].shared.task.training.local_sgd for i in range(3))

    # Each member loaded its stage's outer momentum from the record's optimizer file: the bits its
    # stage's replicas held at that outer step before the stop, not zeros, not a fresh start.
    resumed_at = {at for at, _ in loads if at > 0}
    assert resumed_at and min(resumed_at) >= INTERVAL, loads
    for at, bits in loads:
        if at == 0:
            continue
        assert bits and all(bits[i] == momentum[at][i] for i in bits), f"the outer momentum loaded at step {at} differs"
        assert all(torch.frombuffer(bytearray(b), dtype=torch.float32).abs().sum() > 0 for b in bits.values())
    # The run went on from its chain: no round after the restart started from step 0.
    assert started and min(started) >= INTERVAL, started
    # After every outer step since, the stage of two replicas holds the same bits on both.
    pairs = [digests for digests in after.values() if len(digests) == 2]
    assert pairs, after
    for (done, stage), digests in sorted(after.items()):
        assert len(set(digests.values())) == 1, f"stage {stage}'s replicas differ after outer step {done}"
