"""A stranger's heads neither stall a member nor fail its run (issue 13: the resync path).

Real peers in this process on 127.0.0.1: a victim that publishes and trains a digits task (one
member, so it is its own coordinator), and an attacker, a real node with its own key and store,
that publishes signed ``TaskHead`` messages for that task on the tasks topic, naming content it
serves over Bitswap: the empty dag-pb node (not a file: ``DagError``), a DAG whose declared size is
over any chain's bound (the "bomb" of issue 13 #3), and bytes that are not a chain.
"""

from __future__ import annotations

import dataclasses

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from p2ptrain.data import build_dataset, load_source
from p2ptrain.ipfs import DAG_PB, cid_from_digest, cid_str, encode_file_leaf, encode_file_node, make_cid
from p2ptrain.node import Node, NodeConfig
from p2ptrain.services import Peer, make_peer
from p2ptrain.wire import TASKS_TOPIC, TaskHead
from p2ptrain.run import TaskRun
from p2ptrain.task import load_task, task_bytes

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 240.0  # whole test: two nodes start, torch warms up, the victim trains (a loaded 2-core box)
FLOOD_S = 4.0  # how long the attacker publishes heads while the victim trains (40 heads, each kind 13 times)
HEADS_PER_S = 10

# peers.max 1: the victim runs alone (the attacker never joins), so its first plan does not wait
# the grace that lets more members join.
TASK = """\
name = "{name}"
seed = 0
[model]
name = "mlp"
kwargs = {{ in_features = 64, hidden = [32], out_features = 10 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.01
[training]
batch_size = 16
total_steps = 1000000
checkpoint_interval = 5
[peers]
min = 1
max = 1
"""


def _dag_pb(store: Any, block: bytes) -> Any:
    cid = cid_from_digest(hashlib.sha256(block).digest(), DAG_PB, 0)
    store.put(cid, block)
    return cid


def _bad_chains(store: Any) -> list[str]:
    """CIDs of content that is no chain, held by the attacker's store."""
    empty_node = _dag_pb(store, b"")
    child = _dag_pb(store, encode_file_leaf(b""))
    for _ in range(3):  # 174 links to one child, three levels: declares 527 MB
        child = _dag_pb(store, encode_file_node([(bytes(child), 100)] * 174, [0] * 174))
    garbage = b"\xff\x00 not a chain " * 100
    garbage_cid = make_cid(garbage)
    store.put(garbage_cid, garbage)
    return [cid_str(empty_node), cid_str(child), cid_str(garbage_cid)]


def _head(task_cid: str, chain_cid: str, version: int) -> TaskHead:
    return TaskHead(task_cid=task_cid, term=version, version=version, step=version, round=version,
                    total_steps=10**6, chain_cid=chain_cid, model_cid=chain_cid, optimizer_cid=chain_cid,
                    members=(), done=False)


async def _with_victim_and_attacker(tmp_path: Path, body: Any) -> None:
    victim = Node(tmp_path / "victim", NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    victim_peer = make_peer(victim)
    name, features, labels = load_source("sklearn:digits")
    manifest, _ = build_dataset(victim_peer.content.store, name, (features / 16.0).astype(np.float32), labels, 4,
                                test_fraction=0.2)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(DEADLINE_S):
            await nursery.start(victim.run)
            attacker = Node(tmp_path / "attacker", NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=victim.addrs[:1]))
            attacker_peer = make_peer(attacker)
            await nursery.start(attacker.run)
            await victim.membership.wait_until(lambda m: len(m.alive()) >= 1)
            await attacker.membership.wait_until(lambda m: len(m.alive()) >= 1)
            await body(victim_peer, attacker_peer, manifest)
        attacker.stop()
        victim.stop()
        nursery.cancel_scope.cancel()


async def _wait(predicate: Any) -> None:
    while not predicate():
        await trio.sleep(0.1)


