"""Replicas placed by measured stage times in a run of full peers (``local_peers``), ``[pipeline]
balance = "measured"``: every replica of stage 1 answers its hops late (a slow machine, made so by
the test), the drivers' timed summary entries say so, and the coordinator's next plans move members
to stage 1 beyond what the stages' parameters give, one a plan; every member checks those plans
against the times it received itself (none refuses them), and the moved members load their new
stage by CID and the run confirms models after the move; ``task status --json`` shows each stage's
time.

Five peers, three stages of a 2-block transformer_lm (its embedding, one block, the other block
with the head). On main (costs were parameter counts) the plans never moved anyone: the test timed
out waiting for a plan with more replicas at stage 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import p2ptrain.run._stages as stages_module
from p2ptrain.net import Channel
from p2ptrain.pipeline import StageReplica
from p2ptrain.protocol import assign
from p2ptrain.task import load_task, stage_parameters
from p2ptrain.testing import local_peers
from p2ptrain.wire import RoundPlan
from p2ptrain.wire.activations import decode_frame, Kind

from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

DEADLINE_S = 300.0
WAIT_S = 200.0
SLOW_S = 0.25  # each stage-1 hop: far over what a hop of this small model takes on loopback
TASK = """\
name = "measured-balance"
seed = 3
[model]
name = "transformer_lm"
kwargs = {{ vocab_size = 256, context = 128, width = 16, depth = 2, heads = 2 }}
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
balance = "measured"
"""


class SlowStage1(StageReplica):
    """A member's replica that answers every FORWARD and BACKWARD of stage 1 ``SLOW_S`` late."""

    async def handle(self, channel: Channel, data: bytes) -> bool:
        frame = decode_frame(data)
        if frame.stage == 1 and frame.kind in (Kind.FORWARD, Kind.BACKWARD):
            await trio.sleep(SLOW_S)
        return await super().handle(channel, data)


@pytest.fixture(autouse=True)
def slow_stage_1(monkeypatch):
    monkeypatch.setattr(stages_module, "StageReplica", SlowStage1)


def _settled(members: tuple[str, ...], costs: list[int]) -> list[int]:
    """How many replicas each stage has once plans by parameters stop moving anyone."""
    previous: dict | None = None
    for _ in range(len(members)):
        previous = assign(members, costs, previous)
    return [sum(1 for s in previous.values() if s == stage) for stage in range(len(costs))]


async def test_the_plans_move_members_to_the_stage_measured_slowest(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(5, tmp_path) as peers:
            manifest, task_cid = await publish(peers, TASK, shards=2)
            runs = await peers.join_all(task_cid)
            parameters = stage_parameters(load_task(TASK.format(manifest=manifest)))
            by_parameters = _settled(tuple(f"m{i}" for i in range(5)), parameters)

            def moved() -> RoundPlan | None:
                plan = runs[0].book.accepted if runs[0].book else None
                if plan is None or plan.stages is None:
                    return None
                return plan if plan.stages.count(1) > by_parameters[1] else None

            plan = await peers.wait_until(moved, WAIT_S, what=f"a plan with more than {by_parameters[1]} replicas at "
                                                              f"stage 1 (by parameters: {by_parameters}; on main, never)")
            # The members that applied the plan's start step received the same times.
            times = {t for r in runs if r.book is not None and (t := r.book.stage_times.at(plan.step)) is not None}
            assert len(times) == 1 and min(times)[1] > 0, times
            # The moved members loaded their new stage by CID: the run confirms models after the move,
            # and no member found a plan breaking the rules (each checked the stages against its own times).
            await peers.wait_version(task_cid, plan.version + 2, WAIT_S, what="two models confirmed after the move")
            assert all(r.book is not None and not r.book.refused_spans for r in runs)

            def shown() -> list | None:
                stages = peers.status(0, task_cid).get("stages") or []
                return stages if stages and all("microseconds" in e for e in stages) else None

            # task status --json shows each stage's time: stage 1's hops are at least SLOW_S each, two a microbatch.
            stages = await peers.wait_until(shown, WAIT_S, what="task status showing each stage's time")
            assert stages[1]["microseconds"] >= 2 * SLOW_S * 1e6, stages
