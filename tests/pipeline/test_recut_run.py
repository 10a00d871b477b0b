"""The cut moved by measured time in a run of full peers (``local_peers``), ``[pipeline] balance =
"recut"``: blocks 1 and 2 of a 4-block transformer_lm are slow layers wherever they are computed
(``testing.slow_layers``: each one's forward and backward sleep, so the slowness goes with the
pieces, as the re-cut's model of a stage's time assumes), and the head a little slow, so stage 1 of
the cut by parameters, which holds both slow blocks, is the pipeline's slowest. The drivers' timed
summary entries say so; at a confirmed checkpoint the coordinator's plan cuts the model anew (block
1 moved to stage 0, block 2 alone in stage 1: the slow layers split between two stages), every
member checks that cut against the times it received itself (none refuses it), loads its stage of
the new cut by CID from the old stages' files, and the run confirms more models after the re-cut,
in the new cut, with every stage's replicas agreeing bit for bit (no ``stage_diverged``). The final
manifest assembles into the whole model, as ``model fetch`` and ``load_model`` read it. Every
member stopped after the re-cut and restarted on its home resumes from a manifest of the moved cut
(its trainer starts with the task's cut) and the run confirms more models.

On main (no re-cut) the plans kept the cut by parameters: the test timed out waiting for a plan
that names a cut.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from p2ptrain.models import build_model
from p2ptrain.protocol import measured_cut
from p2ptrain.run import RunState
from p2ptrain.task import Task, load_task, parameter_cut, stage_parameters
from p2ptrain.testing import LocalPeers, local_peers, slow_layers
from p2ptrain.training import read_manifest
from p2ptrain.wire import RoundPlan

from .test_pipelined_run import publish, small_text, whole_model  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("no_missed_plan")  # tests/conftest.py: no member missed a plan

DEADLINE_S = 300.0
WAIT_S = 200.0
# Seconds each forward and backward of these pieces take more (by their first module's name): blocks 1 and 2, stage 1
# of the cut by parameters, far over what this small model's stages take on loopback; the head a
# little, so that the last stage, not the first, is the one the cut keeps from the slow blocks.
SLOW_S = {"blocks.1": 0.05, "blocks.2": 0.05, "norm": 0.03}
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
RECUT = (0, 3, 4, 6)  # embedding, blocks 0 and 1 | block 2 alone | block 3 and the head: each slow layer in its own stage


@pytest.fixture(autouse=True)
def slow():
    with slow_layers(SLOW_S):
        yield


async def recut_plan(peers: LocalPeers, runs: list[RunState], task: Task, what: str,
                     ) -> tuple[RoundPlan, set[tuple[int, ...]]]:
    """The first plan that names a cut, and the stage times of its start step the members hold: the
    cut is RECUT, at a confirmed checkpoint (the plan's base is the record of its step), from those
    times, which every member that applied that step received alike."""

    def recut() -> RoundPlan | None:
        plan = runs[0].book.accepted if runs[0].book else None
        return plan if plan is not None and plan.cut is not None else None

    plan = await peers.wait_until(recut, WAIT_S, what=what)
    assert plan.cut == RECUT
    base = next(r.record for r in runs[0].book.chain.records if r.record.version == plan.version)
    assert plan.version > 0 and base.step == plan.step and base.model_cid == plan.base_cid
    times = {t for r in runs if r.book is not None and (t := r.book.stage_times.at(plan.step)) is not None}
    assert len(times) == 1 and measured_cut(task, BY_PARAMETERS, min(times)) == RECUT, times
    return plan, times


async def test_the_plans_cut_the_model_anew_by_measured_time(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(5, tmp_path) as peers:
            manifest, task_cid = await publish(peers, TASK, shards=2)
            task = load_task(TASK.format(manifest=manifest))
            assert parameter_cut(task) == BY_PARAMETERS
            runs = await peers.join_all(task_cid)

            plan, times = await recut_plan(peers, runs, task, "a plan that names a cut (on main, never)")
            assert min(times)[1] == max(min(times)), times  # stage 1, with the slow blocks, measured slowest
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


async def test_members_restarted_after_a_recut_resume_from_the_moved_cut(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(5, tmp_path) as peers:
            manifest, task_cid = await publish(peers, TASK, shards=2)
            runs = await peers.join_all(task_cid)

            plan, _ = await recut_plan(peers, runs, load_task(TASK.format(manifest=manifest)),
                                       "a plan that names a cut (on main, never)")
            await peers.wait_version(task_cid, plan.version + 1, WAIT_S, what="a model confirmed in the new cut")
            for i in range(5):
                await peers.stop_peer(i)
            for i in range(5):
                await peers.restart_peer(i, see_all=False)
            await peers.wait_connected()
            runs = await peers.join_all(task_cid)

            def resumed_from() -> list[int] | None:
                said = [peers.status(i, task_cid).get("resumed_from") for i in range(5)]
                return [r["version"] for r in said] if all(said) else None

            resumed = await peers.wait_until(resumed_from, WAIT_S, what="every member resumed from its home")
            store = peers[0].content.store
            head = runs[0].book.chain.records[-1].record
            assert head.version == min(resumed) > plan.version
            assert [(e.first, e.last) for e in read_manifest(store.cat(head.model_cid))] == [(0, 2), (3, 3), (4, 5)]
            # Each member loads its stage of its first plan's cut from that manifest, and the run goes on.
            await peers.wait_version(task_cid, max(resumed) + 2, WAIT_S, what="two models confirmed after the restart")
            statuses = [peers.status(i, task_cid) for i in range(5)]
            assert not any("stage_diverged" in s.get("rejected", {}) for s in statuses), statuses
            assert all(r.book is not None and not r.book.refused_spans for r in runs)
