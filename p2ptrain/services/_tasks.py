"""The node's task service: publish tasks, hear announcements, join the ones that fit, report status.

A task is its canonical bytes stored by CID. Publishing validates the file, checks that its dataset
can be had, stores the bytes and announces ``(task CID, name)`` on the tasks topic. A node joins a
task when told to (``--join CID``), or on an announcement when it accepts tasks (``--accept-tasks``)
and meets the task's requirements; joining means fetching the task by CID (verified like every
other byte) and running a :class:`~p2ptrain.run.TaskRun` for it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from p2ptrain.collective import Collective
from p2ptrain.base import UserError, short_id
from p2ptrain.ipfs import ContentUnavailable, InvalidCID, requested_cid
from p2ptrain.mesh import Rate
from p2ptrain.control import FINISHED, Phase, TaskStatus
from p2ptrain.node import ContentService, Node
from p2ptrain.run import RunDir, TaskRun
from p2ptrain.services._head_answers import HeadAnswers
from p2ptrain.services._join_memory import JoinMemory
from p2ptrain.services._latest import LatestFinder, head_key, held_tasks
from p2ptrain.models import builders
from p2ptrain.training import Trainer
from p2ptrain.protocol import Chain
from p2ptrain.task import (MAX_TASK_BYTES, NoBuilder, Task, member_device, task_from_bytes, unmet_requirement)
from p2ptrain.wire import (
    HeadRequest,
    Signed,
    TASKS_TOPIC,
    TaskAnnounce,
    TaskCancel,
    TaskHead,
    TaskResume,
    task_topic,
)

logger = logging.getLogger(__name__)

MAX_KNOWN_TASKS = 256
# Joins from announcements in flight at once. A join is a fetch of at most MAX_TASK_BYTES and a parse,
# so 4 keep up with any honest mesh; a flood of announced CIDs beyond that is refused (counted "busy")
# instead of piling up fetches and worker threads. Coordinators re-announce their task every few
# seconds, so an honest task refused while busy is joined on a later announcement.
MAX_CONCURRENT_JOINS = 4
# ``--join`` on a home that does not hold the task: it comes from peers, so the join waits this long
# for one to be in view, and a join that found nobody holding it yet is tried again JOIN_RETRIES times,
# JOIN_RETRY_S apart (the others may still be starting: a power cut, every machine at once).
JOIN_PEER_WAIT_S = 60.0
JOIN_RETRIES = 5
JOIN_RETRY_S = 5.0
# A join from an announcement fetches a file of at most MAX_TASK_BYTES: if that takes longer than
# this, the announcer (or its content) is not worth waiting for.
JOIN_FETCH_TIMEOUT_S = 30.0
# A task that needs CUDA, on a node whose quick probe saw no GPU, waits this long for the torch probe
# (it starts 2 s after the node and imports torch: seconds) before it is refused.
CAPS_PROBE_WAIT_S = 30.0
# A run in one of these states does not hold the run's state yet: its node answers head requests from
# the chain on its disk, so members that restart together hear each other's chains (run/_resume.py).
STARTING_PHASES = frozenset({Phase.STARTING, Phase.FETCHING, Phase.RESUMING})
# Heads and head requests taken from one sender (issue 27: forged heads at 131/s took a run from
# 17 to 0.3 steps/s, and it never recovered). An honest coordinator sends a task's head every
# HEAD_EVERY_S (2 s) and one at each confirmed checkpoint (up to ~8 a second in a tiny task that
# checkpoints every few 30 ms rounds: 8 at most), a member of a finished run answers at most once a second a
# task, a joiner or fetcher asks every second or two: these leave room for that, and hold a flood
# from one identity to what a node checks and relays in a few ms a second. A head costs a token per
# started 4 KiB: decoding and checking one grows with its member list (a forged head of 1,024
# members, 57 KB, took 10-20 ms here; at 8 a second that held a node's event loop for 0.4-0.7 s at a
# time on the loaded 2-core VM, long enough that members missed each other's heartbeats and
# re-elected). A head of up to ~70 members is one token; the coordinator of a 1,024-member run
# spends 14 every 2 s.
HEAD_RATE = Rate(per_s=8.0, burst=32.0, unit_bytes=4096)
HEAD_REQUEST_RATE = Rate(per_s=4.0, burst=16.0)


@dataclass
class KnownTask:
    """A task this node has heard of, joined or not.

    ``head`` is the latest head heard, a claim anyone can make: it says only whether the run looks
    under way or done. What the run confirmed comes from ``verified``, the longest chain a
    :class:`~p2ptrain.services.LatestFinder` verified for it (``task status`` looks it up).
    """

    task_cid: str
    name: str
    announced_by: str
    head: TaskHead | None = None
    refused: str | None = None  # why this node did not join it
    missing_builder: str | None = None  # the builder it names that this node does not have
    verified: Chain | None = None
    verified_cid: str | None = None  # the CID of ``verified``'s bytes (a head named it)
    # The run's length from the task's definition, where this node read it (it published the task):
    # `task status` of a task announced and not joined had only "step 0/?" to show.
    total_steps: int | None = None

    def status(self) -> TaskStatus:
        head, chain = self.head, self.verified
        last = chain.records[-1].record if chain is not None and chain.records else None
        return TaskStatus(
            task_cid=self.task_cid,
            name=self.name,
            announced_by=self.announced_by,
            member=False,
            state=("done" if head.done else "running") if head else "announced",
            refused=self.refused,
            missing_builder=self.missing_builder,
            version=last.version if last else 0,
            step=last.step if last else 0,
            round=head.round if head else None,
            total_steps=head.total_steps if head else self.total_steps,
            latest_model_cid=last.model_cid if last else None,
            members=tuple(last.members) if last else (),
            chain_cid=self.verified_cid,
        )


@dataclass
class TaskOptions:
    accept_tasks: bool = False
    join: Sequence[str] = ()
    device: str = "auto"
    precision: str = "fp32"


class TaskService:
    """Runs for the node's lifetime: one nursery holds every task this node takes part in."""

    def __init__(self, node: Node, content: ContentService, options: TaskOptions) -> None:
        self.node = node
        self.content = content
        self.options = options
        node.membership.train_on(options.device)  # heartbeats name the GPU it trains on, none for cpu
        self.known: dict[str, KnownTask] = {}
        self.runs: dict[str, TaskRun] = {}
        self.collective: Collective | None = None
        self._nursery: trio.Nursery | None = None
        # Why announcements were not joined, by kind: read by `p2ptrain task list --json` ("joins").
        self.join_rejections: Counter[str] = Counter()
        self._joining: set[str] = set()
        self.join_memory = JoinMemory()  # joins that failed, not tried again for a while
        self.finders: dict[str, LatestFinder] = {}  # task CID -> a lookup of its latest chain under way
        # Runs of the user's own model this process takes part in: task CID -> the trainer maker
        # (p2ptrain.Optimizer binds one before it joins; training/_user_trainer.py).
        self.bindings: dict[str, Callable[[int], Trainer]] = {}
        node.on(TaskAnnounce, self._on_announce)
        node.on(TaskHead, self._on_head)
        node.on(TaskCancel, self._on_cancel)
        node.on(TaskResume, self._on_resume)
        self.head_answers = HeadAnswers(node.home, content.store, self._under_way, self._total_steps,
                                        lambda head: node.publish(TASKS_TOPIC, head))
        node.on(HeadRequest, self._on_head_request)
        node.limit(TaskHead, HEAD_RATE)
        node.limit(HeadRequest, HEAD_REQUEST_RATE)
        # A run's own messages, on its task's topic, go to the run of their task (TaskRun.ROUTES says
        # which part handles each); a head and a cancel come on the tasks topic, to the handlers above.
        for msg_type in TaskRun.ROUTES.keys() - {TaskHead, TaskCancel}:
            node.on(msg_type, self._on_task_message)
        node.add_status("tasks", self._node_status)

    def joins(self) -> dict[str, Any]:
        return {"joining": len(self._joining), "remembered_failures": len(self.join_memory),
                "rejected": dict(self.join_rejections)}

    def _node_status(self) -> dict[str, Any]:
        """Joins refused and the collective's inbound refusals, for `node status`."""
        return {"joins": self.joins(), "collective": self.collective.hub.stats() if self.collective else None,
                "head_requests": dict(self.head_answers.stats)}

    def _running(self, task_cid: str) -> bool:
        """Whether this node's run of ``task_cid`` is under way (not done, cancelled, failed or stopped)."""
        run = self.runs.get(task_cid)
        return run is not None and run.shared.phase not in FINISHED

    def _under_way(self, task_cid: str) -> bool:
        """Whether this node's run of ``task_cid`` holds (or is getting) the run's state: then its
        coordinator's heads are the run's, and this node answers no head request for it. A run that
        resumed and has accepted no coordinator yet is not: the members resuming after it need its
        head (run/_resume.py, :meth:`Resume.answers_heads`)."""
        run = self.runs.get(task_cid)
        return run is not None and run.shared.phase not in FINISHED | STARTING_PHASES and not run.resume.answers_heads()

    def _total_steps(self, task_cid: str) -> int | None:
        run = self.runs.get(task_cid)
        return run.shared.total_steps if run is not None and run.shared.total_steps else None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        assert self.node.host is not None
        self.collective = Collective(self.node.host)
        await self.node.subscribe(TASKS_TOPIC)
        # Runs this home took part in stay findable by task CID through the DHT (services/_latest.py).
        for task_cid in await trio.to_thread.run_sync(held_tasks, self.node.home):
            self.content.announce(head_key(task_cid))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._advertise_builders)
            for cid in self.options.join:
                nursery.start_soon(self._join_named, cid)
            task_status.started()
            await trio.sleep_forever()

    async def _advertise_builders(self) -> None:
        """Put the builders this node has in its heartbeats: loading installed packages' builders
        imports them (torchvision: seconds), so in a worker thread, once the node is up."""
        names = await trio.to_thread.run_sync(lambda: sorted(builders()), abandon_on_cancel=True)
        self.node.membership.builders = tuple(names)
        self.node.membership.poke()

    # -- joining -------------------------------------------------------------------------------

    async def join(self, task_cid: str, task: Task | None = None) -> TaskRun:
        """Fetch the task by CID, check it fits this node, and start taking part in it. ``task``:
        the task those bytes are, when this node just made them (``task publish``): not read back."""
        if task_cid in self.runs:
            return self.runs[task_cid]
        requested_cid(task_cid)
        if task is None:
            try:
                task = await self.fetch_task(task_cid)
            except NoBuilder as exc:  # a sound task this node cannot build: say what to install
                raise UserError(exc.line) from exc
        caps = self.node.membership.caps
        device = member_device(task, self.options.device)
        if task.requirements.device == "cuda" and device != "cpu" and caps.device == "cpu":  # maybe not probed yet
            with trio.move_on_after(CAPS_PROBE_WAIT_S):
                caps = await self.node.membership.caps_known()
        why = unmet_requirement(task, caps)
        if why is None and task.requirements.device == "cuda" and device == "cpu":
            why = "task needs a CUDA device, and this node trains on the CPU (--device cpu)"
        if why is None and device == "cpu" and self.options.precision == "fp16":
            why = f"task trains on the CPU (requirements.device = {task.requirements.device}), and fp16 needs CUDA"
        if why is None and not task.peers.admits(self.node.peer_id.to_base58()):
            why = "the task admits only the peers on its allowlist (peers.allow), and this node is not one"
        if why is None and task.model.user and task_cid not in self.bindings:
            why = ("it trains the members' own model: only a process running its script takes part "
                   "(p2ptrain.Optimizer or p2ptrain.train), no node joins it by itself")
        if why is not None:
            raise UserError(f"this node cannot take part in task {task.name} ({task_cid}): {why}")
        if task_cid in self.runs:  # joined meanwhile
            return self.runs[task_cid]
        if self._cancelled_here(task_cid):
            raise UserError(f"task {task.name} ({task_cid}) was cancelled by its publisher")
        assert self.collective is not None and self._nursery is not None
        run = TaskRun(self.node, self.content, self.collective, task, task_cid,
                      device=device, precision=self.options.precision,
                      make_trainer=self.bindings.get(task_cid))
        self.runs[task_cid] = run
        self.join_memory.joined(task_cid)
        known = self.known.get(task_cid)
        if known is not None:
            known.refused = known.missing_builder = None
        if known is not None and known.head is not None:
            await run.on_message(known.announced_by, known.head)  # what we heard before joining
        await self.node.subscribe(task_topic(task_cid))
        self._nursery.start_soon(run.run, name=f"task:{task_cid[:12]}")
        self.content.announce(head_key(task_cid))  # a member keeps the run's chain: findable by task CID
        return run

    def _cancelled_here(self, task_cid: str) -> bool:
        """Whether this home heard (or, as publisher, sent) the task's cancel: it never runs it again."""
        return RunDir.of(self.node.home, task_cid).cancelled.is_file()

    async def fetch_task(self, task_cid: str) -> Task:
        """The task ``task_cid``, fetched by CID (at most MAX_TASK_BYTES, within JOIN_FETCH_TIMEOUT_S)
        and parsed off the event loop (:meth:`held_task`)."""
        await self.content.fetch(task_cid, timeout=JOIN_FETCH_TIMEOUT_S, max_bytes=MAX_TASK_BYTES)
        return await trio.to_thread.run_sync(self.held_task, task_cid)

    def held_task(self, task_cid: str) -> Task:
        """The task held here by CID, parsed: in a worker thread, since the parse builds the model on
        the meta device to count it (seconds for a deep hf config, or a package's first import) and
        the node's heartbeats and rounds run on the event loop. The bytes are read no further than
        MAX_TASK_BYTES + 1 (enough to refuse a bigger one): a DAG that claims more, or hides a bomb,
        fails on its declared sizes before it is walked."""
        return task_from_bytes(self.content.store.cat(task_cid, max_bytes=MAX_TASK_BYTES + 1))

    async def _join_quietly(self, task_cid: str) -> Exception | None:
        """Join from an announcement or ``--join``: the one boundary of the join path.

        Whatever goes wrong (a bad CID, content that is not a task, a DAG bomb, a bug) is a counted,
        logged refusal of this task, remembered for a while (services/_join_memory.py); never a node exit. The
        failure is returned (None: joined).
        """
        self._joining.add(task_cid)
        try:
            await self.join(task_cid)
            return None
        except Exception as exc:
            kind = "refused" if isinstance(exc, (UserError, ContentUnavailable)) else type(exc).__name__
            self.join_rejections[kind] += 1
            self.join_memory.failed(task_cid, trio.current_time(), unavailable=isinstance(exc, ContentUnavailable))
            known = self.known.get(task_cid)
            if known is not None:
                known.refused = str(exc)[:500]
                cause = exc.__cause__
                known.missing_builder = cause.builder if isinstance(cause, NoBuilder) else None
            if kind == "refused":
                logger.warning("node %s does not join task %s: %s", short_id(self.node.peer_id), task_cid, exc)
            else:
                logger.warning("node %s does not join task %s (%s): %s", short_id(self.node.peer_id), task_cid, kind, exc,
                               exc_info=not isinstance(exc, ValueError))
            return exc
        finally:
            self._joining.discard(task_cid)

    async def _join_named(self, task_cid: str) -> None:
        """``--join``: a home that does not hold the task gets it from peers, so the join waits for
        one to be in view (at most JOIN_PEER_WAIT_S: a node started at the same time as the others,
        after a power cut, or on a new home); a join that still found nobody holding the task is
        tried again, JOIN_RETRY_S apart, JOIN_RETRIES times."""
        if not self.content.store.has(task_cid):
            with trio.move_on_after(JOIN_PEER_WAIT_S):
                await self.node.membership.wait_until(lambda m: bool(m.alive()))
        for _ in range(JOIN_RETRIES):
            if not isinstance(await self._join_quietly(task_cid), ContentUnavailable):
                return
            await trio.sleep(JOIN_RETRY_S)

    def _should_join(self, task_cid: str) -> bool:
        """Whether an announcement of ``task_cid`` starts a join now; counts why not when it does not."""
        if task_cid in self.runs or task_cid in self._joining:
            return False
        if self.join_memory.held_off(task_cid, trio.current_time()):
            self.join_rejections["recently_failed"] += 1
            return False
        if len(self._joining) >= MAX_CONCURRENT_JOINS:
            self.join_rejections["busy"] += 1
            return False
        return True

    # -- messages ------------------------------------------------------------------------------

    def remember(self, task_cid: str, name: str, sender: str) -> KnownTask:
        known = self.known.get(task_cid)
        if known is None:
            if len(self.known) >= MAX_KNOWN_TASKS:
                self.known.pop(next(iter(self.known)))
            known = self.known[task_cid] = KnownTask(task_cid, name, sender)
        return known

    async def _on_announce(self, signed: Signed[TaskAnnounce], topic: str) -> None:
        msg = signed.msg
        new = msg.task_cid not in self.known
        self.remember(msg.task_cid, msg.name, signed.sender.to_base58())
        if new:
            logger.info("node %s heard of task %s (%s) from %s", short_id(self.node.peer_id), msg.name,
                        msg.task_cid, short_id(signed.sender))
        if self.options.accept_tasks and self._nursery is not None and self._should_join(msg.task_cid):
            self._joining.add(msg.task_cid)  # counted from now: a burst cannot start more than the cap
            self._nursery.start_soon(self._join_quietly, msg.task_cid)

    async def _on_head(self, signed: Signed[TaskHead], topic: str) -> None:
        head = signed.msg
        known = self.known.get(head.task_cid)
        if known is not None and (known.head is None or (head.version, head.step) >= (known.head.version, known.head.step)):
            known.head = head
        finder = self.finders.get(head.task_cid)
        if finder is not None:
            finder.offer(head)
        run = self.runs.get(head.task_cid)
        if run is not None and self._running(head.task_cid):  # an ended run acts on no head
            await run.on_message(signed.sender.to_base58(), head)

    def _on_head_request(self, signed: Signed[HeadRequest], topic: str) -> None:
        if topic != TASKS_TOPIC or self._nursery is None:
            return
        self.head_answers.on_request(signed.msg, self._nursery)
        if self.head_answers.may_repeat_cancel(signed.msg.task_cid):
            # Only the publisher can sign a cancel: its node tells whoever asks about the task (a
            # joiner) that it is cancelled, once per HEAD_ANSWER_EVERY_S at most.
            reason = RunDir.of(self.node.home, signed.msg.task_cid).cancelled.read_bytes()[:256]
            self._nursery.start_soon(self.node.publish, TASKS_TOPIC,
                                     TaskCancel(task_cid=signed.msg.task_cid, reason=reason.decode(errors="replace")))

    async def _on_cancel(self, signed: Signed[TaskCancel], topic: str) -> None:
        """A task's cancel: its run (if we take part) checks that the publisher sent it."""
        run = self.runs.get(signed.msg.task_cid)
        if run is not None:
            await run.on_message(signed.sender.to_base58(), signed.msg)

    async def _on_resume(self, signed: Signed[TaskResume], topic: str) -> None:
        """A task's resume: obeyed for a run this home cancelled, and only from the task's publisher."""
        if topic == TASKS_TOPIC:
            await self.resume_here(signed.msg.task_cid, signed.sender.to_base58())

    async def resume_here(self, task_cid: str, sender: str) -> None:
        """Forget the cancel of ``task_cid`` and resume its run from this home's chain, if ``sender``
        is the publisher its task file names; anyone else's resume is refused and counted (in the
        run's status, ``rejected``, and in ``task list --json``, ``joins``). A run this home never
        cancelled ignores it."""
        run = self.runs.get(task_cid)
        try:
            run_dir = RunDir.of(self.node.home, task_cid)  # the CID parsed before it names a folder on disk
        except InvalidCID:
            return  # no task of ours is named so
        if run is None or run.shared.cancel_reason is None:
            held = run_dir.chain.is_file() and self.content.store.has(task_cid)
            if run is not None or not run_dir.cancelled.is_file() or not held:
                return  # no run of ours to resume (only a task held here is read, never fetched for a stranger)
        task = run.shared.task if run is not None else await trio.to_thread.run_sync(self.held_task, task_cid)
        if task.publisher is None or sender != task.publisher:
            why = "the task names no publisher" if task.publisher is None else "not the task's publisher"
            self.join_rejections["resume_refused"] += 1
            if run is not None:
                run.shared.refuse("resume", f"refused a resume from {short_id(sender)}: {why}")
            else:
                logger.warning("node %s refused a resume of task %s from %s: %s", short_id(self.node.peer_id),
                               task_cid, short_id(sender), why)
            return
        run_dir.cancelled.unlink(missing_ok=True)
        if run is not None and run.shared.phase not in FINISHED:
            run.shared.uncancel()  # the cancel had not settled yet: the run simply goes on
            return
        self.runs.pop(task_cid, None)
        logger.info("node %s resumes task %s: its publisher continues it", short_id(self.node.peer_id), task_cid)
        await self._join_quietly(task_cid)  # the join path's one boundary: a failure is counted, logged

    async def _on_task_message(self, signed: Signed[Any], topic: str) -> None:
        run = self.runs.get(signed.msg.task_cid)
        if run is not None and topic == run.shared.topic:
            await run.on_message(signed.sender.to_base58(), signed.msg)
