"""A node that accepts tasks survives hostile task announcements (issue 13, found #2).

The victim is a real ``p2ptrain node start --accept-tasks`` process; the attacker is a real peer in
this process that serves the bad content over Bitswap and announces it, signed, on the tasks topic.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import trio
import trio.testing

from p2ptrain.ipfs import DAG_PB, cid_from_digest, cid_str, encode_file_leaf, encode_file_node, make_cid
from p2ptrain.node import Node, NodeConfig
from p2ptrain.control import ops as control_ops
from p2ptrain.services import make_peer
from p2ptrain.wire import TASKS_TOPIC, TaskAnnounce
from p2ptrain.testing import node_processes, run_forked

DEADLINE_S = 120.0  # joins fetch from the attacker; the node process itself is slow to start here
POLL_S = 5.0  # how long one round of announcements is given to show in the victim's task list


def _dag_pb(store, block: bytes):
    cid = cid_from_digest(hashlib.sha256(block).digest(), DAG_PB, 0)
    store.put(cid, block)
    return cid


def _bad_tasks(store) -> dict[str, str]:
    """name -> task CID of content that is not a task, each held by the attacker's store."""
    empty_node = _dag_pb(store, b"")  # the empty dag-pb node: a valid block, not a UnixFS file
    child = _dag_pb(store, encode_file_leaf(b""))
    for _ in range(3):  # the DAG bomb: 174 links to one child, three levels deep
        child = _dag_pb(store, encode_file_node([(bytes(child), 100)] * 174, [0] * 174))
    garbage = b"\xff\x00 not a task " * 100
    garbage_cid = make_cid(garbage)
    store.put(garbage_cid, garbage)
    return {
        "empty-dag-pb": cid_str(empty_node),
        "bomb": cid_str(child),
        "garbage-bytes": cid_str(garbage_cid),
        "not-a-cid": "QmThisIsNotACid!!",
    }


async def test_bad_task_announcements_are_counted_refusals_and_the_node_keeps_serving(tmp_path: Path) -> None:
    with node_processes(1, tmp_path / "victim", extra_args=["--accept-tasks"]) as (victim,):
        attacker = Node(tmp_path / "attacker", NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[victim.addr]))
        peer = make_peer(attacker)
        assert attacker.home.is_dir()
        bad = _bad_tasks(peer.content.store.blocks)

        def listing() -> dict:
            assert victim.proc.poll() is None, f"the node exited:\n{victim.read_log()}"
            return victim.client.call(control_ops.TASK_LIST)

        def all_refused(reply: dict) -> bool:
            tasks = {t["task_cid"]: t for t in reply["tasks"]}
            return all(tasks.get(cid, {}).get("refused") for cid in bad.values())

        async def announce_until(done) -> dict:
            """Announce every bad CID, again each round (the attacker's subscription view may lag),
            until the victim's task list shows ``done``."""
            while True:
                for name, cid in bad.items():
                    await attacker.publish(TASKS_TOPIC, TaskAnnounce(task_cid=cid, name=name))
                with trio.move_on_after(POLL_S):
                    while True:
                        reply = await trio.to_thread.run_sync(listing)
                        if done(reply):
                            return reply
                        await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            with trio.fail_after(DEADLINE_S):
                await nursery.start(attacker.run)
                await attacker.membership.wait_until(lambda m: len(m.alive()) >= 1)
                first = await announce_until(all_refused)
                # The same bad CIDs again: each is a counted refusal, not a new fetch and parse.
                again = await announce_until(
                    lambda r: r["joins"]["rejected"].get("recently_failed", 0) >= len(bad))
            attacker.stop()
            nursery.cancel_scope.cancel()

        assert sum(first["joins"]["rejected"].values()) >= len(bad)
        joins = again["joins"]
        assert sum(joins["rejected"].values()) >= len(bad)
        assert joins["remembered_failures"] == len(bad)
        tasks = {t["task_cid"]: t for t in again["tasks"]}
        assert "empty subtree" in tasks[bad["bomb"]]["refused"]
        # Still serving: the control socket answers and the process runs; the CLI shows the counters.
        status = victim.status()
        assert status["peer_id"] == victim.peer_id
        # node status carries the services' counters: joins refused, the collective's and Bitswap's inbound side.
        assert status["services"]["tasks"]["joins"]["remembered_failures"] == len(bad)
        assert "parked" in status["services"]["tasks"]["collective"]
        assert "inbound_bytes_held" in status["services"]["content"]["bitswap"]
        shown = await trio.to_thread.run_sync(lambda: run_forked(
            [sys.executable, "-m", "p2ptrain.cli.main", "task", "list", "--json", "--home", str(victim.home)],
            capture_output=True, timeout=60, check=True))
        assert json.loads(shown.stdout)["joins"]["rejected"]["recently_failed"] >= len(bad)
        assert victim.proc.poll() is None


