"""A pipelined span's last step, lost at one member or said lost by one (protocol/_failure_reports.py;
tests/runtime/test_last_round_failure.py and test_false_reports.py are the data-parallel runs'):
three full peers in this process, two stages, short runs.

A *split completion* at a span's last step: the victim sums its stage's gradients with the stage's
other replica (its bytes went out: the other completes the sum and steps) and then fails there
(its last hop timed out), so it holds the step before, reports the round failed, and stores no
checkpoint. A data-parallel record can be confirmed without it (it then loads that record,
``Attesting.lost_span``); a pipelined one cannot: the checkpoint's manifest is a gather of every
member's signed stage statement (run/_stage_checkpoints.py), so no record comes, the others'
checkpoint counts as rejected when the gather's start timeout ends, the coordinator's retry
redoes the round with every member (those that stepped roll back one step), and the run ends with
one chain and each stage's replicas holding the bits its manifest names.

A *false report*: a member completes the first span's last step, sends its stage statement, and
reports that step failed. The coordinator holds the retry for the record, a quorum confirms it,
and the report is dropped, counted, and its sender left out of the next plan whether it attested
or not (``held_after``: the manifest proves it completed the step); the run ends with one chain,
no step redone. A member that *missed the record* takes it from the run's head and ends done.

Each run is checked the same way (``_run``): one chain, each stage's replicas holding the bits its
manifest names, and the confirmed model the one one process trains with the drivers' batches.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from p2ptrain.base import short_id
from p2ptrain.collective import CollectiveError
from p2ptrain.protocol import stage_rings
from p2ptrain.run import RunState
from p2ptrain.run._attesting import Attesting
from p2ptrain.run._spans import Spans
from p2ptrain.run._stages import StageRounds
from p2ptrain.testing import local_peers
from p2ptrain.training import read_manifest

from .test_pipelined_run import publish, single_process, small_text, TASK, whole_model  # noqa: F401  (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

DEADLINE_S = 200.0
RUN_S = 150.0
STEPS = 4


def _task(interval: int) -> str:
    """THREE members (peers.max: no wait for more), at least two (a liar left out), STEPS steps."""
    return (TASK.replace("total_steps = 16", f"total_steps = {STEPS}")
            .replace("checkpoint_interval = 2", f"checkpoint_interval = {interval}")
            .replace("min = 3", "min = 2").replace("max = 8", "max = 3"))


async def _run(tmp_path: Path, task_text: str, reference: int = -1) -> tuple[list[RunState], list[dict[str, Any]]]:
    """Three members run ``task_text`` to its end: their runs and their ``task status --json``,
    once checked: one chain, at the run's last step; each member of the last record that holds a
    stage holds the bits its manifest names for it (one that loaded the record by CID holds none:
    no member holds the whole model); and the model of record ``reference`` is what one process
    trains in its steps with the batches of its members' drivers."""
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            manifest, task_cid = await publish(peers, task_text)
            runs = await peers.join_all(task_cid)
            statuses = await peers.wait_done(task_cid, RUN_S)
            store = peers[0].content.store
            records = [c.record for c in runs[0].require()[1].chain.records]
            held = []
            for run in runs:
                trainer = run.require()[0]
                if run.me in records[-1].members and trainer.trained is not None:
                    model, _ = trainer.stage_files(trainer.trained)
                    held.append((trainer.trained, str(store.add_bytes(model, only_hash=True))))
            entries = read_manifest(store.cat(records[-1].model_cid))
            record = records[reference]
            confirmed = await whole_model(peers[0], record.model_cid)
            expected = await trio.to_thread.run_sync(single_process, task_text.format(manifest=manifest), store,
                                                     manifest, record.members, record.step)
    assert all(s["step"] == STEPS for s in statuses), statuses
    assert len({tuple(c["model_cid"] for c in s["chain"]) for s in statuses}) == 1, statuses
    assert len(held) >= 2 and all(cid == entries[stage].model for stage, cid in held), (held, entries)
    assert not any("stage_diverged" in s["rejected"] for s in statuses), statuses
    # No step lost or applied twice (within float rounding: fp32 activations).
    assert set(confirmed) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(confirmed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    return runs, statuses


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first
@pytest.mark.parametrize("who", ["member", "coordinator"])
async def test_a_pipelined_member_whose_last_step_failed_after_the_others_is_redone_with_and_ends_with_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, who: str) -> None:
    """``member``: a replica of a stage of two; ``coordinator``: the coordinator, whichever stage it
    holds (its sum done, then failed: its partner, if any, stepped), whose retry comes at once,
    while the others still wait at their checkpoint. Fails on main (``coordinator``, 2 runs of 2):
    its drivers' requests of the step were answered by a replica that had applied it and not yet
    rolled back, with the next step's weights, and the confirmed model was not one process's. The
    others leave the checkpoint gather on the victim's report (its statement never comes) a grace
    later, not after the gather's start timeout."""
    caplog.set_level(logging.WARNING, logger="p2ptrain.run")
    failed: list[tuple[str, int, int]] = []  # (victim, its step, the plan's attempt)
    real = StageRounds._sum

    async def split(self: StageRounds, plan: Any, index: int, stage: int) -> None:
        await real(self, plan, index, stage)
        coordinator = self.run.election.coordinator
        shared = [m for ring in stage_rings(plan) if len(ring) > 1 for m in ring if m != coordinator]
        victim = coordinator if who == "coordinator" else next(iter(shared), None)
        if failed or self._trainer().step != STEPS - 1 or self.run.me != victim:
            return
        failed.append((self.run.me, self._trainer().step, plan.attempt))
        raise CollectiveError("the last hop timed out here (the test's split completion)")

    monkeypatch.setattr(StageRounds, "_sum", split)
    runs, statuses = await _run(tmp_path, _task(STEPS))
    assert [step for _, step, _ in failed] == [STEPS - 1], failed  # the victim's last step did fail, once
    record = runs[0].require()[1].chain.records[-1].record
    # The record is a retry's, of all three: the victim was not left out.
    assert record.version == 1 and record.attempt > failed[0][2] and len(record.members) == 3, record
    # The others redid the round they had stepped (rolled back one step); the victim ran it once.
    rounds = [s["rounds_done"] for s in statuses]
    victim = next(i for i, r in enumerate(runs) if r.me == failed[0][0])
    assert rounds[victim] == STEPS and sorted(rounds) == [STEPS, STEPS + 1, STEPS + 1], rounds
    assert all(not s["rejected"].get("failure_report") for s in statuses), statuses  # an honest report: not counted
    left = [r.getMessage() for r in caplog.records if "its stage statement will not come" in r.getMessage()]
    assert left and all(short_id(failed[0][0]) in line for line in left), left


