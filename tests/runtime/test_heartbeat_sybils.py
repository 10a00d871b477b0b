"""Issue 27's heartbeat-only Sybils, on real peers: identities that advertise a task in their
heartbeats but never vote and never take part in a round. Before, a new task with as many of them
as honest members made no step (the election counted them as voters and never reached a quorum;
terms churned), and a running task froze at its next checkpoint (they were admitted as joiners, the
span's round failed on them, and no retry could keep a quorum of that plan's members).

Now a member counts an identity that advertises the task only while it takes part (votes, asks for
votes, reports a round, completes a round, attests) or is new (one span of grace): the Sybils fall
out of the election's voters and the plans, and the run goes on.

Loopback peers in this process; a Sybil is a real node whose heartbeats name the task and nothing
else (``membership.tasks``), exactly what the issue's tester ran.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio

from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

RUN_S = 200.0  # generous: the suite shares two cores with other work
FOREIGN = "torch 9.9.9 on the CPU with scalar kernels"  # an arithmetic no member computes with


async def _sybils(peers: LocalPeers, task_cid: str, k: int, arithmetic: str | None = None) -> list[str]:
    """Start ``k`` peers whose heartbeats advertise ``task_cid`` (and ``arithmetic``, when given,
    as the arithmetic they compute with); they never join it."""
    ids = []
    for _ in range(k):
        sybil = await peers.add_peer()
        membership = sybil.node.membership
        if arithmetic is not None:
            caps = await membership.caps_known()  # after the torch probe, which would overwrite it
            membership.caps = replace(caps, arithmetic=arithmetic)
        membership.tasks = (task_cid,)
        ids.append(sybil.node.peer_id.to_base58())
    return ids


def _version(peers: LocalPeers, task_cid: str, honest: range) -> int:
    return min(peers.status(i, task_cid).get("version", 0) for i in honest)


async def test_heartbeat_only_sybils_neither_stop_a_new_task_nor_freeze_a_running_one(tmp_path: Path) -> None:
    honest = range(2)
    with trio.fail_after(RUN_S):
        # Heartbeats every 0.5 s: the Sybils' churn before they fall out of the voters is election
        # terms (3 heartbeats each), and the run's rounds do not depend on the interval.
        async with local_peers(2, tmp_path, heartbeat_interval=0.5) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=400, checkpoint_interval=4, min_peers=2)
            # As many Sybils as honest members, there before the run starts: a quorum of the four
            # identities the members saw advertising it (3) was out of reach of two honest voters.
            first = await _sybils(peers, task_cid, 2)
            for i in honest:
                await peers[i].tasks.join(task_cid)
            await peers.wait_until(lambda: _version(peers, task_cid, honest) >= 1, 90,
                                   what="a new task's first checkpoint confirmed beside heartbeat-only Sybils")
            # Two fresh Sybils mid-run: admitted at the next checkpoint (they are new), the span's round
            # fails on them; the retry must still be a plan the members follow, and the run go on.
            version = _version(peers, task_cid, honest)
            second = await _sybils(peers, task_cid, 2)
            await peers.wait_until(lambda: _version(peers, task_cid, honest) >= version + 2, 90,
                                   what="two more checkpoints confirmed after fresh Sybils came")
            for i in honest:
                shared = peers[i].tasks.runs[task_cid].shared
                record = shared.book.chain.records[-1].record
                assert not set(record.members) & set(first + second)


async def test_sybils_advertising_another_arithmetic_do_not_take_a_new_tasks_class(tmp_path: Path) -> None:
    """More heartbeat-only identities than members, advertising an arithmetic no member has: a fresh
    run's class is that of most of the peers that took part, not of most advertisers. Before, the
    three took the run's class, both members were left out for their arithmetic, neither might
    stand, no vote was asked (which is what strikes a silent identity), and no step was made in 90 s."""
    honest = range(2)
    with trio.fail_after(RUN_S):
        async with local_peers(2, tmp_path, heartbeat_interval=0.5) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=400, checkpoint_interval=4, min_peers=2)
            sybils = await _sybils(peers, task_cid, 3, arithmetic=FOREIGN)

            def heard(j: int) -> bool:
                record = peers[0].node.membership.get(peers[j].node.peer_id)
                return record is not None and record.caps.arithmetic == FOREIGN

            await peers.wait_until(lambda: all(heard(j) for j in range(2, 5)) or None, 30,
                                   what="the Sybils' arithmetic heard")
            for i in honest:
                await peers[i].tasks.join(task_cid)
            await peers.wait_until(lambda: _version(peers, task_cid, honest) >= 1, 90,
                                   what="a new task's first checkpoint confirmed beside Sybils of another arithmetic")
            for i in honest:
                status = peers.status(i, task_cid)
                assert status["arithmetic_run"] != FOREIGN
                assert not {entry["peer"] for entry in status["arithmetic_left_out"]} & {
                    peers[j].node.peer_id.to_base58() for j in honest}
                record = peers[i].tasks.runs[task_cid].shared.book.chain.records[-1].record
                assert not set(record.members) & set(sybils)
