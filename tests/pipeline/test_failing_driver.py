"""A driver whose step fails alone, step after step (protocol.LoneFailures): the rule with made-up
summaries, and one driver saying "failed" in every summary of a pipelined run of full peers.

On main a driver's failure named nobody, so the retry kept the same members: one driver claiming a
failed step in every summary stopped the run for good (0 steps in 60 s, the driver still in every
plan). Now a driver whose step fails while another driver's does not, in three of the last ten
summaries, is the step's culprit (``Misbehaved``): left out of the next plans for the quarantine, and the run goes
on without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import p2ptrain.run._stages as stages_module
from p2ptrain.pipeline import Driver, PipelineError
from p2ptrain.protocol import LoneFailures
from p2ptrain.protocol._stage_verdicts import MAX_DRIVERS_KEPT
from p2ptrain.testing import local_peers

from .test_pipelined_integrity import TASK as INTEGRITY_TASK
from .test_pipelined_run import publish, small_text  # noqa: F401 (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

A, B, C = "driver-a", "driver-b", "driver-c"


def test_a_driver_failing_alone_in_three_summaries_of_ten_is_the_culprit():
    lone = LoneFailures()
    assert [lone.observe([A, B, C], {B}) for _ in range(3)] == [None, None, B]
    assert [lone.observe([A, B, C], {B}) for _ in range(3)] == [None, None, B]  # its record starts again
    # Letting every third step through does not reset it (a streak would never end).
    seen = [lone.observe([A, B, C], {B} if i % 3 else set()) for i in range(6)]
    assert seen == [None, None, None, None, B, None]  # its third failure in ten summaries


def test_failures_of_every_driver_blame_nobody():
    lone = LoneFailures()
    assert [lone.observe([A, B], {A, B}) for _ in range(5)] == [None] * 5  # a replica died: every driver failed
    assert [lone.observe([A, B], {A}) for _ in range(2)] == [None, None]
    assert lone.observe([A, B], {A, B}) is None  # says nothing, counts nothing
    assert lone.observe([A, B], {A}) == A
    with pytest.raises(ValueError):
        LoneFailures(limit=11, window=10)


def test_a_driver_that_caught_a_liar_fails_one_step_and_is_not_blamed_for_it():
    lone = LoneFailures()
    for _ in range(10):
        assert lone.observe([A, B, C], {C}) is None
        assert [lone.observe([A, B, C], set()) for _ in range(4)] == [None] * 4


def test_what_it_keeps_is_bounded_however_many_drivers_it_saw():
    lone = LoneFailures()
    for i in range(MAX_DRIVERS_KEPT + 100):
        lone.observe([f"driver-{i}", A], set())
    assert len(lone._records) <= MAX_DRIVERS_KEPT


HOSTILE: set[str] = set()  # drivers (base58) that say their step failed in every summary from now on
TASK = INTEGRITY_TASK.replace("check_fraction = 1.0", "check_fraction = 0.0").replace("max = 6", "max = 5")  # its five
# peers, all from the run's start: term 0 and the first plan need not wait for more (docs/testing.md)
assert TASK != INTEGRITY_TASK and "max = 5" in TASK


class MaybeFailing(Driver):
    """A member's driver, honest until the test names its peer in HOSTILE; then every step it
    drove in full is said to have failed."""

    async def finish(self, left_out=()):
        rings = await super().finish(left_out)
        if str(self.host.get_id()) in HOSTILE:
            raise PipelineError("a failure it made up")
        return rings


@pytest.fixture
def failing(monkeypatch):
    monkeypatch.setattr(stages_module, "Driver", MaybeFailing)
    HOSTILE.clear()
    yield
    HOSTILE.clear()


@pytest.mark.usefixtures("failing")
async def test_a_driver_saying_every_step_failed_is_left_out_and_the_run_goes_on(tmp_path: Path) -> None:
    with trio.fail_after(240):
        async with local_peers(5, tmp_path) as peers:  # peers.min is 4: the run goes on without one
            _, task_cid = await publish(peers, TASK, shards=2)
            run = (await peers.join_all(task_cid))[0]

            def hostile_driver() -> str | None:
                plan = run.book.last_plan if run.book else None
                if plan is None or plan.stages is None or len(plan.members) < 5 or run.rounds_done < 2:
                    return None
                drivers = [m for m, s in zip(plan.members, plan.stages, strict=True)
                           if s == 0 and m != run.election.coordinator]
                return drivers[0] if drivers else None

            hostile = await peers.wait_until(hostile_driver, 150, what="a plan of five")
            HOSTILE.add(hostile)
            honest = [p for p in peers if p.node.peer_id.to_base58() != hostile]
            watcher = honest[0].tasks.runs[task_cid].shared
            done = watcher.rounds_done
            await peers.wait_until(lambda: watcher.rounds_done >= done + 3 or None, 90,
                                   what="steps after a driver began failing every step (on main: none in 60 s)")
            plan = watcher.book.last_plan
            assert hostile not in plan.members
