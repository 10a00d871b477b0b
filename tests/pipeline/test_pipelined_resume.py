"""A pipelined run survives losing every member: restarted on their homes, the members resume from
their last record, which names a manifest of the stages' files; each loads the manifest, then only
the stage its first plan names, and the run goes on to its end (issue 31 on issue 32's resume).
Real loopback peers in this process, stopped and started again on the same homes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.testing import local_peers
from p2ptrain.training import is_manifest

from .test_pipelined_run import DEADLINE_S, publish, small_text, STEP_S, STEPS, TASK

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

__all__ = ["small_text"]  # the fixture (autouse): the small text, one thread

# peers.max 3: the run's members, all from its start (term 0 and the first plan need not wait for more)
THREE = TASK.replace("max = 8", "max = 3")
assert THREE != TASK


@pytest.mark.timeout(300)  # the suite's bound, declared: tests/conftest.py deals it among the first (~30 s or more alone)
async def test_members_stopped_together_resume_their_stages_from_the_last_manifest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            _, task_cid = await publish(peers, THREE)
            await peers.join_all(task_cid)

            def at(version: int) -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in range(3)]
                return statuses if all(s.get("version", 0) >= version for s in statuses) else None

            await peers.wait_until(lambda: at(2), STEP_S, what="every member at model v2")
            # The last stage's members stop first: the drivers' next step finds no replica of it,
            # which fails that step (a round failure), never the run (an internal error).
            plan = peers[0].tasks.runs[task_cid].shared.book.last_plan
            last = {m for m, s in zip(plan.members, plan.stages, strict=True) if s == max(plan.stages)}
            order = sorted(range(3), key=lambda i: peers[i].node.peer_id.to_base58() not in last)
            for i in order[: len(last)]:
                await peers.stop_peer(i)

            def driver_failed() -> list[str] | None:
                said = [r.getMessage() for r in caplog.records]
                return [m for m in said if "failed at this driver" in m or "internal error" in m] or None

            said = await peers.wait_until(driver_failed, STEP_S, what="a driver's step without its last stage")
            assert not [m for m in said if "internal error" in m], said
            for i in order[len(last) :]:
                await peers.stop_peer(i)
            for i in range(3):
                await peers.restart_peer(i, see_all=False)
            await peers.wait_connected()
            await peers.join_all(task_cid)

            final = await peers.wait_done(task_cid, STEP_S, range(3), what="the resumed run done on every member")
            for i, status in enumerate(final):
                assert status["resumed_from"] is not None and status["resumed_from"]["version"] >= 2
                assert status["chain"][-1]["step"] == STEPS and not status["rejected"].get("stage_diverged")
                run = peers[i].tasks.runs[task_cid].shared
                # It held and trained one stage after the resume: the others' tensors are freed.
                assert run.trainer.trained is not None and not run.trainer.whole
                assert all(p.is_meta for s in run.trainer.stages if s.index != run.trainer.trained
                           for p in s.parameters())
            assert not [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
            store = peers[0].content.store
            assert is_manifest(store.cat(final[0]["chain"][-1]["model_cid"]))
            assert len({tuple(c["model_cid"] for c in s["chain"]) for s in final}) == 1
