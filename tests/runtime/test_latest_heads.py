"""`model fetch --latest` believes no head as told: a node that holds a task's chain on disk answers
a head request, and the fetcher (runtime/latest.py) takes only a head whose chain re-verifies and
ends at the head's model; a forged head is refused and counted. Two loopback peers in this process."""

from __future__ import annotations

from pathlib import Path

import trio

from p2ptrain.runtime.latest import LatestFinder
from p2ptrain.testing import local_peers
from p2ptrain.training.records import Chain, sign_record
from p2ptrain.wire.messages import ModelRecord, TaskHead
from p2ptrain.wire.topics import TASKS_TOPIC

# Peers start, one request and its answer, one chain fetched: seconds; room for a loaded box.
DEADLINE_S = 60.0


def _chain(task_cid: str, initial: str, models: list[str], key_pair, me: str) -> Chain:
    chain = Chain(task_cid, initial)
    for version, model in enumerate(models, start=1):
        record = ModelRecord(task_cid=task_cid, version=version, parent=chain.head_cid, round=version * 10 - 1,
                             step=version * 10, members=(me,), metrics={"accuracy": 0.5}, model_cid=model,
                             optimizer_cid=model, term=1, coordinator="")
        chain.append(sign_record(record, key_pair))
    return chain


async def test_a_held_chain_is_answered_and_verified_and_a_forged_head_is_refused(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as peers:
            holder, fetcher = peers[0], peers[1]
            store = holder.content.store
            task_cid = store.add_bytes(b"a task's bytes, for its CID\n")
            initial, v1, v2 = (store.add_bytes(f"model {i}".encode()) for i in range(3))
            me = holder.node.peer_id.to_base58()
            chain = _chain(task_cid, initial, [v1, v2], holder.node.key_pair, me)
            # What a member keeps of a run it took part in (also after a restart): its chain.jsonl.
            run_dir = holder.node.home / "tasks" / task_cid
            run_dir.mkdir(parents=True)
            (run_dir / "chain.jsonl").write_bytes(chain.to_bytes())
            # A forged head first: a real chain, but a model it does not end at.
            forged = TaskHead(task_cid=task_cid, term=1, version=2, step=20, round=19, total_steps=20,
                              chain_cid=store.add_bytes(chain.to_bytes()), model_cid=initial, optimizer_cid=initial,
                              members=(me,), done=True)
            finder = LatestFinder(fetcher.node, fetcher.content, task_cid)
            await holder.node.publish(TASKS_TOPIC, forged)
            head, got = await finder.find()
            assert (head.model_cid, head.version, got.head_cid) == (v2, 2, v2)
            assert finder.refused["bad_chain"] == 1
            assert holder.tasks.head_answers.stats["answered"] >= 1


async def test_a_joiner_of_a_finished_run_loads_its_final_model_instead_of_training_again(tmp_path: Path) -> None:
    """Nobody publishes heads once a run is over: the joiner asks, a member answers, and the
    joiner resyncs to the final checkpoint (and is done) rather than starting at step 0 alone."""
    from p2ptrain.testing import publish_digits_task

    with trio.fail_after(2 * DEADLINE_S):
        async with local_peers(2, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=6, checkpoint_interval=3)
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(peer.tasks.join, task_cid)

            def done() -> list | None:
                statuses = [peers.status(i, task_cid) for i in range(2)]
                return statuses if all(s.get("state") == "done" for s in statuses) else None

            final = (await peers.wait_until(done, DEADLINE_S, what="the run done on both members"))[0]
            late = await peers.add_peer()
            await late.tasks.join(task_cid)

            def settled() -> dict | None:
                status = peers.status(2, task_cid)
                return status if status.get("state") in ("done", "failed") else None

            status = await peers.wait_until(settled, DEADLINE_S, what="the late joiner done")
            assert status["state"] == "done", status.get("error")
            assert (status["version"], status["latest_model_cid"]) == (final["version"], final["latest_model_cid"])
            assert status["rounds_done"] == 0  # loaded, not trained again