async def test_heads_from_a_peer_that_is_not_the_coordinator_are_refused_and_training_goes_on(tmp_path: Path) -> None:
    async def body(victim: Peer, attacker: Peer, manifest: str) -> None:
        bad = _bad_chains(attacker.content.store.blocks)
        reply = await victim.control.publish({"text": TASK.format(name="trusted", manifest=manifest), "join": True})
        run: TaskRun = victim.tasks.runs[reply["task_cid"]]
        await _wait(lambda: run.shared.phase == "failed" or (run.shared.book is not None and run.shared.book.chain.version >= 1))
        assert run.shared.phase == "training" and run.shared.synced, run.shared.error
        version, step = run.shared.book.chain.version, run.shared.trainer.step
        for i in range(int(FLOOD_S * HEADS_PER_S)):  # a head 10**9 versions ahead, 10 a second
            await attacker.node.publish(TASKS_TOPIC, _head(run.shared.task_cid, bad[i % len(bad)], 10**9 + i))
            await trio.sleep(1 / HEADS_PER_S)
            assert run.shared.phase == "training" and run.shared.synced, (run.shared.phase, run.shared.error)
        await _wait(lambda: run.shared.book.chain.version > version + 1 or run.shared.phase != "training")
        assert run.shared.phase == "training" and run.shared.synced, (run.shared.phase, run.shared.error)
        assert run.shared.trainer.step > step
        assert run.shared.heads is not None and run.shared.heads.version < 10**9
        assert run.shared.rejected["head_untrusted"] > 0
        assert run.status().rejected["head_untrusted"] == run.shared.rejected["head_untrusted"]
        assert run.shared.rejected["resync_failed"] == 0

    await _with_victim_and_attacker(tmp_path, body)


async def test_a_head_naming_content_that_is_no_chain_is_a_counted_resync_failure_not_a_failed_run(
    tmp_path: Path,
) -> None:
    """A fresh joiner (no confirmed model, no coordinator known) acts on the first heads it hears
    (documented in docs/training.md): whatever they name must be a counted refusal."""

    async def body(victim: Peer, attacker: Peer, manifest: str) -> None:
        bad = _bad_chains(attacker.content.store.blocks)
        text = TASK.format(name="joined-late", manifest=manifest)
        # `task publish` names its node as the task's publisher (the key `task cancel` obeys).
        task = dataclasses.replace(load_task(text), publisher=victim.node.peer_id.to_base58())
        task_cid = victim.content.store.add_bytes(task_bytes(task), only_hash=True)
        sent = 0

        async def flood() -> None:
            nonlocal sent
            while True:
                await attacker.node.publish(TASKS_TOPIC, _head(task_cid, bad[sent % len(bad)], 10**9 + sent))
                sent += 1
                await trio.sleep(1 / HEADS_PER_S)

        async with trio.open_nursery() as flooding:
            flooding.start_soon(flood)
            reply = await victim.control.publish({"text": text, "join": True})
            assert reply["task_cid"] == task_cid
            run: TaskRun = victim.tasks.runs[task_cid]
            await _wait(lambda: run.shared.phase == "failed" or run.status().rejected.get("resync_failed", 0) >= 3)
            flooding.cancel_scope.cancel()
        assert run.shared.phase == "resyncing", (run.shared.phase, run.shared.error)
        assert run.shared.error is None
        assert run.shared.rejected["resync_failed"] >= 3
        assert victim.node.host is not None and victim.tasks.runs[task_cid] is run  # still serving

    await _with_victim_and_attacker(tmp_path, body)


