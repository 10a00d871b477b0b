"""False failure reports against a data-parallel run of real peers (red team h-attack5;
protocol/_failure_reports.py): three members of a digits run in this process on 127.0.0.1, and a
fourth peer that never joins the task.

A ``RoundFailed`` makes the coordinator redo its plan from the round reported failed. Before, any
peer's report of the running plan counted, and a report of a round the span had gone past left a
retry that could never be planned: one report from the stranger, of the first span's first round,
and the three members stayed at step 4 of 12 (the first checkpoint confirmed, no plan after it) for
as long as the test waited; a member that reported each round it had completed did the same, never
left out. Now the stranger's report is refused and counted, the member's false ones are dropped and
counted and it is left out of plans for the quarantine, and the run ends."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.run import RunState
from p2ptrain.run._spans import Spans
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.wire import RoundFailed, task_topic

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 200.0
RUN_S = 120.0  # three spans of four steps on a loaded 2-core box (on main: never)
TOTAL_STEPS = 12


async def _three_members(peers: LocalPeers) -> tuple[str, list[RunState]]:
    # peers.max 3: the three are all its members (the stranger never joins), so term 0 and the first plan
    # need not wait for more (docs/testing.md, "Quick timers")
    task_cid = await publish_digits_task(peers[0], total_steps=TOTAL_STEPS, checkpoint_interval=4, min_peers=2,
                                         max_peers=3)
    for peer in list(peers)[:3]:
        await peer.tasks.join(task_cid)
    return task_cid, [peer.tasks.runs[task_cid].shared for peer in list(peers)[:3]]


async def _done(peers: LocalPeers, task_cid: str) -> list[dict[str, Any]]:
    return await peers.wait_until(
        lambda: (s := [peers.status(i, task_cid) for i in range(3)]) and all(x.get("state") == "done" for x in s) and s,
        RUN_S, what="the run's three members done")


async def test_a_strangers_failure_report_is_refused_and_the_run_ends(tmp_path: Path) -> None:
    """Fails on main: the members stay at step 4, the first span's retry never planned."""
    with trio.fail_after(DEADLINE_S):
        async with local_peers(4, tmp_path) as peers:
            task_cid, runs = await _three_members(peers)
            plan = await peers.wait_until(lambda: runs[0].book and runs[0].book.last_plan, RUN_S, what="a plan")
            stranger = peers[3]
            assert stranger.node.peer_id.to_base58() not in plan.members
            await stranger.node.publish(task_topic(task_cid), RoundFailed(
                task_cid=task_cid, term=plan.term, round=plan.round, attempt=plan.attempt, step=plan.step,
                reason="peer X failed: (a stranger says)"))
            statuses = await _done(peers, task_cid)
    assert all(s["step"] == TOTAL_STEPS for s in statuses), statuses
    assert sum(s["rejected"].get("failure_report", 0) for s in statuses) >= 1, [s["rejected"] for s in statuses]


async def test_a_member_reporting_the_rounds_it_completed_is_left_out_and_the_run_ends(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on main: its first report of the first span's round 0 left the coordinator a retry from
    step 0 that it could never plan once the span was done (members at step 4, for good).

    Then (2 of 3 runs under load, h-falsereport): its report of each span's last round made the
    coordinator redo that round after publishing the span's record, which a quorum confirmed anyway:
    the honest members went on from another state, each was told its arithmetic differed from the
    quorum's (``own_state_differs``), and the last span's retry left them at step 11 of 12, "done"."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.run")
    liar: list[str] = []
    lies: list[int] = []
    run_round = Spans._run_round

    async def lying(self: Spans, plan: Any, index: int, batches: Any, average: Any) -> bool:
        ok = await run_round(self, plan, index, batches, average)
        if ok and liar and self.run.me == liar[0]:
            lies.append(plan.round + index)
            await self.run.report_failure(plan, index, "peer X failed: (it did not)")
        return ok

    monkeypatch.setattr(Spans, "_run_round", lying)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid, runs = await _three_members(peers)
            coordinator = await peers.wait_until(lambda: runs[0].election.coordinator, RUN_S, what="a coordinator")
            liar.append(next(r.me for r in runs if r.me != coordinator))
            statuses = await _done(peers, task_cid)
            models = {hashlib.sha256(r.require()[0].model_bytes()).hexdigest() for r in runs}
    assert lies and all(s["step"] == TOTAL_STEPS for s in statuses), (lies, statuses)
    # One model: the members' weights, and the run's last confirmed checkpoint at each of them.
    assert len(models) == 1 and len({s["latest_model_cid"] for s in statuses}) == 1, (models, statuses)
    assert all("own_state_differs" not in s["rejected"] for s in statuses), [s["rejected"] for s in statuses]
    honest = [s for r, s in zip(runs, statuses) if r.me != liar[0]]
    assert sum(s["rejected"].get("failure_report", 0) for s in honest) >= 1, [s["rejected"] for s in statuses]
    assert any("completed here with every member of it" in r.getMessage() for r in caplog.records)
