"""A member that only follows the run, left behind when it ends, asks for the run's head and ends done
(protocol/_trailing.py, run/_resync.py ``Resync.ask_and_try_offers``).

Three real peers in this process on 127.0.0.1 run a digits task of three checkpoints. One of them
advertises (and counts itself with) another arithmetic than the other two, torch's scalar kernels
as on a CPU without AVX2: the plans leave it out and it follows the run's records, as
tests/runtime/test_mixed_arithmetic.py's scalar members do on node processes (where a full suite
showed the bug once; here the arithmetic is only advertised, so one process does). Its task
messages are held back the way a loaded machine's were: it misses every record but the run's last
and every head of the running coordinator past v0, so it refuses the last record (v3) as a gap and
holds v0 when the run ends. A finished run's coordinator publishes no heads; before, nobody asked,
and the follower stood in term after term, never done. Now it asks, a finished member answers, and
it loads v3, every record of which it witnessed (the plans of their spans, their coordinator's term).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.run import RunState, TaskRun
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.wire import HeadRequest, SignedModelRecord, TaskHead

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 180.0
RUN_S = 120.0  # three spans of four steps, on a loaded 2-core box
TRAIL_S = 45.0  # after the members' end: the election forgets the coordinator (3 beats), then one ask
TOTAL_STEPS = 12  # three spans of four steps


def _hold_back(peers: LocalPeers, task_cid: str, held: list[str]) -> None:
    """On the peer the run's plans leave out: drop every record short of the run's end (TOTAL_STEPS),
    and every head past v0 until it asks for the run's head (a HeadRequest once it follows plans, not
    the one of its join): the running coordinator's heads, the last one included, are lost; answers
    to its request come through."""
    for peer in peers:
        run: TaskRun = peer.tasks.runs[task_cid]
        deliver, publish, asked = run.on_message, peer.node.publish, []

        def follower(run: TaskRun = run) -> bool:
            book = run.shared.book
            return book is not None and book.accepted is not None and run.shared.me not in book.accepted.members

        async def on_message(sender: str, msg: Any, deliver: Any = deliver, follower: Any = follower,
                             asked: list[bool] = asked) -> None:
            if follower() and ((isinstance(msg, SignedModelRecord) and msg.record.step < TOTAL_STEPS)
                               or (isinstance(msg, TaskHead) and msg.version >= 1 and not asked)):
                held.append(f"{type(msg).__name__} v{msg.version if isinstance(msg, TaskHead) else msg.record.version}")
                return
            await deliver(sender, msg)

        async def publish_noted(topic: str, msg: Any, publish: Any = publish, follower: Any = follower,
                                asked: list[bool] = asked) -> None:
            if isinstance(msg, HeadRequest) and follower():
                asked.append(True)
            await publish(topic, msg)

        run.on_message = on_message  # type: ignore[method-assign]
        peer.node.publish = publish_noted  # type: ignore[method-assign]


async def _left_out_for_its_arithmetic(peers: LocalPeers, index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer ``index`` advertises torch's scalar kernels (and counts itself so), the others what
    this machine computes with: the run's class is theirs (two against one), it is left out."""
    membership = peers[index].node.membership
    caps = await membership.caps_known()
    assert caps.arithmetic is not None
    scalar = caps.arithmetic.rsplit(" with ", 1)[0] + " with " + ("AVX2" if "DEFAULT" in caps.arithmetic else "DEFAULT")
    membership.caps = replace(caps, arithmetic=scalar + " kernels")
    membership.poke()
    me, own = peers[index].node.peer_id.to_base58(), RunState.arithmetic
    monkeypatch.setattr(RunState, "arithmetic", lambda run, peer: scalar + " kernels" if peer == run.me == me
                        else own(run, peer))
    for peer in peers:
        await peer.node.membership.caps_known()
    await peers.wait_until(lambda: all(r.caps.arithmetic == scalar + " kernels" for p in peers if p is not peers[index]
                                       for r in p.node.membership.alive() if r.peer_id.to_base58() == me),
                           30, what="the scalar arithmetic advertised")


async def test_a_follower_left_behind_at_the_runs_end_asks_for_its_head_and_ends_done(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails on main: the follower stays at v0 in state training, no head heard, until the wait times out."""
    caplog.set_level(logging.INFO, logger="p2ptrain.run")
    held: list[str] = []
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            await _left_out_for_its_arithmetic(peers, 2, monkeypatch)
            task_cid = await publish_digits_task(peers[0], total_steps=TOTAL_STEPS, checkpoint_interval=4, min_peers=2)
            await peers.join_all(task_cid)
            _hold_back(peers, task_cid, held)
            statuses = await peers.wait_until(
                lambda: (s := [peers.status(i, task_cid) for i in range(3)])
                and sum(x.get("state") == "done" for x in s) >= 2 and s, RUN_S, what="the run's two members done")
            follower = 2
            assert [s["state"] for s in statuses[:2]] == ["done", "done"], statuses
            members = [s for i, s in enumerate(statuses) if i != follower]
            # Three checkpoints, or two where a loaded box changed terms at one (its record abandoned).
            last = members[0]["version"]
            assert last >= 2 and all(s["version"] == last for s in members), [s["version"] for s in members]
            final = await peers.wait_done(task_cid, TRAIL_S, what="the follower done after the run's end")
    ended = final[follower]
    assert ended["version"] == last and ended["latest_model_cid"] == members[0]["latest_model_cid"], ended
    assert ended["step"] == TOTAL_STEPS and ended["synced"], ended
    assert ended["rejected"].get("arithmetic_left_out") and ended["rounds_done"] == 0, ended  # it never trained
    assert "SignedModelRecord v1" in held and any(h.startswith("TaskHead") for h in held), held
    asked = [r.getMessage() for r in caplog.records if "asking the run's members for its head" in r.getMessage()]
    # (Other asks may come before, by any peer: a loaded box can take 10 s to elect the first coordinator.)
    assert any(f"at model v0 (the run confirmed v{last})" in line for line in asked), asked
