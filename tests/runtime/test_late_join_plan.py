"""A member that starts advertising a task just after its election, and gets the first plan before
the coordinator's next heartbeat, follows that plan (protocol/_held_plans.py), on real peers.

Before, it could not follow it (a plan "not from the coordinator" of its term: it had heard no
certificate yet), reported CANNOT_FOLLOW, round 0 failed and the retry left it out for about a
minute (participation strikes). Here the heartbeat (2 s) is longer than the first plan's grace
(0.5 s, quick timers), so a joiner that advertises after the election hears the plan first.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from p2ptrain.protocol import CANNOT_FOLLOW
from p2ptrain.testing import local_peers, publish_digits_task

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the first plan's grace 0.5 s

HEARTBEAT_S = 2.0  # longer than the first plan's grace: the race of the report
DEADLINE_S = 120.0


async def test_a_member_that_advertises_after_the_election_follows_the_first_plan(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2ptrain.run._task_run")
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path, heartbeat_interval=HEARTBEAT_S) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=40, checkpoint_interval=4, min_peers=3,
                                                 max_peers=3)
            async with trio.open_nursery() as nursery:
                for peer in peers[:2]:
                    nursery.start_soon(peer.tasks.join, task_cid)
            first = [peers[i].tasks.runs[task_cid].shared for i in range(2)]
            await peers.wait_until(lambda: all(r.election.coordinator for r in first), 60,
                                   what="a coordinator elected by the first two")
            await peers[2].tasks.join(task_cid)  # advertises after the election, before a beat reaches it
            joiner = peers[2].node.peer_id.to_base58()
            statuses = await peers.wait_version(task_cid, 1, 60)
            first_record = statuses[0]["chain"][0]
    cannot = [r.getMessage() for r in caplog.records if CANNOT_FOLLOW in r.getMessage()]
    assert not cannot, cannot
    assert joiner in peers[0].tasks.runs[task_cid].shared.book.chain.records[0].record.members, first_record
