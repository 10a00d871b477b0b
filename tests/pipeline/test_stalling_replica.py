"""A replica that stalls every step just under the driver's deadline (red team's H1), in a pipelined
run of full peers (``local_peers``): the drivers find it the slowest of its stage again and again,
accuse it, the step summary convicts it, ``task status`` names it and the next plan leaves it out.

Six peers, two stages of three replicas (stage 0's are the drivers). One stage-1 replica answers its
hops at once, so its hop deadline stays the floor (``HOP_TIMEOUT_S``, 5 s), and each HOLDINGS 4.5 s
later: never timed out, asked by every driver at every step's end. On main it slowed every step by
4.5 s for the whole run and was never left out (bench/stage_staller.py: x0.013 of the steps/s on
loopback); nothing here could fail on it, so this test timed out waiting for its conviction.

With exactly ``peers.min`` members nobody can take the convicted replica's place: the run waits it
out, says so (``waiting_for_peers``, the suspect's ``out_s``), and a replica convicted again is left
out twice as long (protocol.Convictions). On main the wait said nothing (``waiting_for_peers`` 0)
and each conviction was 10 s: the run took the staller back and failed a step every ~25 s for good.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import trio

import p2ptrain.run._stages as stages_module
from p2ptrain.net import Channel
from p2ptrain.pipeline import StageReplica
from p2ptrain.protocol._quarantine import FAILED_PEER_QUARANTINE_S
from p2ptrain.run import HOP_TIMEOUT_S
from p2ptrain.testing import local_peers
from p2ptrain.wire.activations import decode_frame, Kind

from .test_pipelined_integrity import TASK
from .conftest import planned_six
from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

DEADLINE_S = 300.0
STEP_S = 150.0
STALL_S = 0.9 * HOP_TIMEOUT_S  # under the floor of its HOLDINGS deadline: never timed out
# The stallers (base58), from the moment the test picks them; and the HOLDINGS each stalled.
STALLERS: set[str] = set()
STALLED: dict[str, int] = {}


class MaybeStalling(StageReplica):
    """A member's replica, honest until the test names its peer in STALLERS; then each HOLDINGS
    waits STALL_S before it is answered (its hops are answered at once)."""

    async def handle(self, channel: Channel, data: bytes) -> bool:
        me = str(self.host.get_id())
        if me in STALLERS and decode_frame(data).kind == Kind.HOLDINGS:
            STALLED[me] = STALLED.get(me, 0) + 1
            await trio.sleep(STALL_S)
        return await super().handle(channel, data)


@pytest.fixture(autouse=True)
def setting(monkeypatch):
    monkeypatch.setattr(stages_module, "StageReplica", MaybeStalling)
    STALLERS.clear()
    STALLED.clear()
    yield
    STALLERS.clear()
    STALLED.clear()


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
async def test_a_replica_stalling_every_step_under_the_deadline_is_convicted_and_left_out(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(6, tmp_path) as peers:
            _, task_cid = await publish(peers, TASK, shards=3)
            run = (await peers.join_all(task_cid))[0]

            planned = await peers.wait_until(lambda: planned_six(run), STEP_S, what="a plan of six, three replicas of stage 1")
            staller = planned[1][0]
            STALLERS.add(staller)
            honest = [i for i, p in enumerate(peers) if p.node.peer_id.to_base58() != staller]

            def named() -> list[dict[str, Any]] | None:
                now = [peers.status(i, task_cid) for i in honest]
                return now if all(any(e["peer"] == staller for e in s.get("stage_suspects") or ()) for s in now) else None

            statuses = await peers.wait_until(named, STEP_S, what="every honest member naming the staller "
                                                                  "(on main: never, it stalled every step)")
            for s in statuses:
                assert [(e["peer"], e["stage"]) for e in s["stage_suspects"]] == [(staller, 1)]  # it, and only it
            # Judged on its stalls: a few steps' HOLDINGS, not the whole run's.
            assert STALLED[staller] <= 3 * 3 * 2, STALLED  # 3 drivers, 3 slow steps, a retry each at most

            watcher = peers[honest[0]].tasks.runs[task_cid].shared

            def plan_without_staller() -> tuple[str, ...] | None:
                plan = watcher.book.last_plan if watcher.book else None
                return plan.members if plan is not None and staller not in plan.members else None

            members = await peers.wait_until(plan_without_staller, STEP_S, what="a plan without the staller")
            assert staller not in members and len(members) == 5


@pytest.mark.timeout(300)  # the suite's bound, declared (as above)
async def test_a_run_of_exactly_peers_min_waits_out_a_convicted_staller_longer_each_time(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(6, tmp_path) as peers:
            # peers.max = the six members: the first plan does not wait for joiners (docs/testing.md).
            _, task_cid = await publish(peers, TASK.replace("min = 4\nmax = 6", "min = 6\nmax = 6"), shards=3)
            run = (await peers.join_all(task_cid))[0]

            planned = await peers.wait_until(lambda: planned_six(run), STEP_S, what="a plan of six, three replicas of stage 1")
            staller = planned[1][0]
            STALLERS.add(staller)
            honest = [i for i, p in enumerate(peers) if p.node.peer_id.to_base58() != staller]

            def waiting_out(times: int) -> Callable[[], list[dict[str, Any]] | None]:
                def now() -> list[dict[str, Any]] | None:
                    statuses = [peers.status(i, task_cid) for i in honest]
                    return statuses if all(s["waiting_for_peers"] == 1 and [(e["peer"], e["times"], e.get("out_s", 0) > 0)
                                           for e in s["stage_suspects"]] == [(staller, times, True)]
                                           for s in statuses) else None
                return now

            await peers.wait_until(waiting_out(1), STEP_S, what="every honest member waiting the convicted staller out "
                                                                 "(on main: waiting for no peer, no out_s)")
            second = await peers.wait_until(waiting_out(2), STEP_S, what="the staller convicted again after its return, "
                                                                          "every honest member waiting it out")
            # Out twice as long the second time: 20 s in all, which every honest member's status says
            # (the seconds left, out_s, shrink as the test reads them: under a suite's load the
            # statuses all showed the second conviction more than 10 s after it once, at out_s <= 10).
            assert all(s["stage_suspects"][0]["out_for_s"] == 2 * FAILED_PEER_QUARANTINE_S
                       and 0 < s["stage_suspects"][0]["out_s"] <= 2 * FAILED_PEER_QUARANTINE_S for s in second), second
