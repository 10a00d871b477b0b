"""A member that resumes after another one already did still hears it (run/_resume.py).

Seen in tests/runtime/test_whole_run_restart.py's logs: a member that had heard every other member
of its last record said it held the run's state and, its run under way, answered no head request
any more; a member that resumed a moment later asked it in vain and waited the whole resume
timeout for it, since the two alone could not elect a coordinator (whose beat also ends the wait).
Real loopback peers in this process, stopped and started again on their homes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from p2ptrain.run import _resume
from p2ptrain.testing import local_peers, publish_digits_task

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 240.0
STEP_S = 90.0
# The production resume timeout (the quick timers shorten it to 5 s), and the bound on the late
# member's wait: well under it, with seconds to spare for a loaded machine.
RESUME_WAIT_S = 20.0
HEARD_WITHIN_S = 8.0


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
async def test_a_member_that_resumes_after_another_hears_it_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four members stop at model v1 and start again. The first to rejoin hears the three others'
    chains from their homes and resumes. The second then needs its answer too: the two of them are
    no quorum of four, so no coordinator's beat can end its wait. Before, it waited the whole
    RESUME_WAIT_S (20 s) for the first, which answered nothing once its run was under way; now the
    first answers until its election accepts a coordinator."""
    monkeypatch.setattr(_resume, "RESUME_WAIT_S", RESUME_WAIT_S)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=16, checkpoint_interval=4, min_peers=4,
                                                 max_peers=4)
            await peers.join_all(task_cid)

            await peers.wait_version(task_cid, 1, STEP_S, range(4), what="every member at model v1")
            for i in range(4):
                await peers.stop_peer(i)
            for i in range(4):
                await peers.restart_peer(i, see_all=False)
            await peers.wait_connected()

            def resumed(i: int) -> bool | None:
                """Peer ``i`` heard the others and says it holds the run's state."""
                status = peers.status(i, task_cid)
                return (status.get("state") == "training" and status.get("resumed_from") is not None) or None

            first = await peers[0].tasks.join(task_cid)
            await peers.wait_until(lambda: resumed(0), STEP_S, what="the first member resumed")
            assert first.shared.election.coordinator is None  # alone in its run: one of four votes

            second = await peers[1].tasks.join(task_cid)
            await peers.wait_until(lambda: resumed(1), HEARD_WITHIN_S, what="the second member resumed")
            assert peers[0].node.peer_id.to_base58() in second.resume.heads
            assert second.shared.election.coordinator is None  # its wait ended by the answer, not a beat

            async with trio.open_nursery() as nursery:
                for peer in peers[2:]:
                    nursery.start_soon(peer.tasks.join, task_cid)

            final = await peers.wait_done(task_cid, STEP_S, range(4), what="every member done")
            assert all(s["resumed_from"] is not None for s in final)
