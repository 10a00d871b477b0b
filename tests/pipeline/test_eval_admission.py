"""Who may ask a replica for an EVAL in a pipelined run of full peers (``local_peers``): the plan's
coordinator, which evaluates its span's checkpoint, and nobody else.

Every member of a plan was admitted for EVAL, at any step, because any member might be the
coordinator. A member that is not flooded one replica with EVALs from any step and slowed every step
of the run, unattributed: one driver's steps went from 0.05-0.13 s to 0.24-0.72 s (EVALs of 2,048
samples) and to 0.8-2.0 s (8,192), and nobody was judged a straggler, since the replica it loads is
not the one to blame (bench/eval_flood.py, docs/security.md). Now a replica answers EVALs only from
the coordinator that signed its plan; another member's EVAL is refused before it is read
(``outsider``). On main this test's EVAL was admitted (answered, or refused for its step), never
refused as an outsider's. Four peers: two drivers, two replicas of stage 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from p2ptrain.net import ChannelError, open_channel
from p2ptrain.testing import local_peers
from p2ptrain.wire.activations import encode_frame, Frame, Kind

from .test_pipelined_integrity import TASK as INTEGRITY_TASK
from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

TASK = INTEGRITY_TASK.replace("check_fraction = 1.0", "check_fraction = 0.0").replace("max = 6", "max = 4")  # its four
# peers, all from the run's start: term 0 and the first plan need not wait for more (docs/testing.md)
assert TASK != INTEGRITY_TASK and "max = 4" in TASK
DEADLINE_S = 240.0
STEP_S = 120.0


async def test_only_the_plans_coordinator_may_ask_a_replica_for_an_eval(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            _, task_cid = await publish(peers, TASK, shards=2)
            run = (await peers.join_all(task_cid))[0]
            index = {p.node.peer_id.to_base58(): i for i, p in enumerate(peers)}

            def asker_and_replica() -> tuple[str, str] | None:
                plan = run.book.last_plan if run.book else None
                coordinator = run.election.coordinator
                if plan is None or plan.stages is None or len(plan.members) < 4 or not run.rounds_done \
                        or coordinator is None:
                    return None
                last = [m for m, s in zip(plan.members, plan.stages, strict=True) if s == 1]
                askers = [m for m in last if m != coordinator]
                if len(last) < 2 or not askers:
                    return None
                return askers[0], next(m for m in last if m != askers[0])

            asker, target = await peers.wait_until(asker_and_replica, STEP_S, what="a plan of four, two replicas of stage 1")
            stages = peers[index[target]].tasks.runs[task_cid].spans.stages
            replica = stages._replica
            assert replica is not None
            before = replica.refused["outsider"]
            host = peers[index[asker]].tasks.runs[task_cid].shared.collective.host
            x = torch.randn(1, 128, 16)
            targets = torch.zeros(1, 128, dtype=torch.int64)
            request = encode_frame(Frame(Kind.EVAL, replica.weights_step, 0, 1, 0.0, (x, targets)))
            answered = True
            try:
                async with await open_channel(host, replica.host.get_id(), stages.protocol) as channel:
                    await channel.send(request)
                    await channel.recv(1 << 24)
            except ChannelError:
                answered = False
            assert not answered and replica.refused["outsider"] == before + 1, (answered, dict(replica.refused))

            # The coordinator still evaluates: a confirmed record carries the test split's metrics.
            def evaluated() -> dict | None:
                records = run.book.chain.records if run.book else ()
                return records[-1].record.metrics if records and "accuracy" in records[-1].record.metrics else None

            metrics = await peers.wait_until(evaluated, STEP_S, what="a record with the coordinator's evaluation")
            assert 0.0 <= metrics["accuracy"] <= 1.0
