"""A member out of step past v1 with no head past v0 loads its own chain's last checkpoint and
trains on (run/_resync_rules.py, ``unsynced_action``); the pure rules beside it.

tests/pipeline/test_stalling_replica.py once ended with two members ``resyncing`` for 150 s at v1,
at steps 0 and 1 (the checkpoint was at step 4), saying nothing. A member that is not synced waited
for a head in every case but one naming a version past its chain: with none heard past v0 it
waited for good, though its own confirmed chain names the checkpoint to load. Nothing wakes it when
nobody publishes heads: it was the coordinator (a member out of step steps down, and does not stand
while it is not synced), or the heads came while it knew no coordinator (they are dropped then).

One real peer in this process on 127.0.0.1 trains a digits task alone (its own coordinator). Its
round at step 4 (v1 confirmed at step 3) waits; the test makes it fall out of step there, knowing
only a head at v0, and ends the span. On main it stayed ``resyncing`` (TimeoutError below); now it
loads v1 from its own chain, is elected again, and v2 is confirmed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio

from p2ptrain.run._resync_rules import (after_load, NOTE_AFTER_S, slow_step, SLOW_STEP_S, unsynced_action, Unsynced,
                                        WaitNotes)
from p2ptrain.wire import TaskHead

from .test_resync_busy import CHECKPOINT_INTERVAL, hold_round_at, held_member

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 120.0
STEP_S = 30.0


def _head(version: int, step: int) -> TaskHead:
    return TaskHead(task_cid="t", term=1, version=version, step=step, round=step, total_steps=100,
                    chain_cid="c", model_cid="m", optimizer_cid="o", members=("a",), done=False)


def test_a_member_out_of_step_past_v0_goes_to_its_chain_unless_a_head_names_a_later_version() -> None:
    # The stuck members of test_stalling_replica: v1 at step 4, at steps 0 and 1, a head at v0 or none.
    for step in (0, 1):
        for head in (None, _head(0, 0), _head(1, 4)):
            assert unsynced_action(1, 4, step, head) is Unsynced.LOAD_OWN, (step, head)
    assert unsynced_action(1, 4, 4, None) is Unsynced.SYNCED  # at its chain's head: its state is the run's
    assert unsynced_action(1, 4, 4, _head(0, 0)) is Unsynced.SYNCED
    assert unsynced_action(2, 8, 3, _head(1, 4)) is Unsynced.LOAD_OWN  # a head behind its chain: its own
    assert unsynced_action(1, 4, 4, _head(2, 8)) is Unsynced.LOAD_HEAD  # the run went on without it
    assert unsynced_action(1, 4, 0, _head(3, 12)) is Unsynced.LOAD_HEAD
    # At v0 a member waits for a head past it (a joiner waits for the run's first checkpoint).
    assert unsynced_action(0, 0, 0, None) is Unsynced.WAIT
    assert unsynced_action(0, 0, 2, _head(0, 0)) is Unsynced.WAIT
    assert unsynced_action(0, 0, 0, _head(1, 4)) is Unsynced.LOAD_HEAD


def test_a_member_that_stays_unsynced_says_what_it_waits_for_at_doubling_intervals() -> None:
    notes = WaitNotes()
    said = [(t, notes.note(float(t), False, "a head")) for t in range(0, 130)]
    times = [t for t, line in said if line is not None]
    assert times == [NOTE_AFTER_S, 2 * NOTE_AFTER_S, 4 * NOTE_AFTER_S, 8 * NOTE_AFTER_S]
    assert said[int(NOTE_AFTER_S)][1] == f"not synced for {NOTE_AFTER_S:.0f} s: waiting for a head"
    # Synced again: counted afresh; a look that acted (None) says nothing, the next one that waits does.
    assert notes.note(200.0, True, None) is None
    assert notes.note(201.0, False, None) is None
    assert notes.note(201.0 + NOTE_AFTER_S, False, None) is None
    assert notes.note(202.0 + NOTE_AFTER_S, False, "x") == f"not synced for {NOTE_AFTER_S + 1:.0f} s: waiting for x"
    assert after_load(None) is None and after_load("gone") == "a state it can load (the last try: gone)"
    # A catch-up or look that blocked the loop long is said as it ends (no look happens meanwhile).
    assert slow_step(SLOW_STEP_S - 0.1, "a look") is None
    assert slow_step(61.0, "catching up to plan 4.0") == "catching up to plan 4.0 took 61 s"


async def test_a_member_out_of_step_at_v1_with_no_head_past_v0_loads_its_chain_and_trains_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = hold_round_at(monkeypatch, CHECKPOINT_INTERVAL + 1)  # in the second span, v1 confirmed
    with trio.fail_after(DEADLINE_S):
        async with held_member(tmp_path, gate, STEP_S) as (peers, task):
            run = task.shared
            trainer, book = run.require()
            assert book.chain.version == 1 and book.head_step == CHECKPOINT_INTERVAL
            assert trainer.step == CHECKPOINT_INTERVAL + 1 and run.heads is not None
            # Out of step, knowing no head past v0 (the v1 head it published itself, as if never heard).
            run.desync(trio.current_time())
            run.heads = dataclasses.replace(run.heads, version=0, step=0)
            task.spans.stop_rounds()  # the span ends (as a newer plan ends it)
            await peers.wait_until(lambda: run.synced or None, STEP_S,
                                   what="the member holds its chain's checkpoint again (on main: resyncing for good)")
            trainer, book = run.require()
            assert trainer.step == CHECKPOINT_INTERVAL and book.chain.version == 1
            assert not run.rejected.get("resync_failed")
            gate.released.set()
            await peers.wait_until(lambda: run.book is not None and run.book.chain.version >= 2 or None, STEP_S,
                                   what="v2 confirmed: it was elected again and trained on")
