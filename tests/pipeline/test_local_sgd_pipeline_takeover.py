"""A pipelined task in local-SGD mode whose coordinator is stopped mid-round (issue 31): another
member is elected, plans, and the run goes on to its end in that mode.

tests/pipeline/test_local_sgd_pipeline_run.py's run (four full peers in this process, two stages of
two replicas, H = 2, Nesterov outer steps) with a checkpoint every 2 outer steps. In the second outer
step of the span after the first checkpoint the test stops the coordinator while the members wait:

- ``pass``: every member between its first and its second pass (its stage's weights its own, the
  outer step not taken). The pass fails without the coordinator on every member.
- ``sum``: the coordinator's stage at its sum, while the other stage sums without it and takes the
  outer step, the span's last (each stage sums over its own replicas). The stages then stand a step
  apart: the other stage's members at the span's end, the coordinator's partner one step before.

A member of a later term is elected and plans: a pipelined takeover goes back to the checkpoint
(protocol/_planner.py, ``_takes_over_pipeline``), the one step every member can follow, and the run
trains to its end. On main ``sum`` stalled whenever a member of the stage that took the outer step
was elected (3 of 11 runs): elected at the span's end, it abandoned the checkpoint there that nobody
would record and planned the next span from it, past the head, which the coordinator's partner (one
step before, resynced to the head) could not follow, plan after plan, until the test's bound. The
pure decision is tests/pipeline/test_takeover_plans.py's.

Checked: the new coordinator is another member, of a later term, and signs the records after the
change (at least one more model confirmed, the chain the same on every member to the run's end, no
``stage_diverged``); each stage's replicas hold the same bits, weights and outer momentum, after
every outer step applied, before and after the change; the new term redid the span from the
checkpoint; every outer step was a local-SGD round (H inner steps); the loss falls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.api import split_shards
from p2ptrain.run import LocalSGDStagedTrainer
from p2ptrain.run._stages import StageRounds
from p2ptrain.testing import local_peers

from .test_local_sgd_pipeline_run import LOCAL as FOUR, shared_digest
from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("no_missed_plan")  # tests/conftest.py: no member missed a plan

DEADLINE_S = 300.0
STEP_S = 150.0
STEPS, INTERVAL, INNER = 6, 2, 2
LOCAL = (FOUR.replace("min = 4", "min = 3").replace("total_steps = 4", f"total_steps = {STEPS}")
         .replace("checkpoint_interval = 2", f"checkpoint_interval = {INTERVAL}"))
HELD_STEP = INTERVAL + 1  # the second outer step of the span after the first checkpoint


@pytest.mark.timeout(360)  # the suite's bound, declared: tests/conftest.py deals it among the first
@pytest.mark.parametrize("where", ["pass", "sum"])
async def test_a_local_sgd_pipelined_run_goes_on_when_its_coordinator_stops_mid_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    assert 'mode = "local_sgd"' in LOCAL and "min = 3" in LOCAL and f"total_steps = {STEPS}" in LOCAL
    assert f"checkpoint_interval = {INTERVAL}" in LOCAL and f"inner_steps = {INNER}" in LOCAL
    gate = trio.Event()  # the members wait at HELD_STEP (``where``) until the coordinator is stopped
    waiting: set[str] = set()
    # (plan term, attempt, outer step after, stage) -> {member: digest of its stage's shared state}: an
    # outer step redone by a later plan (the takeover goes back to the checkpoint) is another ring's.
    held: dict[tuple[int, int, int, int], dict[str, str]] = {}
    losses: dict[int, float] = {}
    inner_steps: dict[int, set[int]] = {}  # outer step -> the inner steps taken in it (by any member)
    step, one_pass, stage_sum = StageRounds.step, StageRounds._pass, StageRounds._sum
    inner_step_stage = LocalSGDStagedTrainer.inner_step_stage

    async def gated(self: StageRounds, plan: Any, index: int, batches: Any, wire_step: int,
                    inner: int | None = None) -> float:
        if where == "pass" and self._trainer().step == HELD_STEP and inner == 1 and not gate.is_set():
            waiting.add(self.run.me)
            await gate.wait()
        return await one_pass(self, plan, index, batches, wire_step, inner)

    async def summed(self: StageRounds, plan: Any, index: int, stage: int) -> None:
        coordinator = self.run.election.coordinator
        if where == "sum" and self._trainer().step == HELD_STEP and not gate.is_set() \
                and coordinator in plan.members and plan.stages[plan.members.index(coordinator)] == stage:
            waiting.add(self.run.me)
            await gate.wait()
        await stage_sum(self, plan, index, stage)

    async def recorded(self: StageRounds, plan: Any, index: int, batches: Any) -> Any:
        result = await step(self, plan, index, batches)
        stage = self.stage_of(plan)
        key = (plan.term, plan.attempt, self._trainer().step, stage)
        held.setdefault(key, {})[self.run.me] = shared_digest(self, stage)
        losses[result.step] = result.local_loss
        return result

    def stepped(self: LocalSGDStagedTrainer, stage: int, i: int, count: int, total: int) -> bool:
        inner_steps.setdefault(self.step, set()).add(i)
        return inner_step_stage(self, stage, i, count, total)

    monkeypatch.setattr(StageRounds, "_pass", gated)
    monkeypatch.setattr(StageRounds, "_sum", summed)
    monkeypatch.setattr(StageRounds, "step", recorded)
    monkeypatch.setattr(LocalSGDStagedTrainer, "inner_step_stage", stepped)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            manifest, task_cid = await publish(peers, LOCAL)
            for peer in peers[1:]:  # every peer holds the training shards: peer 0 may be the one stopped
                for cid in split_shards(peers[0].content.store, manifest, "train"):
                    await peer.content.fetch(cid)
            await peers.join_all(task_cid)
            ids = [p.node.peer_id.to_base58() for p in peers]

            def mid_round() -> tuple[int, int] | None:
                """Every member of a plan of all four waiting mid-round after the first checkpoint:
                (the coordinator's index, its term)."""
                statuses = [peers.status(i, task_cid) for i in range(4)]
                stepped = [s for s in statuses if s.get("step") == HELD_STEP + 1]  # took the outer step
                if (len(waiting), len(stepped)) != ((4, 0) if where == "pass" else (2, 2)):
                    return None
                if not all(s.get("version") == 1 and len(s.get("members", ())) == 4 for s in statuses):
                    return None
                leaders = {(s["coordinator"], s["term"]) for s in statuses}
                if len(leaders) != 1 or None in (leader := next(iter(leaders))):
                    return None
                return ids.index(leader[0]), leader[1]

            gone, term = await peers.wait_until(mid_round, STEP_S, what="every member mid-round after v1")
            await peers.stop_peer(gone)
            gate.set()
            rest = [i for i in range(4) if i != gone]
            final = await peers.wait_done(task_cid, STEP_S, rest, what="the run done on the three left")
            run = peers[rest[0]].tasks.runs[task_cid].shared
            assert run.book is not None
            records = [entry.record for entry in run.book.chain.records]

    # Another member led after the change, of a later term, and signed more confirmed models.
    assert [r.step for r in records] == list(range(INTERVAL, STEPS + 1, INTERVAL)), records
    after = [r for r in records if r.step > INTERVAL]
    assert after and all(r.coordinator != ids[gone] and r.term > term and ids[gone] not in r.members for r in after)
    assert records[0].coordinator == ids[gone] and records[0].term == term
    chains = {tuple((c["version"], c["step"], c["model_cid"]) for c in s["chain"]) for s in final}
    assert len(chains) == 1 and next(iter(chains))[-1][1] == STEPS, chains
    assert not any(s["rejected"].get("stage_diverged") for s in final)
    # Each stage's replicas held the same bits after every outer step applied, before and after the change.
    assert {at for _, _, at, _ in held} == set(range(1, STEPS + 1)), sorted(held)
    for (t, attempt, at, stage), digests in sorted(held.items()):
        assert len(set(digests.values())) == 1, \
            f"stage {stage}'s replicas differ after outer step {at} (term {t}, attempt {attempt}): {digests}"
    assert any(len(digests) >= 2 for (t, _, _, _), digests in held.items() if t > term), held
    # The new coordinator went back to the checkpoint (the stages' steps were not its to know) and
    # its plans redid the span from there.
    assert min(at for t, _, at, _ in held if t > term) == INTERVAL + 1, sorted(held)
    # Every outer step, those after the change too, was a local-SGD round; and the loss fell.
    assert all(inner_steps.get(s) == set(range(INNER)) for s in range(STEPS)), inner_steps
    assert losses[STEPS - 1] < losses[0], losses
