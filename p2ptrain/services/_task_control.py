"""The ``task.*`` control ops: what ``p2ptrain task ...`` asks a running node.

Each op takes the request's JSON, checks it (it comes from the local control socket, still a user's
input: one clear error, nothing half-done) and acts through the node's :class:`TaskService`, which
holds the tasks this node knows and runs. Kept apart from the service: the service is what the
network drives (announcements, heads, joins); these are what the user drives.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import trio

from p2ptrain.base import UserError, short_id, write_atomic
from p2ptrain.control import ops as control_ops
from p2ptrain.ipfs import ContentUnavailable, dag_bytes_limit, requested_cid
from p2ptrain.models import model_file_limit
from p2ptrain.node import DEFAULT_MAX_FETCH_BYTES
from p2ptrain.run import RunDir
from p2ptrain.services._latest import LatestFinder
from p2ptrain.services._tasks import MAX_CONCURRENT_JOINS, KnownTask, TaskService
from p2ptrain.task import MAX_TASK_BYTES, Task, TaskError, load_task, task_bytes
from p2ptrain.wire import TASKS_TOPIC, TaskAnnounce, TaskCancel, TaskResume

logger = logging.getLogger(__name__)

# `task status` of a task this node is not a member of looks its latest chain up and verifies it for
# this long by default (a request may say less, up to MAX_VERIFY_HEAD_S): a run under way publishes
# a head every 2 s, and a finished run's members answer a request within a second.
VERIFY_HEAD_S = 10.0
MAX_VERIFY_HEAD_S = 60.0


class TaskControl:
    """Registers the ``task.*`` ops on the node's control socket, served by ``tasks``."""

    def __init__(self, tasks: TaskService) -> None:
        self.tasks = tasks
        for op, handler in (
            (control_ops.TASK_PUBLISH, self.publish),
            (control_ops.TASK_JOIN, self.join),
            (control_ops.TASK_LIST, self.list_tasks),
            (control_ops.TASK_STATUS, self.status),
            (control_ops.TASK_CANCEL, self.cancel),
            (control_ops.TASK_RESUME, self.resume),
        ):
            tasks.node.control.register(op, handler)

    async def publish(self, request: dict[str, Any]) -> dict[str, Any]:
        text = request.get("text")
        if not isinstance(text, str) or len(text) > MAX_TASK_BYTES:
            raise UserError(f"a task file must be TOML text of at most {MAX_TASK_BYTES} bytes")
        task = await trio.to_thread.run_sync(load_task, text)  # off the event loop, as TaskService.held_task says
        if task.publisher is None:  # this node's key is the one that may cancel it (task cancel)
            task = replace(task, publisher=self.tasks.node.peer_id.to_base58())
        if task.dataset is not None:
            try:
                await self.tasks.content.fetch(task.dataset.manifest, timeout=float(request.get("timeout", 30.0)))
            except ContentUnavailable as exc:
                raise TaskError(f"dataset.manifest: {exc}; add it first with: p2ptrain dataset add") from None
        if task.initial_model:  # a registry model's: within what a model of the task's architecture takes
            limit = DEFAULT_MAX_FETCH_BYTES if task.model.user else dag_bytes_limit(
                await trio.to_thread.run_sync(model_file_limit, task.model.name, task.model.arguments))
            try:
                await self.tasks.content.fetch(task.initial_model, max_bytes=limit)
            except ContentUnavailable as exc:
                raise TaskError(f"initial_model: {exc}") from None
        task_cid = await trio.to_thread.run_sync(self.tasks.content.store.add_bytes, task_bytes(task))
        await trio.to_thread.run_sync(self.tasks.content.store.pin_add, task_cid)
        known = self.tasks.remember(task_cid, task.name, self.tasks.node.peer_id.to_base58())
        known.total_steps = task.training.total_steps  # None for a task that counts epochs
        await self.tasks.node.publish(TASKS_TOPIC, TaskAnnounce(task_cid=task_cid, name=task.name))
        joined = False
        if self.tasks.options.accept_tasks or request.get("join"):
            await self.tasks.join(task_cid, task)  # the task just parsed and stored: not read back by CID
            joined = True
        logger.info("node %s published task %s as %s", short_id(self.tasks.node.peer_id), task.name, task_cid)
        return {"task_cid": task_cid, "name": task.name, "joined": joined}

    async def join(self, request: dict[str, Any]) -> dict[str, Any]:
        run = await self.tasks.join(str(request.get("task_cid", "")))
        return {"task_cid": run.task_cid, "name": run.shared.task.name}

    async def list_tasks(self, request: dict[str, Any]) -> dict[str, Any]:
        tasks = {cid: known.status().to_json() for cid, known in self.tasks.known.items()}
        for cid, run in self.tasks.runs.items():
            tasks[cid] = run.status().to_json()
        return {"tasks": list(tasks.values()), "joins": self.tasks.joins()}

    async def cancel(self, request: dict[str, Any]) -> dict[str, Any]:
        """`task cancel`: announce the cancel of a task this node published (members check the key)."""
        task_cid = requested_cid(request.get("task_cid", ""))
        reason = str(request.get("reason") or "")[:256]
        run = self.tasks.runs.get(task_cid)
        task = await self._task_of(task_cid)
        me = self.tasks.node.peer_id.to_base58()
        if task.publisher != me:
            raise UserError(f"only the task's publisher ({task.publisher or 'none named'}) can cancel it; "
                            f"this node is {me}")
        msg = TaskCancel(task_cid=task_cid, reason=reason)
        run_dir = RunDir.of(self.tasks.node.home, task_cid)
        run_dir.path.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir.cancelled, (reason or "cancelled by the publisher").encode(), mode=0o600)
        write_atomic(run_dir.cancel_sent, b"", mode=0o600)
        await self.tasks.node.publish(TASKS_TOPIC, msg)
        if run is not None:
            await run.on_message(me, msg)  # pubsub does not deliver our own message back to us
        logger.info("node %s cancelled task %s", short_id(self.tasks.node.peer_id), task_cid)
        return {"task_cid": task_cid, "cancelled": True}

    async def resume(self, request: dict[str, Any]) -> dict[str, Any]:
        """`task resume`: announce that this node, the task's publisher, continues a run it
        cancelled; the members (and this node, if it is one) resume it from their chains."""
        task_cid = requested_cid(request.get("task_cid", ""))
        task = await self._task_of(task_cid)
        me = self.tasks.node.peer_id.to_base58()
        if task.publisher != me:
            raise UserError(f"only the task's publisher ({task.publisher or 'none named'}) can resume it; "
                            f"this node is {me}")
        run_dir = RunDir.of(self.tasks.node.home, task_cid)
        run_dir.cancel_sent.unlink(missing_ok=True)  # joiners are no longer told it is cancelled
        await self.tasks.node.publish(TASKS_TOPIC, TaskResume(task_cid=task_cid))
        await self.tasks.resume_here(task_cid, me)  # pubsub does not deliver our own message back to us
        run_dir.cancelled.unlink(missing_ok=True)  # a publisher that is no member: no run to resume
        logger.info("node %s resumed task %s", short_id(self.tasks.node.peer_id), task_cid)
        return {"task_cid": task_cid, "resumed": True}

    async def _task_of(self, task_cid: str) -> Task:
        """The task ``task_cid`` (from its run here, else fetched by CID, bounded)."""
        run = self.tasks.runs.get(task_cid)
        if run is not None:
            return run.shared.task
        return await self.tasks.fetch_task(task_cid)

    async def status(self, request: dict[str, Any]) -> dict[str, Any]:
        task_cid = str(request.get("task_cid", ""))
        run = self.tasks.runs.get(task_cid)
        if run is not None:
            return run.status().to_json()
        known = self.tasks.known.get(task_cid)
        timeout = request.get("timeout")
        if known is None and isinstance(timeout, (int, float)):
            # A lookup asked for (`model fetch --latest`, `model verify`) of a task announced before
            # this node started: the task by CID from the peers, then its chain, as a fresh home's
            # temporary node finds them (it said "this node has not heard of task ...").
            try:
                task = await self.tasks.fetch_task(requested_cid(task_cid))
            except ContentUnavailable as exc:
                raise UserError(f"this node has not heard of task {task_cid}, and its peers do not hold it: "
                                f"{exc.reason}") from None
            known = self.tasks.remember(task_cid, task.name, task.publisher or "")
            known.total_steps = task.training.total_steps
        if known is None:
            raise UserError(f"this node has not heard of task {task_cid}")
        # A lookup when asked for one (a timeout given: `model fetch --latest`, `model verify`), or
        # when a head claimed a confirmed model: a task only announced has nothing to verify yet.
        if isinstance(timeout, (int, float)) or (known.head is not None and known.head.version >= 1):
            await self._verify_latest(known, float(timeout) if isinstance(timeout, (int, float)) else VERIFY_HEAD_S)
        return known.status().to_json()

    async def _verify_latest(self, known: KnownTask, timeout: float) -> None:
        """Look up and verify the latest chain of a task this node is not a member of (the same
        :class:`LatestFinder` as a fresh home's ``model fetch --latest``): heads heard meanwhile are
        judged by the chains they name, and the longest that verifies becomes ``known.verified``."""
        if known.task_cid in self.tasks.finders or len(self.tasks.finders) >= MAX_CONCURRENT_JOINS:
            return  # one lookup per task at a time, a few at once: the busy ones answer with what is known
        finder = LatestFinder(self.tasks.node, self.tasks.content, known.task_cid, listen=False)
        self.tasks.finders[known.task_cid] = finder
        if known.head is not None:
            finder.offer(known.head)
        try:
            with trio.move_on_after(min(max(timeout, 0.0), MAX_VERIFY_HEAD_S)):
                await finder.find()
        except (ContentUnavailable, TaskError) as exc:
            logger.warning("node %s cannot verify the chain of task %s: %s", short_id(self.tasks.node.peer_id),
                           known.task_cid, exc)
        finally:
            del self.tasks.finders[known.task_cid]
        if finder.best is not None and (known.verified is None or finder.best[1].version > known.verified.version):
            known.verified, known.verified_cid = finder.best[1], finder.best[0].chain_cid
