"""Each loop of a task's run, in this process, on real loopback peers (``p2ptrain.testing.local_peers``).

One test per loop, so a broken election, plan, round, attestation or resync fails here in seconds
and by name, not minutes later in the multi-process run of test_training_run.py. The run is seen
only through what outlives any reshaping of the runtime: ``TaskService.join`` and the status a run
reports (``p2ptrain task status --json``), the chain a member keeps on disk
(``<home>/tasks/<task CID>/chain.jsonl``) and the bytes in each member's store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.training.records import Chain, record_from_bytes

# Each test, whole: peers start, torch warms up, the members train a tiny MLP to a checkpoint or
# two. Well under a minute alone; this bound leaves room for a loaded 2-core box.
DEADLINE_S = 120.0
# One condition of a test (an election, a checkpoint, a resync): the run's own deadlines are a few
# seconds (heartbeat timeouts 3 s, start timeout 15 s, attestation timeout 20 s).
STEP_S = 60.0
# Long enough that no test reaches the end of the run; checkpoints every 3 steps (the plan's span).
TOTAL_STEPS = 100_000
CHECKPOINT_INTERVAL = 3


async def _join_all(peers: Any, task_cid: str) -> None:
    """Every given peer joins at once (so all start from step 0, as on a fresh run)."""
    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(peer.tasks.join, task_cid)


def _statuses(peers: LocalPeers, task_cid: str, indexes: list[int] | None = None) -> list[dict[str, Any]]:
    return [peers.status(i, task_cid) for i in (indexes if indexes is not None else range(len(peers)))]


def _ids(peers: LocalPeers, indexes: list[int] | None = None) -> set[str]:
    return {peers[i].node.peer_id.to_base58() for i in (indexes if indexes is not None else range(len(peers)))}


def _failed(statuses: list[dict[str, Any]]) -> None:
    for s in statuses:
        assert s.get("state") != "failed", s.get("error")


async def _start_run(peers: LocalPeers) -> str:
    task_cid = await publish_digits_task(peers[0], total_steps=TOTAL_STEPS, checkpoint_interval=CHECKPOINT_INTERVAL)
    await _join_all(peers, task_cid)
    return task_cid


async def _all_at_version(peers: LocalPeers, task_cid: str, version: int, indexes: list[int] | None = None) -> list[dict[str, Any]]:
    """Wait until every listed member has confirmed ``version``; their statuses then."""

    def reached() -> list[dict[str, Any]] | None:
        statuses = _statuses(peers, task_cid, indexes)
        _failed(statuses)
        return statuses if all(s.get("version", 0) >= version for s in statuses) else None

    return await peers.wait_until(reached, STEP_S, what=f"every member at model v{version}")


def _chain_on_disk(peer: Any, task_cid: str) -> Chain:
    """The member's chain.jsonl, re-verified record by record (signatures, versions, parents)."""
    data = (peer.node.home / "tasks" / task_cid / "chain.jsonl").read_bytes()
    first = record_from_bytes(data.splitlines()[0]).record
    return Chain.from_bytes(task_cid, first.parent, data)


# -- the control loop: election and plans ---------------------------------------------------------------


async def test_members_agree_on_one_coordinator_and_every_member_follows_its_plans(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await _start_run(peers)
            everyone = _ids(peers)

            def agreed() -> list[dict[str, Any]] | None:
                statuses = _statuses(peers, task_cid)
                _failed(statuses)
                leaders = {(s["coordinator"], s["term"]) for s in statuses}
                planned = all(s["round"] is not None and set(s["members"]) == everyone for s in statuses)
                return statuses if len(leaders) == 1 and None not in leaders.pop() and planned else None

            first = await peers.wait_until(agreed, STEP_S, what="one coordinator and a plan of all three")
            assert first[0]["coordinator"] in everyone
            rounds = [s["round"] for s in first]

            def advanced() -> bool:
                statuses = _statuses(peers, task_cid)
                _failed(statuses)
                return all(s["round"] > r for s, r in zip(statuses, rounds))

            await peers.wait_until(advanced, STEP_S, what="a later plan on every member")
            term = first[0]["term"]
            assert {(s["coordinator"], s["term"]) for s in _statuses(peers, task_cid)} == {(first[0]["coordinator"], term)}
