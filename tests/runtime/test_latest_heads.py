"""`model fetch --latest` believes no head as told: a node that holds a task's chain on disk answers
a head request, and the fetcher (services/_latest.py) judges the chain each head names against the
task's own rules; what a head claims (version, model) counts for nothing. Loopback peers in this
process, real keys, real chains with their proofs."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from p2ptrain.services import LatestFinder
from p2ptrain.testing import local_peers, proven_chain, rules_task
from p2ptrain.protocol import signing
from p2ptrain.wire import TASKS_TOPIC, TaskHead

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

# Peers start, one request and its answer, a few chains fetched: seconds; room for a loaded box.
DEADLINE_S = 60.0


def _head(task_cid: str, chain_cid: str, version: int, model_cid: str) -> TaskHead:
    return TaskHead(task_cid=task_cid, term=1, version=version, step=version * 10, round=version * 10 - 1,
                    total_steps=100, chain_cid=chain_cid, model_cid=model_cid, optimizer_cid=model_cid,
                    members=(), done=False)


async def test_a_lying_head_hides_nothing_and_a_longer_forged_lineage_loses(tmp_path: Path) -> None:
    """Issue 27's forged latest, on an allowlisted task: a head that names the honest chain but
    claims version 999 is judged by its chain (the honest one); a longer chain signed, elected and
    attested by the attacker's own identities does not verify; a holder's own answer wins."""
    members = [create_new_key_pair() for _ in range(3)]
    sybils = [create_new_key_pair() for _ in range(3)]
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            holder, fetcher, attacker = peers[0], peers[1], peers[2]
            store = holder.content.store
            task_cid, rules = rules_task(store, min_peers=2, max_peers=4, allow=[signing.peer_str(k) for k in members])
            initial, v1, v2 = (store.add_bytes(f"model {i}".encode()) for i in range(3))
            honest = proven_chain(task_cid, initial, [v1, v2], members, rules=rules)
            # What a member keeps of a run it took part in (also after a restart): its chain.jsonl.
            run_dir = holder.node.home / "tasks" / task_cid
            run_dir.mkdir(parents=True)
            (run_dir / "chain.jsonl").write_bytes(honest.to_bytes())
            honest_cid = store.add_bytes(honest.to_bytes())
            # The attacker: a longer chain of its own identities, proven in full but for the allowlist.
            evil = [attacker.content.store.add_bytes(f"poison {i}".encode()) for i in range(5)]
            forged = proven_chain(task_cid, initial, evil, sybils)  # open rules: it proves itself
            forged_cid = attacker.content.store.add_bytes(forged.to_bytes())
            finder = LatestFinder(fetcher.node, fetcher.content, task_cid)
            await attacker.node.publish(TASKS_TOPIC, _head(task_cid, honest_cid, 999, v2))
            await attacker.node.publish(TASKS_TOPIC, _head(task_cid, forged_cid, 5, evil[-1]))
            _, chain = await finder.find()
            assert (chain.version, chain.head_cid) == (2, v2)
            assert finder.refused["bad_chain"] == 1  # the forged lineage; the lying head cost nothing


async def test_an_open_task_needs_a_fully_proven_lineage(tmp_path: Path) -> None:
    """With open admission a chain proves that a quorum of the identities it names signed it: a
    longer chain that one attacker identity signs alone (under peers.min = 2) is refused, and the
    holder's chain is taken."""
    members = [create_new_key_pair() for _ in range(2)]
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as peers:
            holder, fetcher = peers
            store = holder.content.store
            task_cid, rules = rules_task(store, min_peers=2, max_peers=4)
            initial, v1 = (store.add_bytes(f"model {i}".encode()) for i in range(2))
            honest = proven_chain(task_cid, initial, [v1], members, rules=rules)
            run_dir = holder.node.home / "tasks" / task_cid
            run_dir.mkdir(parents=True)
            (run_dir / "chain.jsonl").write_bytes(honest.to_bytes())
            lone = create_new_key_pair()
            alone = proven_chain(task_cid, initial, ["Qm1", "Qm2", "Qm3"], [lone])  # one member per record
            await holder.node.publish(TASKS_TOPIC, _head(task_cid, store.add_bytes(alone.to_bytes()), 3, "Qm3"))
            finder = LatestFinder(fetcher.node, fetcher.content, task_cid)
            _, chain = await finder.find()
            assert (chain.version, chain.head_cid) == (1, v1)
            assert holder.tasks.head_answers.stats["answered"] >= 1


async def test_a_joiner_of_a_finished_run_loads_its_final_model_instead_of_training_again(tmp_path: Path) -> None:
    """Nobody publishes heads once a run is over: the joiner asks, a member answers, and the
    joiner resyncs to the final checkpoint (and is done) rather than starting at step 0 alone."""
    from p2ptrain.testing import publish_digits_task

    with trio.fail_after(2 * DEADLINE_S):
        async with local_peers(2, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=6, checkpoint_interval=3)
            await peers.join_all(task_cid)

            final = (await peers.wait_done(task_cid, DEADLINE_S, range(2), what="the run done on both members"))[0]
            late = await peers.add_peer()
            await late.tasks.join(task_cid)

            def settled() -> dict | None:
                status = peers.status(2, task_cid)
                return status if status.get("state") in ("done", "failed") else None

            status = await peers.wait_until(settled, DEADLINE_S, what="the late joiner done")
            assert status["state"] == "done", status.get("error")
            assert (status["version"], status["latest_model_cid"]) == (final["version"], final["latest_model_cid"])
            assert status["rounds_done"] == 0  # loaded, not trained again
