"""The cut moved by measured time in a local-SGD pipelined run (``[pipeline] balance = "recut"`` with
``[training] mode = "local_sgd"``): tests/pipeline/test_recut_run.py's run (five full peers, three
stages of a 4-block transformer_lm, blocks 1 and 2 and the head slow layers) in outer steps of two
passes each, Nesterov outside. The drivers' timed entries of each pass's summary reach the book (the
last pass's, with the outer step); at a confirmed checkpoint (an outer step's end) the coordinator's
plan cuts the model anew, every member checks it against its own times, loads its stage of the new
cut by CID from the old stages' files, weights and outer momentum bit for bit what those files
held of its pieces (the momentum not zero: it was stepped), and the run confirms two more models in
the new cut with every stage's replicas agreeing bit for bit (no ``stage_diverged``), each stage's
optimizer file holding the outer momentum of exactly its parameters.

On main the task was refused by the parser (``"recut" is not built for training.mode = "local_sgd"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain.protocol import read_tensors
from p2ptrain.run import LocalSGDStagedTrainer
from p2ptrain.task import load_task, parameter_cut
from p2ptrain.testing import local_peers, slow_layers
from p2ptrain.training import read_manifest

from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)
from .test_recut_run import BY_PARAMETERS, RECUT, SLOW_S, TASK as SYNC_TASK, recut_plan

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins", "no_missed_plan")  # tests/conftest.py

DEADLINE_S = 200.0
WAIT_S = 150.0
# Outer steps of two passes; a checkpoint after each (the first times are of outer step 1's last pass).
TASK = (SYNC_TASK.replace('name = "recut"', 'name = "recut-local-sgd"')
        .replace("total_steps = 400\ncheckpoint_interval = 2", 'total_steps = 100\ncheckpoint_interval = 1\n'
                 'mode = "local_sgd"\ninner_steps = 2')
        .replace("[pipeline]", '[outer]\noptimizer = "nesterov"\nlr = 0.7\nmomentum = 0.5\n[pipeline]'))


@pytest.fixture(autouse=True)
def slow():
    with slow_layers(SLOW_S):
        yield


async def test_a_local_sgd_run_moves_its_cut_at_an_outer_step_with_its_outer_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert 'mode = "local_sgd"' in TASK and "checkpoint_interval = 1" in TASK and 'optimizer = "nesterov"' in TASK
    # Every stage a member loads of the new cut: (its weights and outer state after the load, what the
    # files it came from held).
    loaded: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    load_parts = LocalSGDStagedTrainer.load_parts

    def recorded(self: LocalSGDStagedTrainer, stage: int, parts: Any, step: int | None = None) -> None:
        load_parts(self, stage, parts, step)
        if self.cut == RECUT:
            held = {n: t for *_, model, optim in parts for data in (model, optim) for n, t in read_tensors(data).items()}
            whole = self.model.state_dict()
            mine = {n: whole[n].clone() for n in self.stages[stage].state_names()}  # it trains on in place
            loaded.append(({**mine, **self.optimizer_tensors()}, held))

    monkeypatch.setattr(LocalSGDStagedTrainer, "load_parts", recorded)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(5, tmp_path) as peers:
            manifest, task_cid = await publish(peers, TASK, shards=2)
            task = load_task(TASK.format(manifest=manifest))
            assert task.training.local_sgd and parameter_cut(task) == BY_PARAMETERS
            runs = await peers.join_all(task_cid)

            # At a confirmed checkpoint (an outer step's end), from the times of that outer step's last pass.
            plan, _ = await recut_plan(peers, runs, task, "a plan that names a cut (on main, the task refused)")
            # Two models confirmed after the re-cut: every member loaded its stage of the new cut by CID.
            await peers.wait_version(task_cid, plan.version + 2, WAIT_S, what="two models confirmed after the re-cut")
            assert all(r.book is not None and not r.book.refused_spans for r in runs)
            statuses = [peers.status(i, task_cid) for i in range(5)]
            assert not any("stage_diverged" in s.get("rejected", {}) for s in statuses), statuses
            assert all(r.trainer is not None and r.trainer.cut == RECUT for r in runs)  # type: ignore[attr-defined]
            # Each load of the new cut took exactly the old files' weights and outer momentum of its pieces (stepped: not zero).
            assert len(loaded) >= 5, len(loaded)
            for state, held in loaded:
                assert [n for n, t in state.items() if not torch.equal(t, held[n])] == []
                momenta = [t for n, t in state.items() if n.endswith(".outer_momentum")]
                assert momenta and all(t.abs().sum() > 0 for t in momenta)
            # The latest record's manifest is of the new cut; each stage's optimizer file holds the
            # outer momentum of exactly its parameters (by whole-model index) and the outer step.
            record = runs[0].book.chain.records[-1].record
            store = peers[0].content.store
            entries = read_manifest(store.cat(record.model_cid))
            assert [(e.first, e.last) for e in entries] == [(0, 2), (3, 3), (4, 5)]
            trainer = runs[0].trainer
            assert isinstance(trainer, LocalSGDStagedTrainer)
            for stage, entry in enumerate(entries):
                await peers[0].content.fetch(entry.optimizer)
                optim = read_tensors(store.cat(entry.optimizer))
                assert int(optim.pop("trainer.step")) == record.step
                assert set(optim) == {f"state.{i}.outer_momentum" for i in trainer._stage_indices(stage)}