async def test_a_chain_extended_by_a_stranger_or_forked_is_not_loaded(tmp_path: Path) -> None:
    """The chain a head names is re-verified record by record, but anyone can sign a record whose
    parent is the real head and that names a model of their choice: the records a chain adds must
    prove their signer's election and a quorum of attestations, be signed by the coordinator our
    election accepted for their term, and the records we confirmed must be there unchanged."""
    from dataclasses import replace

    from p2ptrain.testing import attestations_for, proven_record
    from p2ptrain.protocol import Chain, sign_record
    from p2ptrain.training import Trainer

    async def body(victim: Peer, attacker: Peer, manifest: str) -> None:
        reply = await victim.control.publish({"text": TASK.format(name="forged", manifest=manifest), "join": True})
        run: TaskRun = victim.tasks.runs[reply["task_cid"]]
        await _wait(lambda: run.shared.phase == "failed" or (run.shared.book is not None and run.shared.book.chain.version >= 1))
        assert run.shared.phase == "training" and run.shared.synced, run.shared.error
        ours = run.shared.book.chain
        real = ours.records[-1].record
        # The attacker's model of the right architecture, and a record for it one version ahead.
        poisoned = Trainer(run.shared.task, total_steps=run.shared.total_steps, device="cpu")
        poisoned.step = real.step + 5
        store = attacker.content.store
        model_cid = store.add_bytes(poisoned.model_bytes())
        optim_cid = store.add_bytes(poisoned.optimizer_bytes())
        key = attacker.node.key_pair
        # A record that only its signer backs (no votes, no attestations) ...
        extra = sign_record(replace(real, version=real.version + 1, parent=real.model_cid, step=real.step + 5,
                                    round=real.round + 5, model_cid=model_cid, optimizer_cid=optim_cid), key)
        extended = Chain.from_bytes(run.shared.task_cid, run.shared.initial_cid, ours.to_bytes())
        extended.append(extra)
        # ... and a whole chain the attacker proves by itself, as the one member of its own v1.
        forged = proven_record(replace(ours.records[0].record, model_cid=model_cid, optimizer_cid=optim_cid), key, [key])
        forked = Chain(run.shared.task_cid, run.shared.initial_cid, ours.rules)
        forked.append(forged, attestations_for(forged.record, [key]))
        # The victim keeps training meanwhile: if it confirmed its own next version first, the
        # stranger's extension is refused as a fork of it instead (refused either way).
        for chain, reasons in ((extended, ("not one of its members", "fork")), (forked, ("fork",))):
            chain_cid = store.add_bytes(chain.to_bytes())
            head = _head(run.shared.task_cid, chain_cid, chain.version)
            failure = await run.resync.try_load_head(head)
            assert failure is not None and any(why in failure for why in reasons), failure
            assert run.shared.trainer.model_bytes() != poisoned.model_bytes()
        assert run.shared.rejected["resync_failed"] == 2 and run.shared.rejected["fork"] >= 1
        assert run.shared.phase != "failed" and run.shared.book.chain is ours

    await _with_victim_and_attacker(tmp_path, body)


async def test_a_strangers_head_between_terms_at_v0_does_not_desync_a_member_that_holds_the_runs_state(
    tmp_path: Path,
) -> None:
    """Before the run's first confirmed record (v0) a member that holds the run's state knows no
    coordinator between terms (its coordinator stepped down, died, or broke the rules). A stranger's
    head then was acted on, as a fresh joiner's is: one naming v10**9 made the member desync after
    two looks (its chain "behind the run"), and a member that is not synced does not stand, so a
    lone member (or every member of a run) never elected anyone again and tried the stranger's head
    forever. Fails on main: the victim ends in "resyncing" with resync failures counted."""

    async def body(victim: Peer, attacker: Peer, manifest: str) -> None:
        bad = _bad_chains(attacker.content.store.blocks)
        # No checkpoint for the test's length: the run stays at v0.
        text = TASK.format(name="v0-window", manifest=manifest).replace("checkpoint_interval = 5",
                                                                         "checkpoint_interval = 1000000")
        reply = await victim.control.publish({"text": text, "join": True})
        run: TaskRun = victim.tasks.runs[reply["task_cid"]]
        shared = run.shared
        await _wait(lambda: shared.phase == "failed" or (shared.election.is_coordinator and shared.synced
                                                        and shared.trainer is not None and shared.trainer.step >= 2))
        assert shared.phase == "training" and shared.book.chain.version == 0, shared.error
        sent = 0

        async def flood() -> None:
            nonlocal sent
            while True:
                await attacker.node.publish(TASKS_TOPIC, _head(shared.task_cid, bad[sent % len(bad)], 10**9 + sent))
                sent += 1
                await trio.sleep(1 / HEADS_PER_S)

        async with trio.open_nursery() as flooding:
            flooding.start_soon(flood)
            await trio.sleep(0.5)
            # The window: this term's coordinator (the victim itself) steps down, as one that fell
            # behind does; the next term elects it again, unless a stranger's head desynced it.
            term = shared.election.term
            shared.election.step_down(trio.current_time())
            await _wait(lambda: shared.rejected.get("resync_failed", 0) >= 1
                        or (shared.election.is_coordinator and shared.election.term > term))
            step = shared.trainer.step
            await _wait(lambda: shared.rejected.get("resync_failed", 0) >= 1 or shared.trainer.step > step + 2)
            flooding.cancel_scope.cancel()
        assert shared.rejected["resync_failed"] == 0, (shared.phase, shared.rejected)
        assert shared.phase == "training" and shared.synced and shared.error is None
        assert shared.rejected["head_untrusted"] > 0
        assert shared.heads is None or shared.heads.version < 10**9

    await _with_victim_and_attacker(tmp_path, body)
