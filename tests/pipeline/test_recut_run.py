"""The cut moved by measured time in a run of full peers (``local_peers``), ``[pipeline] balance =
"recut"``: one block of a 4-block transformer_lm is slow wherever it is computed (its forward
sleeps: the slowness goes with its parameters, which no cut moves away from themselves), so the
stage that holds it with another block is the pipeline's slowest. The drivers' timed summary entries
say so; at the first confirmed checkpoint the coordinator's plan cuts the model anew (the slow
block alone in its stage, its neighbour moved to the stage before), every member checks that cut
against the times it received itself (none refuses it), loads its stage of the new cut by CID from
the old stages' files, and the run confirms more models after the re-cut, in the new cut, with
every stage's replicas agreeing bit for bit (no ``stage_diverged``). The final manifest assembles
into the whole model, as ``model fetch`` and ``load_model`` read it.

On main (no re-cut) the plans kept the cut by parameters: the test timed out waiting for a plan
that names a cut.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import trio

from p2ptrain.models import build_model
from p2ptrain.models._pieces import _LMBlock
from p2ptrain.protocol import measured_cut
from p2ptrain.task import load_task, parameter_cut, stage_parameters
from p2ptrain.testing import local_peers
from p2ptrain.training import read_manifest
from p2ptrain.wire import RoundPlan

from .test_pipelined_run import publish, small_text, whole_model  # noqa: F401 (small_text: an autouse fixture)

DEADLINE_S = 300.0
WAIT_S = 200.0
SLOW_S = 0.1  # each forward of the slow block: far over what this small model's stages take on loopback
SLOW_BLOCK = "blocks.2"  # piece 3 of 6: with blocks.1 in stage 1 of the cut by parameters
TASK = """\
name = "recut"
seed = 3
[model]
name = "transformer_lm"
kwargs = {{ vocab_size = 256, context = 128, width = 16, depth = 4, heads = 2 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "sgd"
lr = 0.1
[training]
batch_size = 2
total_steps = 400
checkpoint_interval = 2
[peers]
min = 5
max = 5
[pipeline]
stages = 3
activations = "fp32"
check_fraction = 0
balance = "recut"
"""
BY_PARAMETERS = (0, 2, 4, 6)  # embedding and block 0 | blocks 1 and 2 | block 3 and the head
RECUT = (0, 3, 4, 6)  # embedding, blocks 0 and 1 | block 2 alone | block 3 and the head


@pytest.fixture(autouse=True)
def slow_block(monkeypatch):
    forward = _LMBlock.forward

    def slow(self: _LMBlock, h: torch.Tensor) -> torch.Tensor:
        if self.prefixes[0] == SLOW_BLOCK and not h.is_meta:
            time.sleep(SLOW_S)  # in the stage's worker thread (the replica's and driver's computations run there)
        return forward(self, h)

    monkeypatch.setattr(_LMBlock, "forward", slow)


async def test_the_plans_cut_the_model_anew_by_measured_time(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(5, tmp_path) as peers:
            manifest, task_cid = await publish(peers, TASK, shards=2)
            task = load_task(TASK.format(manifest=manifest))
            assert parameter_cut(task) == BY_PARAMETERS
            runs = await peers.join_all(task_cid)

            def recut() -> RoundPlan | None:
                plan = runs[0].book.accepted if runs[0].book else None
                return plan if plan is not None and plan.cut is not None else None

            plan = await peers.wait_until(recut, WAIT_S, what="a plan that names a cut (on main, never)")
            assert plan.cut == RECUT
            # At a confirmed checkpoint, from the times of its step, which every member that applied it received alike.
            base = next(r.record for r in runs[0].book.chain.records if r.record.version == plan.version)
            assert plan.version > 0 and base.step == plan.step and base.model_cid == plan.base_cid
            times = {t for r in runs if r.book is not None and (t := r.book.stage_times.at(plan.step)) is not None}
            assert len(times) == 1 and measured_cut(task, BY_PARAMETERS, min(times)) == RECUT, times
            assert min(times)[1] == max(min(times)), times  # stage 1, with the slow block, measured slowest
            # Models confirmed after the re-cut: every member loaded its stage of the new cut by CID.
            await peers.wait_version(task_cid, plan.version + 2, WAIT_S, what="two models confirmed after the re-cut")
            assert all(r.book is not None and not r.book.refused_spans for r in runs)
            statuses = [peers.status(i, task_cid) for i in range(5)]
            assert not any("stage_diverged" in s.get("rejected", {}) for s in statuses), statuses
            assert all(r.trainer is not None and r.trainer.cut == RECUT for r in runs)  # type: ignore[attr-defined]
            # task status --json: each stage's parameters are the new cut's.
            assert [e["parameters"] for e in statuses[0]["stages"]] == stage_parameters(task, RECUT)

            # The latest record's manifest is of the new cut, signed by a quorum of each stage's
            # replicas, and assembles into the whole model (model fetch, load_model).
            record = runs[0].book.chain.records[-1].record
            assert record.step > plan.step
            store = peers[0].content.store
            entries = read_manifest(store.cat(record.model_cid))
            assert [(e.first, e.last) for e in entries] == [(0, 2), (3, 3), (4, 5)]
            whole = await whole_model(peers[0], record.model_cid)
            model = build_model(task.model.name, task.model.arguments, task.seed)
            model.load_state_dict(whole, strict=True)
            assert sum(t.numel() for t in whole.values()) == sum(stage_parameters(task))