async def test_a_flood_of_announced_tasks_starts_at_most_the_join_cap(tmp_path: Path) -> None:
    """Joins in flight are bounded: the content service of this node is not running, so every join
    waits on it, as joins stuck on a silent provider would; the rest are refused as "busy"."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from p2ptrain.services._tasks import MAX_CONCURRENT_JOINS, TaskService
    from p2ptrain.services import TaskOptions
    from p2ptrain.node import ContentService
    from p2ptrain.wire import decode, encode

    node = Node(tmp_path / "node")
    tasks = TaskService(node, ContentService(node), TaskOptions(accept_tasks=True))
    key = create_new_key_pair()
    flood = [cid_str(make_cid(f"task {i}".encode())) for i in range(MAX_CONCURRENT_JOINS + 6)]
    async with trio.open_nursery() as nursery:
        tasks._nursery = nursery
        for i, cid in enumerate(flood):
            signed = decode(encode(TaskAnnounce(task_cid=cid, name=f"t{i}"), key, seq=i + 1))
            await tasks._on_announce(signed, TASKS_TOPIC)
        await trio.testing.wait_all_tasks_blocked()
        assert len(tasks._joining) == MAX_CONCURRENT_JOINS
        assert tasks.join_rejections["busy"] == 6
        nursery.cancel_scope.cancel()


def test_a_join_that_found_no_bytes_is_tried_again_soon_and_a_refused_task_only_after_ten_minutes(
        tmp_path: Path) -> None:
    """A NATed peer that heard a task from another NATed peer before any member held its bytes failed
    its join and, remembered for 10 minutes, never took part: the run waited for it (seen in
    tests/wan/test_training_behind_nat.py). Wanting bytes is retried after 15 s, doubling; anything
    else (a task it cannot run, a bad announcement) stays refused for 10 minutes."""
    from p2ptrain.services._join_memory import FAILED_JOIN_MEMORY_S, UNAVAILABLE_JOIN_RETRY_S

    tasks = make_peer(Node(tmp_path / "home")).tasks
    cid, bad = "Qm" + "a" * 44, "Qm" + "b" * 44

    async def main() -> None:
        for wait in (UNAVAILABLE_JOIN_RETRY_S, 2 * UNAVAILABLE_JOIN_RETRY_S, 4 * UNAVAILABLE_JOIN_RETRY_S):
            tasks.join_memory.failed(cid, trio.current_time(), unavailable=True)
            await trio.sleep(wait - 0.5)
            assert not tasks._should_join(cid)
            await trio.sleep(0.5)
            assert tasks._should_join(cid)
        tasks.join_memory.failed(bad, trio.current_time(), unavailable=False)
        tasks.join_memory.failed(cid, trio.current_time(), unavailable=False)  # refused once the bytes came: the long memory
        await trio.sleep(FAILED_JOIN_MEMORY_S - 0.5)
        assert not tasks._should_join(bad) and not tasks._should_join(cid)
        await trio.sleep(0.5)
        assert tasks._should_join(bad) and tasks._should_join(cid)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
