"""Each loop of a task's run, in this process, on real loopback peers (``p2ptrain.testing.local_peers``).

One test per loop, so a broken election, plan, round, attestation or resync fails here in seconds
and by name, not minutes later in the multi-process run of test_training_run.py. The run is seen
only through what outlives any reshaping of the runtime: ``TaskService.join`` and the status a run
reports (``p2ptrain task status --json``), the chain a member keeps on disk
(``<home>/tasks/<task CID>/chain.jsonl``) and the bytes in each member's store.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.data import Manifest
from p2ptrain.base import UserError, short_id
from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.protocol import Chain, read_chain
from p2ptrain.task import TaskError, task_from_bytes

pytestmark = pytest.mark.usefixtures("quick_timers", "no_missed_plan")  # tests/conftest.py: the protocol's idle waits shortened

# Each test, whole: peers start, torch warms up, the members train a tiny MLP to a checkpoint or
# two. Well under a minute alone; this bound leaves room for a loaded 2-core box.
DEADLINE_S = 120.0
# One condition of a test (an election, a checkpoint, a resync): the run's own deadlines are a few
# seconds (heartbeat timeouts 3 s, start timeout 15 s, attestation timeout 20 s).
STEP_S = 60.0
# Long enough that no test reaches the end of the run; checkpoints every 3 steps (the plan's span).
TOTAL_STEPS = 100_000
CHECKPOINT_INTERVAL = 3


def _statuses(peers: LocalPeers, task_cid: str, indexes: list[int] | None = None) -> list[dict[str, Any]]:
    return [peers.status(i, task_cid) for i in (indexes if indexes is not None else range(len(peers)))]


def _ids(peers: LocalPeers, indexes: list[int] | None = None) -> set[str]:
    return {peers[i].node.peer_id.to_base58() for i in (indexes if indexes is not None else range(len(peers)))}


def _failed(statuses: list[dict[str, Any]]) -> None:
    for s in statuses:
        assert s.get("state") != "failed", s.get("error")


async def _start_run(peers: LocalPeers, *, max_peers: int | None = None) -> str:
    """Publish the run and join every peer. ``peers.max`` is the peers' count unless a test adds one
    later: then no one else can be admitted, so the first plan does not wait its grace for joiners."""
    task_cid = await publish_digits_task(peers[0], total_steps=TOTAL_STEPS, checkpoint_interval=CHECKPOINT_INTERVAL,
                                         max_peers=max_peers or len(peers))
    await peers.join_all(task_cid)
    return task_cid


async def _all_at_version(
    peers: LocalPeers, task_cid: str, version: int, indexes: list[int] | None = None
) -> list[dict[str, Any]]:
    """Wait until every listed member has confirmed ``version``; their statuses then."""
    return await peers.wait_version(task_cid, version, STEP_S, indexes, what=f"every member at model v{version}")


def _chain_on_disk(peer: Any, task_cid: str) -> Chain:
    """The member's chain.jsonl, re-verified record by record (signatures, versions, parents)."""
    data = (peer.node.home / "tasks" / task_cid / "chain.jsonl").read_bytes()
    return read_chain(task_cid, data)


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


# -- data replication: every member ends up holding every shard --------------------------------------


