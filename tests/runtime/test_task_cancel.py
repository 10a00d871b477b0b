"""`p2ptrain task cancel` and `task resume`: the publisher's cancel stops a run at a span boundary,
its resume continues it from the confirmed head; anyone else's is refused and counted. Real loopback
peers in this process (``p2ptrain.testing.local_peers``); the cancel and the resume go through the
publisher's control socket, as the CLI sends them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.base import UserError
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.protocol import read_chain
from p2ptrain.task import task_bytes, task_from_bytes
from p2ptrain.wire import TASKS_TOPIC, TaskCancel, TaskResume

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

# The whole test: peers start, a checkpoint or two, the cancel settles. Well under a minute alone.
DEADLINE_S = 120.0
# One condition (a checkpoint, a refusal heard, the runs stopped): the run's own deadlines are
# seconds (attestation timeout 20 s).
STEP_S = 60.0


async def _published_by(peers: LocalPeers, index: int, max_peers: int = 8) -> str:
    """A digits task whose file names peer ``index`` as its publisher (as `task publish` writes it)."""
    peer = peers[index]
    unnamed = await publish_digits_task(peer, total_steps=100_000, checkpoint_interval=3, max_peers=max_peers)
    store = peer.content.store
    task = task_from_bytes(store.cat(unnamed))
    named = dataclasses.replace(task, publisher=peer.node.peer_id.to_base58())
    task_cid = store.add_bytes(task_bytes(named))
    store.pin_add(task_cid)
    return task_cid


def _control(peer: Any, op: str, **params: Any) -> Any:
    return ControlClient(peer.node.home, timeout=STEP_S).call(op, **params)


async def test_the_publishers_cancel_stops_every_member_and_a_strangers_is_refused(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            # peers.max 3: the three are the run's members, so term 0 and the first plan need not wait for more.
            task_cid = await _published_by(peers, 0, max_peers=3)
            await peers.join_all(task_cid)

            await peers.wait_version(task_cid, 1, STEP_S, range(3), what="every member at model v1")

            # A member that is not the publisher: its node refuses to send the cancel at all, and a
            # cancel it publishes anyway is refused (and counted) by the others, who train on.
            with pytest.raises(UserError, match="publisher"):
                await trio.to_thread.run_sync(lambda: _control(peers[1], control_ops.TASK_CANCEL, task_cid=task_cid))
            await peers[1].node.publish(TASKS_TOPIC, TaskCancel(task_cid=task_cid, reason="not mine to stop"))

            def refused() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in (0, 2)]
                return statuses if all(s["rejected"].get("cancel", 0) >= 1 for s in statuses) else None

            before = await peers.wait_until(refused, STEP_S, what="the stranger's cancel refused by both others")
            assert all(s["state"] == "training" for s in before)

            reply = await trio.to_thread.run_sync(
                lambda: _control(peers[0], control_ops.TASK_CANCEL, task_cid=task_cid, reason="enough"))
            assert reply == {"task_cid": task_cid, "cancelled": True}

            def cancelled() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in range(3)]
                return statuses if all(s["state"] == "cancelled" for s in statuses) else None

            stopped = await peers.wait_until(cancelled, STEP_S, what="every member's run cancelled")
            assert {s["cancel_reason"] for s in stopped} == {"enough"}
            # Each keeps its last confirmed model: the status's head is the one on disk, verified,
            # and all members agree on it (the span under way ended at its checkpoint, not midway).
            heads = set()
            for i, s in enumerate(stopped):
                data = (peers[i].node.home / "tasks" / task_cid / "chain.jsonl").read_bytes()
                chain = read_chain(task_cid, data)
                assert (chain.version, chain.head_cid) == (s["version"], s["latest_model_cid"])
                assert s["step"] == chain.records[-1].record.step
                heads.add(chain.head_cid)
            assert len(heads) == 1
            # No plan after the cancel: the runs are over, so nothing moves any more.
            rounds = [s["rounds_done"] for s in stopped]
            assert [peers.status(i, task_cid)["rounds_done"] for i in range(3)] == rounds
            # A peer that joins afterwards asks for the run's head; the publisher answers with its
            # cancel again, so the newcomer does not train the task again on its own.
            late = await peers.add_peer()
            await late.tasks.join(task_cid)

            def late_stopped() -> dict[str, Any] | None:
                status = peers.status(3, task_cid)
                return status if status.get("state") in ("cancelled", "done", "failed") else None

            newcomer = await peers.wait_until(late_stopped, STEP_S, what="the late joiner's run cancelled")
            assert newcomer["state"] == "cancelled" and newcomer["rounds_done"] == 0
            # And no member runs it again (a restart with --join, an announcement): the home keeps the cancel.
            with pytest.raises(UserError, match="cancelled"):
                await _rejoin(peers[1], task_cid)


async def _rejoin(peer: Any, task_cid: str) -> None:
    """Join ``task_cid`` as a restarted node would (its run of this process forgotten)."""
    peer.tasks.runs.pop(task_cid)
    await peer.tasks.join(task_cid)


async def test_the_publishers_resume_continues_a_cancelled_run_from_its_head_and_a_strangers_is_refused(
    tmp_path: Path,
) -> None:
    with trio.fail_after(2 * DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await _published_by(peers, 0, max_peers=3)  # no one else joins: no grace for joiners
            await peers.join_all(task_cid)

            await peers.wait_version(task_cid, 1, STEP_S, range(3), what="every member at model v1")
            await trio.to_thread.run_sync(
                lambda: _control(peers[0], control_ops.TASK_CANCEL, task_cid=task_cid, reason="for the night"))

            def cancelled() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in range(3)]
                return statuses if all(s["state"] == "cancelled" for s in statuses) else None

            stopped = await peers.wait_until(cancelled, STEP_S, what="every member's run cancelled")
            head = {(s["version"], s["step"]) for s in stopped}
            assert len(head) == 1
            version, step = head.pop()

            # Anyone but the publisher: its node refuses to send the resume, and a resume it
            # publishes anyway is refused and counted by the members, who stay cancelled.
            with pytest.raises(UserError, match="publisher"):
                await trio.to_thread.run_sync(lambda: _control(peers[1], control_ops.TASK_RESUME, task_cid=task_cid))
            await peers[1].node.publish(TASKS_TOPIC, TaskResume(task_cid=task_cid))

            def refused() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in (0, 2)]
                return statuses if all(s["rejected"].get("resume", 0) >= 1 for s in statuses) else None

            after = await peers.wait_until(refused, STEP_S, what="the stranger's resume refused by both others")
            assert all(s["state"] == "cancelled" for s in after)
            assert all((peers[i].node.home / "tasks" / task_cid / "cancelled").is_file() for i in range(3))

            reply = await trio.to_thread.run_sync(lambda: _control(peers[0], control_ops.TASK_RESUME, task_cid=task_cid))
            assert reply == {"task_cid": task_cid, "resumed": True}

            def moved_on() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in range(3)]
                return statuses if all(s["state"] == "training" and s["version"] > version for s in statuses) else None

            resumed = await peers.wait_until(moved_on, STEP_S, what="every member past the cancelled head")
            for i, s in enumerate(resumed):
                # Each resumed its run from the head it was cancelled at, not from step 0.
                assert s["resumed_from"] == {"version": version, "step": step}
                assert s["chain"][version]["step"] > step
                assert not (peers[i].node.home / "tasks" / task_cid / "cancelled").exists()


async def test_a_resume_naming_no_cid_is_ignored_without_a_handler_error(tmp_path: Path) -> None:
    """A task CID from the network names a folder only once parsed (run/_run_dir.py): a resume whose
    task_cid is a path is dropped quietly, as a resume of a task this home never ran, not a crash
    of the handler (counted as handler-error, with a traceback per message)."""
    with trio.fail_after(60):
        async with local_peers(2, tmp_path) as peers:
            router = peers[0].node.router
            await peers[1].node.publish(TASKS_TOPIC, TaskResume(task_cid="../../escape"))
            await peers.wait_until(lambda: router.delivered["task_resume"] >= 1, 30, what="the resume delivered")
            assert router.dropped["handler-error"] == 0
            assert not (tmp_path / "escape").exists()
