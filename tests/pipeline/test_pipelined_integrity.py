"""A replica sending altered activations in a pipelined run of full peers (``local_peers``): the
drivers' third opinions name it, the step summary convicts it on every member, `task status` shows it
and the coordinator's next plan leaves it out.

Six peers: the task's two stages get three replicas each (stage 0's are the drivers), so a
disagreement at stage 1 has a third opinion. Nothing is replaced but one replica's answers (a small
error added to what it answers, the gradient of its input as the last stage, from the moment the test
picks it). Before this change the drivers only
counted the disagreeing pair; nobody was named or left out.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

import p2ptrain.run._stages as stages_module
from p2ptrain.pipeline import StageReplica
from p2ptrain.testing import local_peers
from p2ptrain.wire.activations import Kind

from .conftest import planned_six
from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

DEADLINE_S = 300.0
STEP_S = 150.0
TASK = """\
name = "pipelined-integrity"
seed = 5
[model]
name = "transformer_lm"
kwargs = {{ vocab_size = 256, context = 128, width = 16, depth = 2, heads = 2 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "sgd"
lr = 0.5
[training]
batch_size = 2
total_steps = 200
checkpoint_interval = 4
[peers]
min = 4
max = 6
[pipeline]
stages = 2
microbatch_size = 2
activations = "fp32"
check_fraction = 1.0
"""
# The replicas (base58) whose outputs are altered from now on.
LIARS: set[str] = set()


class MaybeAltering(StageReplica):
    """A member's replica, honest until the test names its peer in LIARS."""

    def _compute(self, request, sender):
        answer, grads = super()._compute(request, sender)
        if answer.kind in (Kind.OUTPUT, Kind.GRAD) and str(self.host.get_id()) in LIARS:
            answer = replace(answer, tensors=(answer.tensors[0] + 1e-3,))
        return answer, grads


@pytest.fixture(autouse=True)
def setting(monkeypatch):
    monkeypatch.setattr(stages_module, "StageReplica", MaybeAltering)
    LIARS.clear()
    yield
    LIARS.clear()


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
async def test_a_replica_altering_its_outputs_is_convicted_named_and_left_out(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(6, tmp_path) as peers:
            _, task_cid = await publish(peers, TASK, shards=3)
            run = (await peers.join_all(task_cid))[0]

            planned = await peers.wait_until(lambda: planned_six(run), STEP_S, what="a plan of six, three replicas of stage 1")
            liar = planned[1][0]
            LIARS.add(liar)
            honest = [i for i, p in enumerate(peers) if p.node.peer_id.to_base58() != liar]

            def named() -> list[dict[str, Any]] | None:
                now = [peers.status(i, task_cid) for i in honest]
                return now if all(any(e["peer"] == liar for e in s.get("stage_suspects") or ()) for s in now) else None

            statuses = await peers.wait_until(named, STEP_S, what="every honest member naming the liar")
            for s in statuses:
                assert [(e["peer"], e["stage"]) for e in s["stage_suspects"]] == [(liar, 1)]  # it, and only it

            # An honest member's book (the liar follows no plan without itself).
            watcher = peers[honest[0]].tasks.runs[task_cid].shared

            def plan_without_liar() -> tuple[str, ...] | None:
                plan = watcher.book.last_plan if watcher.book else None
                return plan.members if plan is not None and liar not in plan.members else None

            members = await peers.wait_until(plan_without_liar, STEP_S, what="a plan without the liar")
            assert liar not in members and len(members) == 5
