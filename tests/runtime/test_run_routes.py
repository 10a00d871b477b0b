"""Where a task's messages go: every wire message about a task names its task CID the same way,
and each is routed (TaskRun.ROUTES) or handled by a node service, so a new message type cannot be
decoded and then silently dropped."""

from __future__ import annotations

import dataclasses

from p2ptrain.run import TaskRun
from p2ptrain.wire import MESSAGES, HeadRequest, TaskAnnounce, TaskResume

# Messages about a task that the task service handles itself, not a run: announcements (join),
# head requests (answered from a finished run's chain) and resumes (which start a run).
SERVICE_MESSAGES = {TaskAnnounce, HeadRequest, TaskResume}


def _about_a_task(cls: type) -> bool:
    fields = {f.name for f in dataclasses.fields(cls)}
    return "task_cid" in fields or isinstance(getattr(cls, "task_cid", None), property)


def test_every_routed_type_is_a_registered_message_that_names_its_task() -> None:
    for cls in TaskRun.ROUTES:
        assert MESSAGES.knows(cls), cls
        assert _about_a_task(cls), f"{cls.__name__} has no task_cid: the task service cannot route it"


def test_every_message_about_a_task_has_a_route_or_a_service() -> None:
    registered = (MESSAGES.get(name) for name in MESSAGES.names())
    about_tasks = {cls for cls in registered if cls is not None and _about_a_task(cls)}
    unhandled = about_tasks - set(TaskRun.ROUTES) - SERVICE_MESSAGES
    assert not unhandled, f"no route for {sorted(c.__name__ for c in unhandled)}: add it to TaskRun.ROUTES"
    assert SERVICE_MESSAGES <= about_tasks and not SERVICE_MESSAGES & set(TaskRun.ROUTES)
