"""A ring takeover planned while the new coordinator's own round still runs is followed by members
that completed that round (protocol/_planner.py, decide: no step back while ``rounds_running``).

Three real peers in this process on 127.0.0.1 train a digits task (a first span of 5 steps). Every
member's round at step 2 of the first span waits; the test makes the coordinator step down, and
the member elected next plans at once (its round is waiting), at step 2. The race of a real run is
then forced: each member takes that plan only once its round at step 2 has completed (step 3, the
state at step 2 kept for a rollback). On main the plan was from step 1, two steps behind every
member: none could follow it, each fell out of step and went back to the run's root
(run/_resync.py, load_root), and the steps were lost (with no head past v0 the run then stalled:
tests/runtime/test_root_takeover.py). Now it is from step 2: every member rolls back its one step
and follows, nobody goes back to the root, and v1 is confirmed at step 5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.run._resync import Resync
from p2ptrain.run._spans import Spans
from p2ptrain.run._task_run import TaskRun
from p2ptrain.testing import local_peers, publish_digits_task
from p2ptrain.wire import RoundPlan


pytestmark = pytest.mark.usefixtures("quick_timers", "no_missed_plan")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 180.0
STEP_S = 60.0
CHECKPOINT_INTERVAL = 5
HELD_STEP = 2


async def test_a_ring_takeover_during_a_round_that_completes_everywhere_is_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first_term: list[int] = []  # the term whose round at step 2 is held, once a member reached it
    held: set[int] = set()  # the members' Spans held so far (their ids)
    released = trio.Event()  # set when a plan of a later term reaches a member
    completed: dict[int, trio.Event] = {}  # id(RunState) -> its held round has ended
    run_round = Spans._run_round

    async def gated(self: Spans, plan: Any, index: int, batches: Any, average: Any) -> bool:
        trainer, _ = self.run.require()
        if trainer.step == HELD_STEP and (not first_term or plan.term == first_term[0]) and id(self) not in held:
            first_term[:1] = [plan.term]
            held.add(id(self))
            await released.wait()
            try:
                return await run_round(self, plan, index, batches, average)  # the round completes
            finally:
                completed.setdefault(id(self.run), trio.Event()).set()
        return await run_round(self, plan, index, batches, average)

    monkeypatch.setattr(Spans, "_run_round", gated)
    roots: list[int] = []
    load_root = Resync.load_root

    async def watched(self: Resync) -> None:
        await load_root(self)
        roots.append(self.run.require()[0].step)

    monkeypatch.setattr(Resync, "load_root", watched)
    taken: list[tuple[RoundPlan, int]] = []  # the later term's first plan as each member took it, and its step
    on_plan = TaskRun.ROUTES[RoundPlan]

    async def late(self: TaskRun, sender: str, plan: RoundPlan) -> None:
        run = self.shared
        if first_term and plan.term > first_term[0] and id(run) not in {id(r) for r in took}:
            # The race: the held round completes here before this plan arrives.
            took.append(run)
            released.set()
            with trio.fail_after(STEP_S):
                await completed.setdefault(id(run), trio.Event()).wait()
            taken.append((plan, run.require()[0].step))
        await on_plan(self, sender, plan)

    took: list[Any] = []
    monkeypatch.setitem(TaskRun.ROUTES, RoundPlan, late)

    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=100_000, checkpoint_interval=CHECKPOINT_INTERVAL,
                                                 min_peers=3, max_peers=3)
            runs = await peers.join_all(task_cid)
            await peers.wait_until(lambda: len(held) == 3 or None, STEP_S, what="every member at step 2")
            old = next(r for r in runs if r.election.is_coordinator)
            old.election.step_down(trio.current_time())
            old.wake_leader.set()
            await peers.wait_until(lambda: len(taken) == 3 or None, STEP_S, what="every member took the new plan")
            # Each took it one step past the step it was planned at, which it can still follow.
            assert {(p.step, step) for p, step in taken} == {(HELD_STEP, HELD_STEP + 1)}, taken

            statuses = await peers.wait_version(task_cid, 1, STEP_S, range(3), what="v1 confirmed on every member")
            assert statuses[0]["chain"][0]["step"] == CHECKPOINT_INTERVAL
            assert roots == [], roots  # nobody fell out of step