@pytest.mark.timeout(300)
async def test_a_false_report_of_a_pipelined_spans_last_step_is_dropped_with_its_record_and_the_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The liar sends no attestation of that record (a quorum confirms it without): fails on main,
    where such a reporter was taken for a member whose last round failed, its report dropped
    uncounted and itself kept in the next plan (so was one whose attestation came too late for
    the quorum: 1 run in 2 on main without the withholding)."""
    lies: list[tuple[str, int, int]] = []  # (liar, the round it said failed, the plan's attempt)
    run_round: Callable[..., Awaitable[bool]] = Spans._run_round
    attest_if_ready: Callable[[Attesting], Awaitable[None]] = Attesting._attest_if_ready
    interval = STEPS // 2

    async def lying(self: Spans, plan: Any, index: int, batches: Any, average: Any) -> bool:
        ok = await run_round(self, plan, index, batches, average)
        liar = next(m for m in plan.members if m != self.run.election.coordinator)
        if ok and not lies and self.run.me == liar and plan.round + index == interval - 1:
            lies.append((liar, plan.round + index, plan.attempt))
            await self.run.report_failure(plan, index, "the test's false report: this step completed here")
        return ok

    async def withholding(self: Attesting) -> None:
        owed = self.run.attestations.owed(self.run.me)
        if not (lies and self.run.me == lies[0][0] and any(record.step == interval for record in owed)):
            await attest_if_ready(self)

    monkeypatch.setattr(Spans, "_run_round", lying)
    monkeypatch.setattr(Attesting, "_attest_if_ready", withholding)
    runs, statuses = await _run(tmp_path, _task(interval), reference=0)
    assert [r for _, r, _ in lies] == [interval - 1], lies
    liar = next(i for i, r in enumerate(runs) if r.me == lies[0][0])
    records = [c.record for c in runs[0].require()[1].chain.records]
    # No step redone: the first span's record is of the plan the liar lied about, of all three.
    assert (records[0].version, records[0].attempt) == (1, lies[0][2]) and len(records[0].members) == 3, records
    assert records[-1].version >= 2 and records[-1].step == STEPS, records
    # Dropped and counted by the coordinator (and any member it reached before the next plan), and
    # the liar left out of the next span (its stage, if it was the only replica, goes to another).
    coordinator = next(i for i, r in enumerate(runs) if r.me == records[0].coordinator)
    assert statuses[coordinator]["rejected"].get("failure_report"), statuses[coordinator]
    assert runs[liar].me not in records[1].members, records


@pytest.mark.timeout(300)
async def test_a_pipelined_member_that_missed_the_last_record_loads_it_and_ends_done(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A member of the last span drops the span's record (gossip lost it): the other two confirm
    it, and it takes the record from the run's head by CID and ends done. Fails on main 2 runs of 3
    (the wait's timeout): when the coordinator ended before its next head, the done members elected
    the victim, which led a run with nothing left to plan, never done; unelected now, it asks for
    the head after QUIET_S (this test's 18 s then; 7 s when the head came first)."""
    missed: list[str] = []
    on_record = Attesting.on_record

    async def losing(self: Attesting, signed: Any, sender: str) -> None:
        run = self.run
        plan = run.book.last_plan if run.book is not None else None
        victim = plan is not None and run.me == next(m for m in plan.members if m != run.election.coordinator)
        if victim and signed.record.step == STEPS:
            missed.append(run.me)
            return
        await on_record(self, signed, sender)

    monkeypatch.setattr(Attesting, "on_record", losing)
    runs, statuses = await _run(tmp_path, _task(STEPS))
    assert len(set(missed)) == 1, missed
    victim = next(i for i, r in enumerate(runs) if r.me == missed[0])
    # It loaded the record the others confirmed (one chain: _run), and ran every step once.
    assert statuses[victim]["state"] == "done" and statuses[victim]["rounds_done"] == STEPS, statuses[victim]
