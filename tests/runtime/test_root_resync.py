"""Members that all fell out of step before the run's first confirmed checkpoint go back to its
initial state and train on (run/_resync.py, ``Resync.load_root``).

Three real peers in this process on 127.0.0.1 train a digits task (SGD with momentum, so the
optimizer holds state after a step). Every member's round at step 2 of the first span waits, and
the test makes every member stop holding the run's state there (``RunState.desync``, what a
member does when no plan it hears can be followed: the stalled WAN run of docs/pipeline.md, or a
ring takeover plan two steps behind everyone), then ends the span. No checkpoint is confirmed, so
there is no head to resync from: before, no member stood for election again and no term ever had a
coordinator. Now each goes back to the run's root (the initial model and optimizer state, step 0),
one is elected, and v1 is confirmed from a span that starts at step 0.

The pure rule (only a member whose own chain has no record goes back, whatever a head says) is
tested beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

import p2ptrain.testing._peers as testing_peers
from p2ptrain.run._resync import Resync, restarts_at_root
from p2ptrain.run._spans import Spans
from p2ptrain.testing import local_peers, publish_digits_task
from p2ptrain.wire import TaskHead

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 150.0
STEP_S = 60.0
CHECKPOINT_INTERVAL = 3
HELD_STEP = 2


def _head(version: int) -> TaskHead:
    return TaskHead(task_cid="t", term=1, version=version, step=3 * version, round=3 * version, total_steps=100,
                    chain_cid="c", model_cid="m", optimizer_cid="o", members=("a",), done=False)


def test_only_a_member_that_held_the_state_and_has_no_confirmed_record_goes_back_to_the_root() -> None:
    assert restarts_at_root(0, None, pending=False, was_synced=True)
    assert restarts_at_root(0, _head(0), pending=False, was_synced=True)
    # The run went on without it: the head is loaded instead.
    assert not restarts_at_root(0, _head(2), pending=False, was_synced=True)
    # A record is pending here: it may yet be confirmed.
    assert not restarts_at_root(0, _head(0), pending=True, was_synced=True)
    # Confirmed progress is never given up, whatever head (a v0 one from anyone) is heard.
    assert not restarts_at_root(1, _head(0), pending=False, was_synced=True)
    assert not restarts_at_root(1, None, pending=False, was_synced=True)
    # A joiner that heard the first span under way waits for its checkpoint (docs/training.md, "Join").
    assert not restarts_at_root(0, _head(0), pending=False, was_synced=False)


@dataclass
class HeldStep:
    """Every member's round at ``step`` in the first term that reaches it, held until ``released``
    is set; the span then ends there with no checkpoint (:func:`hold_first_term_at`)."""

    step: int
    first_term: list[int] = field(default_factory=list)  # that term, once a member reached the step
    held: set[int] = field(default_factory=set)  # the members' Spans held so far (their ids)
    released: trio.Event = field(default_factory=trio.Event)


def hold_first_term_at(monkeypatch: pytest.MonkeyPatch, step: int) -> HeldStep:
    """Patch ``Spans._run_round`` so that each member stops at ``step`` of the first term's span
    (a later term's plans run as they come): how these tests make every member fall out of step
    at v0 together. Also used by tests/pipeline/test_pipelined_root_resync.py."""
    gate = HeldStep(step)
    run_round = Spans._run_round

    async def gated(self: Spans, plan: Any, index: int, batches: Any, average: Any) -> bool:
        trainer, _ = self.run.require()
        if trainer.step == gate.step and (not gate.first_term or plan.term == gate.first_term[0]):
            gate.first_term[:1] = [plan.term]
            gate.held.add(id(self))
            await gate.released.wait()
            return False  # the span ends here, with no checkpoint
        return await run_round(self, plan, index, batches, average)

    monkeypatch.setattr(Spans, "_run_round", gated)
    return gate


async def test_members_that_all_fell_out_of_step_at_v0_go_back_to_the_root_and_confirm_v1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # SGD with momentum: after a step the optimizer holds state that the root does not.
    monkeypatch.setattr(testing_peers, "DIGITS_TASK", testing_peers.DIGITS_TASK.replace(
        "lr = 0.05", "lr = 0.05\nmomentum = 0.9"))
    gate = hold_first_term_at(monkeypatch, HELD_STEP)
    roots: list[tuple[bool, bytes, int]] = []  # (model is the root's, optimizer bytes, step) after each load_root
    load_root = Resync.load_root

    async def watched(self: Resync) -> None:
        await load_root(self)
        run = self.run
        trainer, _ = run.require()
        model = run.content.store.add_bytes(trainer.model_bytes(), only_hash=True)
        roots.append((model == run.initial_cid, trainer.optimizer_bytes(), trainer.step))

    monkeypatch.setattr(Resync, "load_root", watched)

    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=100_000, checkpoint_interval=CHECKPOINT_INTERVAL,
                                                 min_peers=3, max_peers=3)
            runs = await peers.join_all(task_cid)
            await peers.wait_until(lambda: len(gate.held) == 3 or None, STEP_S, what="every member at step 2")
            assert all(r.book.chain.version == 0 and r.trainer.step == HELD_STEP for r in runs)
            initial_optimizer = runs[0].content.store.cat(runs[0].initial_optimizer_cid)
            assert runs[0].trainer.optimizer_bytes() != initial_optimizer  # momentum buffers by now
            for run in runs:
                run.desync(trio.current_time())
            assert not any(r.synced or r.election.is_coordinator for r in runs)
            gate.released.set()

            statuses = await peers.wait_version(task_cid, 1, STEP_S, range(3), what="v1 confirmed on every member")
            first = statuses[0]["chain"][0]
            # From a span of a later term that started at the root: v1 is at step 3, not 3 past step 2.
            assert first["step"] == CHECKPOINT_INTERVAL, first
            assert {s["chain"][0]["model_cid"] for s in statuses} == {first["model_cid"]}
            assert all(r.synced for r in runs)
            assert {r.election.term for r in runs} != {gate.first_term[0]}
            # Each member went back to the root: its initial model and optimizer state, at step 0.
            assert len(roots) >= 3 and all(ok and optim == initial_optimizer and step == 0 for ok, optim, step in roots)
            assert not any(s["rejected"].get("resync_failed") for s in statuses), [s["rejected"] for s in statuses]
