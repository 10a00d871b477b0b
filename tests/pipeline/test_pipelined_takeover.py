"""A pipelined run whose coordinator changes inside a span runs to its end. Three full peers in
this process, two stages, a span of 8 steps with no checkpoint before it (step 0's model is the
run's only confirmed state, as in the stalled 50.7M WAN run of docs/benchmarks.md).

Every member's step from step 3 waits while the test makes the first coordinator step down, until
(``plan``) the new coordinator's plan stops it: that plan goes back to the checkpoint, the one step
every member can follow (protocol/_planner.py ``_takes_over_pipeline``; the pure decision is
tests/pipeline/test_takeover_plans.py); or until (``coordinator``) the new coordinator is known:
the span then ends before it plans, and the checkpoint that the old coordinator no longer records
is abandoned, so the barrier opens (run/_leading.py ``_abandon_inherited``); its plan from the
span's end goes back to the checkpoint too (a stage may have failed the span's last step:
tests/pipeline/test_takeover_plans.py), so the span is redone. On main the first plan was from step
2 and the second stalled at step 8, version 0, for good."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.run._stages import StageRounds
from p2ptrain.testing import local_peers

from .test_pipelined_run import publish, small_text, TASK  # noqa: F401  (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

DEADLINE_S = 240.0
STEP_S = 90.0
THREE = TASK.replace("checkpoint_interval = 2", "checkpoint_interval = 8").replace("max = 8", "max = 3")
HELD_STEP = 3


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
@pytest.mark.parametrize("until", ["plan", "coordinator"])
async def test_a_pipelined_span_whose_coordinator_changes_runs_to_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, until: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            _, task_cid = await publish(peers, THREE)
            first_term: list[int] = []
            held: set[int] = set()

            def runs() -> list[Any]:
                return [p.tasks.runs[task_cid].shared for p in peers if task_cid in p.tasks.runs]

            def later(run: Any) -> bool:
                """Whether ``run`` has what ends the hold: a coordinator of a later term, or its plan."""
                if until == "plan":
                    return run.book is not None and run.book.last_plan is not None \
                        and run.book.last_plan.term > first_term[0]
                return run.election.coordinator is not None and run.election.term > first_term[0]

            step = StageRounds.step

            async def gated(self: StageRounds, plan: Any, index: int, batches: Any) -> Any:
                if self._trainer().step == HELD_STEP and (not first_term or plan.term == first_term[0]):
                    first_term[:1] = [plan.term]
                    held.add(id(self))
                    await peers.wait_until(lambda: later(self.run) or None, STEP_S, what=f"the hold ends ({until})")
                return await step(self, plan, index, batches)

            monkeypatch.setattr(StageRounds, "step", gated)
            await peers.join_all(task_cid)

            await peers.wait_until(lambda: len(held) == 3 or None, STEP_S, what="every member at step 3")
            old = next(r for r in runs() if r.election.is_coordinator)
            old.election.step_down(trio.current_time())
            old.wake_leader.set()

            if until == "plan":
                def new_plans() -> Any:
                    plans = [r.book.last_plan for r in runs()]
                    return plans if all(p is not None and p.term > first_term[0] for p in plans) else None

                plans = await peers.wait_until(new_plans, STEP_S, what="every member follows a plan of a later term")
                # Back to the checkpoint (step 0, the seed-built model), which every member can follow.
                assert {(p.step, p.round, p.version) for p in plans} == {(0, 0, 0)}, plans

            final = await peers.wait_done(task_cid, STEP_S, range(3), what="every member done")
            assert len({s["latest_model_cid"] for s in final}) == 1
