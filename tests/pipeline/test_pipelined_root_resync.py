"""A pipelined run whose members all fell out of step before its first confirmed checkpoint goes
back to its initial state and trains on (run/_resync.py, ``Resync.load_root``: a pipelined member
holds no stage at step 0 and takes its plan's from the seed).

Three full peers in this process, two stages, a span of 4 steps. Every member's step 2 waits, and
the test makes every member stop holding the run's state there (``RunState.desync``: what each of
the stalled 4x2 WAN run's members did when no plan could be followed, docs/pipeline.md), then ends
the span. Before, no head existed to resync from and every term passed with nobody standing. Now
each goes back to the root, one is elected, and v1 is the model one process trains from the seed in
the span's 4 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from p2ptrain.testing import local_peers

from tests.runtime.test_root_resync import hold_first_term_at

from .test_pipelined_run import publish, single_process, small_text, TASK, whole_model  # noqa: F401  (small_text: an autouse fixture)

pytestmark = pytest.mark.usefixtures("quick_timers_slow_joins")  # tests/conftest.py: idle waits shortened, not the grace

DEADLINE_S = 240.0
STEP_S = 90.0
INTERVAL = 4
HELD_STEP = 2
THREE = TASK.replace("checkpoint_interval = 2", f"checkpoint_interval = {INTERVAL}").replace("max = 8", "max = 3")


async def test_pipelined_members_that_all_fell_out_of_step_at_v0_go_back_to_the_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = hold_first_term_at(monkeypatch, HELD_STEP)
    with trio.fail_after(DEADLINE_S):
        async with local_peers(3, tmp_path) as peers:
            manifest, task_cid = await publish(peers, THREE)
            runs = await peers.join_all(task_cid)
            await peers.wait_until(lambda: len(gate.held) == 3 or None, STEP_S, what="every member at step 2")
            assert all(r.book.chain.version == 0 and r.trainer.step == HELD_STEP for r in runs)
            for run in runs:
                run.desync(trio.current_time())
            gate.released.set()

            statuses = await peers.wait_version(task_cid, 1, STEP_S, range(3), what="v1 confirmed on every member")
            assert len({s["chain"][0]["model_cid"] for s in statuses}) == 1
            record = runs[0].book.chain.records[0].record
            assert record.step == INTERVAL and record.term > gate.first_term[0], record
            # The span started at the root: v1 is what one process trains from the seed in 4 steps.
            store = peers[0].content.store
            confirmed = await whole_model(peers[0], record.model_cid)
            expected = await trio.to_thread.run_sync(
                single_process, THREE.format(manifest=manifest), store, manifest, record.members, INTERVAL)
            assert set(confirmed) == set(expected)
            for name, tensor in expected.items():
                torch.testing.assert_close(confirmed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
