"""A resync never loads a state into the trainer while a span of this member runs on it.

A round computes and applies in a worker thread (``trio.to_thread``): a head's model and optimizer
loaded meanwhile would be torn (a step's weights under the checkpoint's step), undone (a local-SGD
round sets back the weights it started from) or, in a pipelined run, freed under the stage's step.

One real peer in this process on 127.0.0.1 trains a digits task alone (its own coordinator). Its
round at a chosen step is held (``Spans._run_round`` waits on the test), so a span is under way:

- the head moves ahead of its chain there (it missed a record): after BEHIND_CHECKS looks the member
  desyncs, and the resync loop loaded that head at its next look, under the span. Now it loads
  only once the span has ended (``Resync.run_loop``'s behind path checks ``busy()``).
- a load that starts anyway (a catch-up, the run's root) stops the span's rounds, as a newer plan
  does, and swaps the state only once the span has ended (``Spans.hold_trainer``); before, the
  trainer's state was replaced while the round was still in its span.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.protocol import RecordError
from p2ptrain.run import TaskRun
from p2ptrain.run._leading import Leading
from p2ptrain.run._resync import Resync
from p2ptrain.run._spans import Spans
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task
from p2ptrain.wire import TaskHead

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 120.0
STEP_S = 60.0
CHECKPOINT_INTERVAL = 3


@dataclass
class Gate:
    """The member's round at ``step`` waits until ``released`` (its span is under way meanwhile)."""

    step: int
    held: trio.Event = field(default_factory=trio.Event)
    released: trio.Event = field(default_factory=trio.Event)


def hold_round_at(monkeypatch: pytest.MonkeyPatch, step: int) -> Gate:
    gate = Gate(step)
    run_round = Spans._run_round

    async def gated(self: Spans, plan: Any, index: int, batches: Any, average: Any) -> bool:
        trainer, _ = self.run.require()
        if trainer.step == gate.step and not gate.released.is_set():
            gate.held.set()
            await gate.released.wait()  # a stop (Spans.stop_rounds) cancels this wait
        return await run_round(self, plan, index, batches, average)

    monkeypatch.setattr(Spans, "_run_round", gated)
    return gate


@asynccontextmanager
async def held_member(tmp_path: Path, gate: Gate, within_s: float = STEP_S,
                      ) -> AsyncIterator[tuple[LocalPeers, TaskRun]]:
    """One member alone in a long digits run (its peer and its run), once its round at the gate's
    step is held (within ``within_s``): its span is under way."""
    async with local_peers(1, tmp_path) as peers:
        task_cid = await publish_digits_task(peers[0], total_steps=100_000, checkpoint_interval=CHECKPOINT_INTERVAL,
                                             max_peers=1)
        await peers.join_all(task_cid)
        with trio.fail_after(within_s):
            await gate.held.wait()
        yield peers, peers[0].tasks.runs[task_cid]


async def test_a_member_that_falls_behind_during_its_span_loads_the_head_only_once_the_span_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = hold_round_at(monkeypatch, CHECKPOINT_INTERVAL + 1)  # in the second span, v1 confirmed
    loads: list[bool] = []  # spans.running at each head load the resync loop started
    looks: list[bool] = []  # synced, at each look of the resync loop
    try_offers = Resync.ask_and_try_offers

    async def load_head(self: Resync, head: TaskHead, *, witnessed: bool = False) -> None:
        loads.append(self.busy())
        raise RecordError("not loaded in this test")  # the head names no chain: a refused resync

    async def looking(self: Resync) -> bool:
        looks.append(self.run.synced)
        return await try_offers(self)

    publish_head = Leading._publish_head

    injected: list[TaskHead] = []  # the run's head as the test names it (the coordinator's own sets it too)

    async def publishing(self: Leading) -> None:
        if not injected:
            await publish_head(self)
        if injected:  # (also after a head under way as it was named)
            self.run.heads, self.run.head_sender = injected[0], self.run.me

    monkeypatch.setattr(Resync, "_load_head", load_head)
    monkeypatch.setattr(Resync, "ask_and_try_offers", looking)
    monkeypatch.setattr(Leading, "_publish_head", publishing)
    with trio.fail_after(DEADLINE_S):
        async with held_member(tmp_path, gate) as (peers, task):
            run = task.shared
            assert run.synced and task.spans.running and task.spans.in_rounds
            version = run.book.chain.version
            assert version >= 1 and not run.attestations.pending
            # The run's head, a version past this member's chain (it missed that record).
            head = run.heads
            assert head is not None
            injected.append(dataclasses.replace(head, version=version + 1, step=head.step + CHECKPOINT_INTERVAL))
            run.heads, run.head_sender = injected[0], run.me
            await peers.wait_until(lambda: not run.synced or None, STEP_S, what="the member desyncs, behind the head")
            seen = len(looks)
            await peers.wait_until(lambda: len(looks) >= seen + 3 or None, STEP_S, what="three more looks")
            assert task.spans.running  # still held
            assert loads == [], "loaded a head into the trainer while a span of this member ran on it"
            gate.released.set()
            await peers.wait_until(lambda: loads or None, STEP_S, what="the head loaded after the span")
            assert not any(loads), loads
            assert run.rejected.get("resync_failed", 0) >= 1  # this test's refused load


async def test_a_load_that_starts_under_a_span_stops_its_rounds_and_waits_for_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = hold_round_at(monkeypatch, 1)  # the first span, before any checkpoint: the run's root is its state
    swaps: list[tuple[bool, bool]] = []  # (spans.running, spans.in_rounds) as the trainer's state is replaced

    with trio.fail_after(DEADLINE_S):
        async with held_member(tmp_path, gate) as (peers, task):
            run = task.shared
            trainer = run.trainer
            assert trainer is not None
            load_state = trainer.load_state

            def watched(model: bytes, optim: bytes) -> None:
                swaps.append((task.spans.running, task.spans.in_rounds))
                load_state(model, optim)

            monkeypatch.setattr(trainer, "load_state", watched)
            assert task.spans.running and run.book.chain.version == 0 and trainer.step == 1
            run.desync(trio.current_time())  # so the member neither plans nor follows meanwhile
            # What a catch-up (Resync._follow_from_behind) does at v0 while the span still runs.
            assert await task.resync.try_load_root() is None
            # (the resync loop may load the root again once the span is over: never under it either)
            assert swaps and all(swap == (False, False) for swap in swaps), swaps
            assert trainer.step == 0 and run.synced
            assert not gate.released.is_set()  # the span ended because its rounds were stopped
