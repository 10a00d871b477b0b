"""Every member loses every other at once, then hears them again: the run elects a coordinator and
goes on (the stall of a 50.7M pipelined run over the emulated WAN, docs/benchmarks.md, began so:
heartbeats late on busy event loops, every member gave every other up for 5 s).

Real loopback peers in this process. Their mesh heartbeats are held back (each node's membership
publishes none; the election's own messages still travel) until every member's view is empty and
no member follows a coordinator, then let through again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.testing import local_peers, publish_digits_task
from p2ptrain.wire import Heartbeat

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 240.0
STEP_S = 90.0
# The mesh gives a silent peer up after 5 heartbeats (1 s each); a coordinator steps down when it
# sees no quorum, a member gives its coordinator up 3 heartbeats after its last beat.
SILENT_S = 20.0
# From the heartbeats' return to a coordinator accepted by all and two more confirmed checkpoints:
# a first term (3 s), and a failed one or two on a loaded machine, then rounds of milliseconds.
BACK_S = 45.0


async def test_members_that_all_lose_each_other_at_once_elect_again_and_train_on(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=100_000, checkpoint_interval=4, min_peers=3,
                                                 max_peers=3)
            runs = await peers.join_all(task_cid)

            def at(version: int) -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in range(3)]
                return statuses if all(s.get("version", 0) >= version for s in statuses) else None

            await peers.wait_until(lambda: at(1), STEP_S, what="every member at model v1")
            term = max(run.election.term for run in runs)

            silent = True
            for peer in peers:
                publish = peer.node.membership.publish

                async def held(topic: str, msg: Any, publish: Any = publish) -> Any:
                    if silent and isinstance(msg, Heartbeat):
                        return None
                    return await publish(topic, msg)

                peer.node.membership.publish = held

            def all_alone() -> bool | None:
                return all(not peer.node.membership.alive() and run.election.coordinator is None
                           for peer, run in zip(peers, runs)) or None

            await peers.wait_until(all_alone, SILENT_S, what="every member alone, no coordinator followed")
            version = max(run.book.chain.version for run in runs if run.book is not None)
            silent = False
            for peer in peers:
                peer.node.membership.poke()

            def going_on() -> list[dict[str, Any]] | None:
                coordinators = {(run.election.term, run.election.coordinator) for run in runs}
                if len(coordinators) != 1 or None in {c for _, c in coordinators}:
                    return None
                return at(version + 2)

            statuses = await peers.wait_until(going_on, BACK_S, what="one coordinator again, two checkpoints on")
            assert all(run.election.term > term for run in runs)
            assert all(s["state"] == "training" for s in statuses)
