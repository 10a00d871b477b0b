"""`p2ptrain task status`: the status a member reports (TaskRun.status) and how the CLI shows it.

One in-process run on two real loopback peers (``p2ptrain.testing.local_peers``) gives the three
status dicts the human output must read well: before the first round (one member waiting for the
second, ``peers.min = 2``), at the first confirmed model, and done. Each is checked as a dict (the new
``--json`` keys) and as rendered text (rounds completed, not the start of a span; formatted test
metrics; the training loss labelled as such).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from p2ptrain.cli.task import render_status
from p2ptrain.control import TaskStatus
from p2ptrain.testing import LocalPeers, local_peers, publish_digits_task

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

# The whole test: two peers start, torch warms up, a tiny MLP trains 9 steps. Well under a minute
# alone; the bound leaves room for a loaded 2-core box.
DEADLINE_S = 120.0
# One condition (the join's head wait, a checkpoint, the end of the run).
STEP_S = 60.0
TOTAL_STEPS = 9
CHECKPOINT_INTERVAL = 3
# Keys `task status --json` had before issue 15: a contract, kept.
OLD_KEYS = {"task_cid", "name", "state", "error", "member", "synced", "round", "step", "total_steps", "members",
            "coordinator", "term", "version", "latest_model_cid", "chain", "loss", "accuracy", "test_loss",
            "bytes_sent", "rounds_done", "compute_s", "sync_s", "apply_s", "rejected"}
# Every key `task status --json` has for a member's run (issue 28 made the status a TaskStatus; the
# JSON kept every key and type): a contract, pinned exactly. is_coordinator came with it.
MEMBER_KEYS = OLD_KEYS | {"cancel_reason", "waiting_for_peers", "waiting_s", "bytes_received", "last_round",
                          "last_step", "inner_steps", "inner_step", "is_coordinator", "resumed_from",
                          "stage", "stages", "stage_recovery", "stage_suspects",
                          "stage_disagreements", "arithmetic_left_out", "arithmetic_run",
                          "arithmetic_barred"}
# ... and for a task this node only heard of.
HEARD_KEYS = {"task_cid", "name", "announced_by", "member", "state", "refused", "missing_builder", "version", "step", "round",
              "total_steps", "latest_model_cid", "members", "chain_cid"}
# A float printed raw (repr) has more than 4 decimals: formatted metrics never do.
RAW_FLOAT = re.compile(r"\d\.\d{5,}")


async def _wait(peers: LocalPeers, index: int, task_cid: str, ok: Any, what: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        s = peers.status(index, task_cid)
        assert s.get("state") != "failed", s.get("error")
        return s if s and ok(s) else None

    return await peers.wait_until(check, STEP_S, what=what)


async def test_status_says_the_last_completed_round_the_confirmed_model_and_who_it_waits_for(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=TOTAL_STEPS,
                                                 checkpoint_interval=CHECKPOINT_INTERVAL, min_peers=2)
            await peers[0].tasks.join(task_cid)
            # "training" comes at the sync; the wait for peers is noted at the control loop's next
            # tick after it (on a loaded box, a status read can fall between the two).
            before = await _wait(peers, 0, task_cid, lambda s: s["state"] == "training" and s["waiting_for_peers"],
                                 "the first member synced and waiting")
            assert set(before) == MEMBER_KEYS
            assert isinstance(before["members"], list) and isinstance(before["chain"], list)
            assert type(before["state"]) is str and before["state"] == "training"
            assert (before["last_round"], before["last_step"], before["waiting_for_peers"]) == (None, None, 1)
            assert before["resumed_from"] is None  # a fresh start: no chain on this home
            text = render_status(TaskStatus.from_json(before))
            assert "None" not in text and "resumed" not in text, text
            assert "no round completed yet (step 0/9); waiting for 1 more peer" in text, text
            assert "model      none confirmed yet" in text, text

            await peers[1].tasks.join(task_cid)
            mid = await _wait(peers, 0, task_cid, lambda s: s["version"] >= 1, "model v1")
            assert set(mid) == MEMBER_KEYS
            assert TaskStatus.from_json(mid).to_json() == mid  # what the CLI rebuilds is what it prints
            assert json.loads(json.dumps(mid)) == mid
            assert type(mid["chain"][0]) is dict and type(mid["chain"][0]["metrics"]["accuracy"]) is float
            # Round r of a span ends at step r + 1 here (no retries); v1 is the span ending at step 3.
            assert mid["last_step"] == mid["step"] >= CHECKPOINT_INTERVAL
            assert mid["last_round"] == mid["last_step"] - 1 and mid["waiting_for_peers"] == 0
            assert (mid["inner_steps"], mid["inner_step"]) == (None, None)  # sync mode: no inner loop
            pipelined = (mid["stage"], mid["stages"], mid["stage_suspects"], mid["stage_disagreements"])
            assert pipelined == (None,) * 4  # not a pipelined task
            record = mid["chain"][0]
            assert (record["round"], record["step"]) == (CHECKPOINT_INTERVAL - 1, CHECKPOINT_INTERVAL)
            text = render_status(TaskStatus.from_json(mid))
            assert f"round {mid['last_round']} completed, step {mid['last_step']}/9" in text, text
            metrics = record["metrics"]
            assert (f"test accuracy {metrics['accuracy']:.3f}, test loss {metrics['loss']:.3f} "
                    f"(round 2, step 3)") in text, text
            assert "training   loss " in text and "(this peer's last round)" in text, text
            assert not RAW_FLOAT.search(text), text

            done = await _wait(peers, 0, task_cid, lambda s: s["state"] == "done", "the run done")
            assert (done["last_round"], done["last_step"]) == (TOTAL_STEPS - 1, TOTAL_STEPS)
            assert done["chain"][-1]["round"] == TOTAL_STEPS - 1  # the record's round: the span's last
            text = render_status(TaskStatus.from_json(done))
            assert "state      done" in text and "round 8 completed, step 9/9" in text, text
            assert f"model      v{done['version']} {done['latest_model_cid']}" in text, text
            assert not RAW_FLOAT.search(text), text


def test_a_non_member_shows_the_heads_step_not_a_round_it_did_not_see_complete() -> None:
    # The shape services/_tasks.py reports for a task this node only heard of (its head's "round" is
    # the start of the coordinator's span).
    s = {"task_cid": "bafy", "name": "t", "member": False, "state": "running", "version": 11, "step": 300,
         "round": 275, "total_steps": 300, "latest_model_cid": "bafymodel", "members": []}
    text = render_status(TaskStatus.from_json(s))
    assert "progress   step 300/300" in text and "275" not in text, text
    assert "model      v11 bafymodel" in text, text


def test_a_task_only_heard_of_has_its_own_keys_and_survives_the_round_trip() -> None:
    heard = {"task_cid": "bafy", "name": "t", "announced_by": "12D3KooWx", "member": False, "state": "announced",
             "refused": None, "missing_builder": None, "version": 0, "step": 0, "round": None, "total_steps": None,
             "latest_model_cid": None, "members": [], "chain_cid": None}
    status = TaskStatus.from_json(heard)
    assert set(status.to_json()) == HEARD_KEYS and status.to_json() == heard
    # A newer node may send keys this client does not know: they are ignored, not an error.
    assert TaskStatus.from_json({**heard, "from_the_future": 1}).to_json() == heard


def test_a_member_that_resumed_says_from_which_record() -> None:
    s = {"task_cid": "bafy", "name": "t", "member": True, "state": "training", "version": 5, "step": 250,
         "total_steps": 600, "latest_model_cid": "bafymodel", "members": [], "last_round": None,
         "resumed_from": {"version": 5, "step": 250}}
    assert "resumed    from model v5 at step 250" in render_status(TaskStatus.from_json(s))
