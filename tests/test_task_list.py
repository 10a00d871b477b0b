"""`p2ptrain task list`'s rows (cli/task.py ``render_row``) say only what is known, as `task status`
does: a task heard of and not started is "not started", with its length where this node read its
definition (services/_tasks.py ``KnownTask.total_steps``); no row shows "step 0/?". Fails on main,
where every such row read "step 0/?"."""

from __future__ import annotations

from p2ptrain.cli.task import render_row, render_status
from p2ptrain.control import TaskStatus
from p2ptrain.services._tasks import KnownTask

CID = "bafytask"


def _heard(total_steps: int | None) -> TaskStatus:
    """What services/_tasks.py reports for a task announced and not joined, no head heard yet."""
    return KnownTask(task_cid=CID, name="digits", announced_by="12D3KooWx", total_steps=total_steps).status()


def test_a_task_heard_of_and_not_started_says_so_with_its_length_where_known() -> None:
    row = render_row(_heard(300))
    assert row.split() == [CID, "digits", "announced", "not", "started,", "300", "steps"], row
    # task status says the same of it: no step, the task's length
    assert "no member has reported a step yet (the task runs 300 steps)" in render_status(_heard(300))
    row = render_row(_heard(None))
    assert row.split() == [CID, "digits", "announced", "not", "started"], row
    assert "?" not in row


def test_a_run_under_way_shows_its_step_and_total_only_where_the_total_is_known() -> None:
    base = {"task_cid": CID, "name": "digits", "member": True, "state": "training", "version": 2, "step": 40,
            "latest_model_cid": None, "members": []}
    assert "step 40/300" in render_row(TaskStatus.from_json({**base, "total_steps": 300}))
    row = render_row(TaskStatus.from_json({**base, "total_steps": None}))
    assert row.split() == [CID, "digits", "training", "step", "40", "member"], row
    heard = {**base, "member": False, "state": "running", "round": 35, "total_steps": 300}
    assert render_row(TaskStatus.from_json(heard)).split()[-1] == "40/300"


def test_a_members_status_leaves_out_a_total_it_does_not_know_yet() -> None:
    """A member counts the run's steps once it has read the data set; before that, `task status`
    said "no round completed yet (step 0/?)". Fails on main."""
    member = {"task_cid": CID, "name": "digits", "member": True, "state": "joining", "step": 0, "members": []}
    text = render_status(TaskStatus.from_json({**member, "total_steps": None}))
    assert "progress   no round completed yet (step 0)" in text.splitlines(), text
    assert "?" not in text
    done = {**member, "state": "training", "last_round": 4, "last_step": 5}
    assert "progress   round 4 completed, step 5/300" in render_status(
        TaskStatus.from_json({**done, "total_steps": 300})).splitlines()
    assert "progress   round 4 completed, step 5" in render_status(
        TaskStatus.from_json({**done, "total_steps": 0})).splitlines()