async def test_every_member_comes_to_hold_every_shard_not_only_its_own(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as peers:
            task_cid = await _start_run(peers)
            store = peers[0].content.store
            task = task_from_bytes(store.cat(task_cid))
            manifest = Manifest.load(store, task.dataset.manifest)
            train = manifest.shards(task.dataset.train_split)
            shards = [ref.cid for ref in (*train, *manifest.shards(task.dataset.test_split))]
            assert len(train) == 4  # two members: each trains on two of them, and must fetch the rest
            member = peers[1].content.store

            def replicated() -> bool:
                _failed(_statuses(peers, task_cid))
                return all(member.has(cid) for cid in shards)

            await peers.wait_until(replicated, STEP_S, what="every shard held by the member that did not publish")


# -- the round loop: identical steps; attesting: a quorum confirms what each member computed ------------


async def test_after_the_first_checkpoint_every_member_holds_the_same_chain_and_the_model_it_computed(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await _start_run(peers)
            await _all_at_version(peers, task_cid, 1)
            chains = [_chain_on_disk(peer, task_cid) for peer in peers]
            firsts = [chain.records[0].record for chain in chains]
            assert len({(r.model_cid, r.optimizer_cid, r.step, r.round) for r in firsts}) == 1, firsts
            assert firsts[0].step == CHECKPOINT_INTERVAL and firsts[0].version == 1
            assert set(firsts[0].members) == _ids(peers)
            # Same head at the same version, on every member.
            assert all(s["latest_model_cid"] == chains[i].head_cid
                       for i, s in enumerate(_statuses(peers, task_cid)) if s["version"] == chains[i].version)
            for s in _statuses(peers, task_cid):
                assert s["chain"][0]["model_cid"] == firsts[0].model_cid
            # Attesting: confirmed means a quorum attested that their own weights hash to the
            # record's CID: each member's store holds those bytes, stored by itself at the
            # checkpoint (no member fetches a model while in step), from the same initial model.
            blobs = []
            for peer in peers:
                store = peer.content.store
                assert store.has(firsts[0].model_cid), f"{short_id(peer.node.peer_id)} did not compute model v1 itself"
                blobs.append(store.cat(firsts[0].model_cid))
                assert store.add_bytes(blobs[-1], only_hash=True) == firsts[0].model_cid
            assert len(set(blobs)) == 1
            assert len({chain.initial_cid for chain in chains}) == 1


async def test_a_run_ends_done_on_every_member_at_its_last_checkpoint(tmp_path: Path) -> None:
    """Also with fewer training shards than members (3 and 2): the third member shares a shard
    (issue 27 found its run failing on empty training data)."""
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            steps = 2 * CHECKPOINT_INTERVAL
            # peers.min 3: the run starts with all three, so two of them share a shard (a member that
            # joined late on a loaded machine found the run over, run alone by the first).
            task_cid = await publish_digits_task(peers[0], shards=2, total_steps=steps,
                                                 checkpoint_interval=CHECKPOINT_INTERVAL, min_peers=3, max_peers=3)
            await peers.join_all(task_cid)

            def done() -> list[dict[str, Any]] | None:
                statuses = _statuses(peers, task_cid)
                _failed(statuses)
                return statuses if all(s["state"] == "done" for s in statuses) else None

            statuses = await peers.wait_until(done, STEP_S, what="the run done on every member")
            assert {(s["version"], s["step"], s["latest_model_cid"]) for s in statuses} == {
                (2, steps, statuses[0]["latest_model_cid"])}
            assert _chain_on_disk(peers[0], task_cid).records[-1].record.step == steps


# -- the resync loop: a late joiner catches up and is then planned -----------------------------------------


async def test_a_late_joiner_resyncs_to_the_confirmed_chain_and_is_then_planned(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await _start_run(peers, max_peers=4)  # and the late joiner
            await _all_at_version(peers, task_cid, 1)
            late = await peers.add_peer()
            await late.tasks.join(task_cid)
            me = late.node.peer_id.to_base58()

            def caught_up() -> dict[str, Any] | None:
                s = peers.status(3, task_cid)
                _failed([s])
                return s if s["synced"] and s["version"] >= 1 and me in s["members"] else None

            mine = await peers.wait_until(caught_up, STEP_S, what="the late joiner synced and in a plan")
            theirs = await _all_at_version(peers, task_cid, mine["version"], [0, 1, 2])
            for s in theirs:
                assert s["chain"][: mine["version"]] == mine["chain"][: mine["version"]]
            ours = _chain_on_disk(late, task_cid)
            assert ours.version >= 1
            assert ours.records[0].record == _chain_on_disk(peers[0], task_cid).records[0].record
            # Listed by the coordinator in a plan, and every member sees that plan.
            await peers.wait_until(lambda: all(me in s["members"] for s in _statuses(peers, task_cid)), STEP_S,
                                   what="every member's plan lists the late joiner")


# -- a member that leaves does not stop the run ----------------------------------------------------------


async def _run_at_v1_and_its_coordinator(peers: LocalPeers) -> tuple[str, list[dict[str, Any]], int, list[int]]:
    """A run on every peer, at its first confirmed model: the task, the statuses, the index of the
    coordinator and the others' indexes."""
    task_cid = await _start_run(peers)
    statuses = await _all_at_version(peers, task_cid, 1)
    gone = next(i for i in range(len(peers)) if peers[i].node.peer_id.to_base58() == statuses[0]["coordinator"])
    return task_cid, statuses, gone, [i for i in range(len(peers)) if i != gone]


async def test_the_run_goes_on_without_a_stopped_coordinator(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid, statuses, gone, rest = await _run_at_v1_and_its_coordinator(peers)
            leader = statuses[0]["coordinator"]
            version = max(s["version"] for s in _statuses(peers, task_cid, rest))
            await peers.stop_peer(gone)

            def without_it() -> list[dict[str, Any]] | None:
                statuses = _statuses(peers, task_cid, rest)
                _failed(statuses)
                leaders = {(s["coordinator"], s["term"]) for s in statuses}
                ok = (len(leaders) == 1 and None not in (c := next(iter(leaders))) and c[0] != leader
                      and all(s["version"] > version and leader not in s["members"] for s in statuses))
                return statuses if ok else None

            after = await peers.wait_until(without_it, STEP_S, what="a new coordinator and a checkpoint without the old one")
            assert after[0]["term"] > statuses[0]["term"]
            record = _chain_on_disk(peers[rest[0]], task_cid).records[-1].record
            assert leader not in record.members and set(record.members) == _ids(peers, rest)


async def test_the_run_goes_on_when_the_coordinator_stops_between_a_span_and_its_record(tmp_path: Path) -> None:
    """The coordinator's store holds its next checkpoint (a large model's takes seconds to store)
    and it stops there: the span's checkpoint never gets a record. Its successor counts that
    checkpoint as rejected and plans on; before, the barrier at the span's end waited forever."""
    held, release = threading.Event(), threading.Event()
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid, statuses, gone, rest = await _run_at_v1_and_its_coordinator(peers)
            leader = statuses[0]["coordinator"]
            store = peers[gone].content.store
            add_bytes = store.add_bytes

            def hold(data: bytes, *args: Any, **kwargs: Any) -> str:
                if b"trainer.step" in data[:4096]:  # its optimizer state: the checkpoint's second part
                    held.set()
                    release.wait(STEP_S)
                return add_bytes(data, *args, **kwargs)

            store.add_bytes = hold  # type: ignore[method-assign]
            await peers.wait_until(lambda: held.is_set() or None, STEP_S, what="the coordinator storing a checkpoint")
            version = max(s["version"] for s in _statuses(peers, task_cid, rest))
            peers[gone].node.stop()

            def without_it() -> list[dict[str, Any]] | None:
                statuses = _statuses(peers, task_cid, rest)
                _failed(statuses)
                ok = all(s["version"] > version and s["coordinator"] not in (None, leader) for s in statuses)
                return statuses if ok else None

            try:
                after = await peers.wait_until(without_it, STEP_S, what="a checkpoint confirmed after the unrecorded one")
            finally:
                release.set()  # the stopped coordinator's store returns; its run is cancelled by then
            await peers.stop_peer(gone)
            record = _chain_on_disk(peers[rest[0]], task_cid).records[-1].record
            assert set(record.members) == _ids(peers, rest) and record.step > after[0]["chain"][version - 1]["step"]


async def test_the_run_goes_on_without_a_stopped_member(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await _start_run(peers)
            statuses = await _all_at_version(peers, task_cid, 1)
            leader = statuses[0]["coordinator"]
            gone = next(i for i in range(3) if peers[i].node.peer_id.to_base58() != leader)
            left = peers[gone].node.peer_id.to_base58()
            rest = [i for i in range(3) if i != gone]
            version = max(s["version"] for s in _statuses(peers, task_cid, rest))
            await peers.stop_peer(gone)

            def without_it() -> list[dict[str, Any]] | None:
                statuses = _statuses(peers, task_cid, rest)
                _failed(statuses)
                ok = all(s["version"] > version and left not in s["members"] for s in statuses)
                return statuses if ok else None

            after = await peers.wait_until(without_it, STEP_S, what="a checkpoint confirmed without the stopped member")
            assert after[0]["coordinator"] in _ids(peers, rest)
            record = _chain_on_disk(peers[rest[0]], task_cid).records[-1].record
            assert set(record.members) == _ids(peers, rest)


async def test_a_member_left_below_peers_min_waits_for_peers_instead_of_cycling_through_terms(tmp_path: Path) -> None:
    heartbeat = 0.5  # the election's timeout is 3 heartbeats: 1.5 s
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path, heartbeat_interval=heartbeat) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=TOTAL_STEPS,
                                                 checkpoint_interval=CHECKPOINT_INTERVAL, min_peers=2, max_peers=2)
            await peers.join_all(task_cid)
            await _all_at_version(peers, task_cid, 1)
            await peers.stop_peer(1)

            def waiting() -> dict[str, Any] | None:
                status = peers.status(0, task_cid)
                _failed([status])
                return status if status["waiting_for_peers"] == 1 else None

            first = await peers.wait_until(waiting, STEP_S, what="the lone member waiting for 1 more peer")

            def waited_long() -> dict[str, Any] | None:
                status = peers.status(0, task_cid)
                return status if (status["waiting_s"] or 0) >= 4 * 3 * heartbeat else None

            # Four election timeouts alone: before, four new terms (and vote requests nobody answers).
            later = await peers.wait_until(waited_long, STEP_S, what="the lone member waiting 6 s")
            assert later["term"] == first["term"] and later["waiting_for_peers"] == 1
            assert later["state"] == "training" and later["version"] >= 1


# -- the task service: a join refuses what this node cannot run, with one clear error ------------------

# Over any test machine's free RAM (the field's bound is 2**40): a requirement this node cannot meet.
HUGE_MEMORY_MB = 2**30


async def test_a_join_refuses_what_is_no_task_or_cannot_run_here_and_starts_no_run(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as (holder, joiner):
            with pytest.raises(UserError, match="is not a CID"):
                await joiner.tasks.join("not-a-cid")
            absent = holder.content.store.add_bytes(b"p2ptrain: a task nobody holds", only_hash=True)
            with pytest.raises(ContentUnavailable):
                await joiner.tasks.join(absent)
            garbage = holder.content.store.add_bytes(b"\xff\x00 not a task " * 10)
            with pytest.raises(TaskError):
                await joiner.tasks.join(garbage)
            too_big = await publish_digits_task(holder, extra=f"[requirements]\nmin_memory_mb = {HUGE_MEMORY_MB}\n")
            with pytest.raises(UserError, match="cannot take part in task"):
                await joiner.tasks.join(too_big)
            assert joiner.tasks.runs == {}
