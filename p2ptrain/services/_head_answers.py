"""Finished runs stay findable: a member answers a head request for a task it took part in.

While a run goes on, its coordinator publishes the run's head every ``HEAD_EVERY_S``; once it ends,
nobody does, and ``model fetch --latest TASK`` from a fresh home heard nothing. So every node that
holds a task's confirmed chain (``<home>/tasks/<task CID>/chain.jsonl``, kept by every member, also
after a restart) and whose run of it is not under way answers a
:class:`~p2ptrain.wire.HeadRequest` with a :class:`~p2ptrain.wire.TaskHead` of
its own. A member of a run under way stays quiet: its coordinator's heads are the ones members act
on, and an extra head from a non-coordinator would only be refused (and counted) by them. A member
still starting (or resuming its chain after a stop, or resumed with no coordinator accepted yet) is
not under way yet and answers: that is how the members of a run stopped whole hear each other's
chains when they come back, also those that come back later than the others (run/_resume.py).

The answer is a claim, not proof: the fetcher re-verifies the chain it names (signatures, links,
the head model) before it believes it (cli/model.py). Requests come from anyone, so answers are
rate-limited per task and the chain is read from disk once per change of the file.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import trio

from p2ptrain.ipfs import ContentStore, InvalidCID
from p2ptrain.protocol import RecordError, read_chain
from p2ptrain.run import RunDir
from p2ptrain.wire import HeadRequest, TaskHead

logger = logging.getLogger(__name__)

# A task's head is published in answer at most once per this many seconds, whoever asks and however
# often: a flood of requests costs each answering node one small message per task per second, and a
# fetcher asks again every HEAD_REQUEST_EVERY_S (cli/model.py, 2 s), so one answer per second is enough.
HEAD_ANSWER_EVERY_S = 1.0
# Tasks whose last answer time is remembered (oldest forgotten first): only tasks with a chain on
# this node's disk are answered, so this bounds nothing an honest node reaches; it caps the map.
MAX_ANSWERED_TASKS = 1024


class HeadAnswers:
    """Answers head requests from the chains on this node's disk; counts what it did in ``stats``."""

    def __init__(self, home: Path, store: ContentStore, running: Callable[[str], bool],
                 total_steps: Callable[[str], int | None], publish: Callable[[TaskHead], object]) -> None:
        """``running(task_cid)``: whether this node's run of the task is under way (then it stays
        quiet). ``total_steps(task_cid)``: the run's length where this node still knows it (its run
        since the node started), else None. ``publish(head)``: an async callable that publishes on
        the tasks topic."""
        self.home = Path(home)
        self.store = store
        self.running = running
        self.total_steps = total_steps
        self.publish = publish
        # answered, rate_limited, running (a run under way), not_held, bad_chain: for `node status`.
        self.stats: Counter[str] = Counter()
        self._last: dict[str, float] = {}  # task CID -> trio time of its last answer
        self._cancels: dict[str, float] = {}  # task CID -> trio time the publisher last repeated its cancel
        self._answering: set[str] = set()  # tasks whose answer is under way (one at a time each)
        self._heads: dict[str, tuple[tuple[int, int], TaskHead]] = {}  # task CID -> ((mtime, size), head)

    def may_repeat_cancel(self, task_cid: str) -> bool:
        """Whether this node (the task's publisher) sent the task's cancel and may repeat it now:
        at most once per HEAD_ANSWER_EVERY_S per task, whoever asks."""
        try:
            run_dir = RunDir.of(self.home, task_cid)  # the CID parsed before it names a folder on disk
        except InvalidCID:
            return False
        if not run_dir.cancel_sent.is_file():
            return False
        now = trio.current_time()
        if now - self._cancels.get(task_cid, -HEAD_ANSWER_EVERY_S) < HEAD_ANSWER_EVERY_S:
            self.stats["cancel_rate_limited"] += 1
            return False
        self._cancels.pop(task_cid, None)
        while len(self._cancels) >= MAX_ANSWERED_TASKS:
            self._cancels.pop(next(iter(self._cancels)))
        self._cancels[task_cid] = now
        self.stats["cancel_repeated"] += 1
        return True

    def on_request(self, request: HeadRequest, nursery: trio.Nursery) -> None:
        """Decide at once (this runs in the tasks topic's reader) whether to answer; the answer (a
        chain read and verified in a worker thread the first time) runs in ``nursery``, at most one
        per task at a time and one per task per HEAD_ANSWER_EVERY_S."""
        task_cid = request.task_cid
        try:
            run_dir = RunDir.of(self.home, task_cid)  # the CID parsed before it names a folder on disk
        except InvalidCID:
            self.stats["not_held"] += 1
            return
        if self.running(task_cid):
            self.stats["running"] += 1
            return
        now = trio.current_time()
        if task_cid in self._answering or now - self._last.get(task_cid, -HEAD_ANSWER_EVERY_S) < HEAD_ANSWER_EVERY_S:
            self.stats["rate_limited"] += 1
            return
        if not run_dir.chain.is_file():
            self.stats["not_held"] += 1
            return
        self._last.pop(task_cid, None)
        while len(self._last) >= MAX_ANSWERED_TASKS:
            self._last.pop(next(iter(self._last)))
        self._last[task_cid] = now
        self._answering.add(task_cid)
        nursery.start_soon(self._answer, task_cid)

    async def _answer(self, task_cid: str) -> None:
        try:
            head = await trio.to_thread.run_sync(self.head_of, task_cid)
            if head is None:
                self.stats["not_held"] += 1
                return
            await self.publish(head)  # type: ignore[misc]
            self.stats["answered"] += 1
        except Exception as exc:  # the boundary: an answer never takes the node down
            known = isinstance(exc, (OSError, RecordError))
            self.stats["bad_chain" if known else type(exc).__name__] += 1
            logger.warning("cannot answer for task %s: %s", task_cid,
                           f"its chain.jsonl cannot be read: {exc}" if known else repr(exc), exc_info=not known)
        finally:
            self._answering.discard(task_cid)

    def head_of(self, task_cid: str) -> TaskHead | None:
        """The head of the confirmed chain this node holds for ``task_cid`` (None: none, or no record
        yet), its bytes stored by CID so a fetcher can get them. Verified once per change of the file."""
        run_dir = RunDir.of(self.home, task_cid)
        try:
            st = run_dir.chain.stat()
        except FileNotFoundError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        cached = self._heads.get(task_cid)
        if cached is not None and cached[0] == key and cached[1].total_steps == (self.total_steps(task_cid) or 0):
            return cached[1]
        data = run_dir.read_chain()
        if data is None or not data.strip():
            return None
        chain = read_chain(task_cid, data)
        last = chain.records[-1].record
        total = self.total_steps(task_cid) or 0  # 0: not known here (read from disk after a restart)
        head = TaskHead(
            task_cid=task_cid, term=last.term, version=chain.version, step=last.step, round=last.round,
            total_steps=total, chain_cid=self.store.add_bytes(chain.to_bytes()), model_cid=last.model_cid,
            optimizer_cid=last.optimizer_cid, members=last.members, done=bool(total) and last.step >= total,
        )
        self._heads.pop(task_cid, None)
        while len(self._heads) >= MAX_ANSWERED_TASKS:
            self._heads.pop(next(iter(self._heads)))
        self._heads[task_cid] = (key, head)
        return head
