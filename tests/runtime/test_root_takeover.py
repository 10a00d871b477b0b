"""Members that all left a plan past the run's root, before its first confirmed checkpoint, train on
from the root (protocol/_planner.py, ``_behind_observed``).

Three real peers in this process on 127.0.0.1 train a digits task (a first span of 5 steps). Every
member's round at step 3 of the first span waits; the coordinator then publishes a plan from step 1
of that span, which none can follow (each is at step 3 and keeps only step 2: what a ring takeover
planned one step back while its own round still ran looked like once that round completed
everywhere, docs/training.md, "The coordinator dies"). Each member stops advertising and goes back
to the run's root (run/_resync.py, load_root). On main every member elected after that saw the plan
from step 1 past its step 0 and resynced instead of planning, to the root it held, then stood
again: no term got a plan, and the run stood still. Now each steps down for it once, and a member
elected again with no newer plan seen plans from the root: v1 is confirmed at step 5.

Beside it, members back at the root whose coordinator, still past it, retries a plan they cannot
follow (``RoundBook.root_reported``); the pure rules are tests/pipeline/test_takeover_plans.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio

from p2ptrain.protocol._plans import span_length
from p2ptrain.run._resync import Resync
from p2ptrain.testing import local_peers, publish_digits_task

from .test_root_resync import hold_first_term_at

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 180.0
STEP_S = 60.0
CHECKPOINT_INTERVAL = 5
HELD_STEP = 3


async def test_members_that_left_a_plan_past_the_root_plan_from_the_root_and_confirm_v1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = hold_first_term_at(monkeypatch, HELD_STEP)
    roots: list[int] = []  # the step after each load_root
    load_root = Resync.load_root

    async def watched(self: Resync) -> None:
        await load_root(self)
        roots.append(self.run.require()[0].step)

    monkeypatch.setattr(Resync, "load_root", watched)

    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=100_000, checkpoint_interval=CHECKPOINT_INTERVAL,
                                                 min_peers=3, max_peers=3)
            runs = await peers.join_all(task_cid)
            await peers.wait_until(lambda: len(gate.held) == 3 or None, STEP_S, what="every member at step 3")
            assert all(r.book.chain.version == 0 and r.trainer.step == HELD_STEP for r in runs)
            coordinator = next(r for r in runs if r.election.is_coordinator)
            first = coordinator.book.last_plan
            assert first is not None and first.step == 0 and first.term == gate.first_term[0]
            # A plan of the coordinator's term from step 1 of its span, which no member can follow.
            left = replace(first, round=first.round + 1, attempt=first.attempt + 1, step=1,
                           rounds=span_length(coordinator.book.task, first.round + 1, coordinator.book.total_steps))
            await coordinator.broadcast(left)
            gate.released.set()
            await peers.wait_until(lambda: all(r.book.observed == left for r in runs) or None, STEP_S,
                                   what="every member saw the plan from step 1")

            statuses = await peers.wait_version(task_cid, 1, STEP_S, range(3), what="v1 confirmed on every member")
            chain = statuses[0]["chain"][0]
            # From a span of a later term that started at the root: v1 is at step 5.
            assert chain["step"] == CHECKPOINT_INTERVAL, chain
            assert {s["chain"][0]["model_cid"] for s in statuses} == {chain["model_cid"]}
            assert len(roots) >= 3 and set(roots) == {0}, roots  # each member went back to the root
            assert all(r.synced for r in runs)


async def test_a_retry_that_members_back_at_the_root_cannot_follow_goes_back_to_the_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two members fall out of step at step 3 of the first span and go back to the root; the
    coordinator, still at step 3, then plans from step 2 of that span (a retry it can follow), which
    they cannot: each reports its failure at step 0. On main it left them out as culprits: with
    ``peers.min`` 3 nobody could plan, and after their quarantine the same retry failed on them
    again. Now it goes back to the root too (RoundBook.root_reported), and v1 is confirmed at step 5
    from a span that starts there, with all three."""
    gate = hold_first_term_at(monkeypatch, HELD_STEP)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=100_000, checkpoint_interval=CHECKPOINT_INTERVAL,
                                                 min_peers=3, max_peers=3)
            runs = await peers.join_all(task_cid)
            await peers.wait_until(lambda: len(gate.held) == 3 or None, STEP_S, what="every member at step 3")
            coordinator = next(r for r in runs if r.election.is_coordinator)
            others = [r for r in runs if r is not coordinator]
            for run in others:
                run.desync(trio.current_time())
            gate.released.set()
            await peers.wait_until(lambda: all(r.synced and r.trainer.step == 0 for r in others) or None, STEP_S,
                                   what="the two members back at the root")
            first = coordinator.book.last_plan
            assert first is not None and coordinator.election.is_coordinator and coordinator.trainer.step == HELD_STEP
            retry = replace(first, round=first.round + 2, attempt=first.attempt + 1, step=2,
                            rounds=span_length(coordinator.book.task, first.round + 2, coordinator.book.total_steps))
            await coordinator.broadcast(retry)

            statuses = await peers.wait_version(task_cid, 1, STEP_S, range(3), what="v1 confirmed on every member")
            chain = statuses[0]["chain"][0]
            assert chain["step"] == CHECKPOINT_INTERVAL, chain  # from the root, not 3 past step 2
            assert all(len(r.book.chain.records[0].record.members) == 3 for r in runs)  # none left out
            assert {s["chain"][0]["model_cid"] for s in statuses} == {chain["model_cid"]}
