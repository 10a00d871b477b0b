"""Finding the latest confirmed model of a task: ask, then verify what is told.

``model fetch --latest TASK`` (from a fresh home, or through a node that takes no part in the run)
asks the mesh (a :class:`~p2ptrain.wire.HeadRequest` on the tasks topic, again every
HEAD_REQUEST_EVERY_S) and hears :class:`~p2ptrain.wire.TaskHead` answers: from the
coordinator of a run under way, or from any member of a run that is over
(:mod:`p2ptrain.services._head_answers`). Anyone can publish a head, so nothing a head says is
believed: only the chain it names counts. That chain is fetched (bounded) and verified against the
task's own rules (:class:`~p2ptrain.protocol.ChainRules`, from the task fetched by its CID):
every record signed by a coordinator that a quorum of the record's members elected, attested by a
quorum of them, each the child of the one before. The chain's own head is the answer, whatever
version or model the head claimed. Of the chains that verify the longest wins; a head is judged
once per chain it names (not per claim), so a head that lies about a real chain costs nothing and
hides nothing. Two verified chains that fork are counted and logged; the longer is taken.

Holders are found through the Kad-DHT too: a node that holds a task's chain (a member of its run,
also after the run and after a restart) announces :func:`head_key` of the task, and the fetcher
looks that key up and dials the holders it names, so its requests reach a holder that shares no
pubsub mesh with the node it bootstrapped from. What a holder then answers is verified as above.

What the check cannot tell for a task with open admission: that the identities that signed a chain
are distinct people. A chain forged by enough made-up identities verifies; docs/security.md says
what that means and how ``admission = "allowlist"`` closes it.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import trio

from p2ptrain.ipfs import ContentUnavailable
from p2ptrain.mesh import derived_key
from p2ptrain.node import ContentService, Node
from p2ptrain.protocol import Chain, ChainRules, MAX_CHAIN_BYTES, RecordError, read_chain
from p2ptrain.run import RunDir
from p2ptrain.task import MAX_TASK_BYTES, TaskError, read_task
from p2ptrain.wire import HeadRequest, Signed, TASKS_TOPIC, TaskHead

logger = logging.getLogger(__name__)

# The fetcher asks again this often until a head verifies: a request published before the mesh
# formed is lost, and an answering node rate-limits itself to one answer per second per task.
HEAD_REQUEST_EVERY_S = 2.0
# Once one head verified, the fetcher listens this much longer for a longer chain (another member
# that saw one more checkpoint), then takes the longest.
HEAD_COLLECT_S = 1.0
# Heads queued for verification; more arriving meanwhile are dropped (counted "busy"): each costs a
# chain fetch, and a flood of fake heads must not queue fetches without end.
MAX_QUEUED_HEADS = 16
# Distinct chains remembered as judged; past this, new ones are dropped (counted "busy"): a flood of
# made-up heads cannot grow the fetcher's memory without end.
MAX_SEEN_HEADS = 1024
# Each chain (or task) fetch stops after this long (a head naming content nobody serves).
CHAIN_FETCH_TIMEOUT_S = 10.0
# The fetcher looks the task's head key up on the DHT again this often (each lookup bounded by
# providers.FIND_DEADLINE_S, each names at most providers.MAX_PROVIDERS_PER_QUERY holders to dial):
# a holder that announced after the last lookup is found by the next.
HEAD_LOOKUP_EVERY_S = 5.0
# Tasks whose heads a node announces at start (one folder each under <home>/tasks): past this, the
# oldest-named are not announced; far above the runs one home takes part in.
MAX_ANNOUNCED_TASKS = 256


def head_key(task_cid: str) -> str:
    """The DHT key under which holders of ``task_cid``'s chain announce themselves."""
    return derived_key("head", task_cid)


def held_tasks(home: Path) -> list[str]:
    """Task CIDs whose confirmed chain this home keeps (``tasks/<task CID>/chain.jsonl``), at most
    MAX_ANNOUNCED_TASKS: the heads a node announces on the DHT when it starts."""
    held = (run.task_cid for run in RunDir.runs(home) if run.chain.is_file())
    return list(itertools.islice(held, MAX_ANNOUNCED_TASKS))


@dataclass
class LatestFinder:
    """Asks for ``task_cid``'s head and verifies the chains heads name; ``refused`` counts those not
    believed. ``listen``: hear heads from the node itself (a fresh home's temporary node); a node's
    task service passes False and hands heads in with :meth:`offer`."""

    node: Node
    content: ContentService
    task_cid: str
    listen: bool = True
    refused: Counter[str] = field(default_factory=Counter)
    best: tuple[TaskHead, Chain] | None = None
    rules: ChainRules | None = None

    def __post_init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[TaskHead](MAX_QUEUED_HEADS)
        self._seen: set[str] = set()  # chain CIDs already judged
        if self.listen:
            self.node.on(TaskHead, self._on_head)

    @property
    def judged(self) -> int:
        """Distinct chains judged so far (at most MAX_SEEN_HEADS)."""
        return len(self._seen)

    @property
    def model_cid(self) -> str | None:
        """The head model of the longest chain verified so far."""
        return self.best[1].head_cid if self.best is not None and self.best[1].version else None

    def forget_judged(self) -> None:
        """Forget which chains were judged, keeping the best: a finder that lives as long as a
        server (``model serve --latest``, serve/_temporary.py) or a node calls this now and then, so
        MAX_SEEN_HEADS bounds its memory, not how many checkpoints it can follow."""
        self._seen.clear()

    def _on_head(self, signed: Signed[TaskHead], topic: str) -> None:
        self.offer(signed.msg)

    def offer(self, head: TaskHead) -> None:
        """A head heard: its chain is judged once (by chain CID, whatever the head claims)."""
        if head.task_cid != self.task_cid or head.version < 1 or head.chain_cid in self._seen:
            return
        if len(self._seen) >= MAX_SEEN_HEADS:
            self.refused["busy"] += 1
            return
        self._seen.add(head.chain_cid)
        try:
            self._send.send_nowait(head)
        except trio.WouldBlock:
            self._seen.discard(head.chain_cid)  # not judged: a later head naming it is taken up
            self.refused["busy"] += 1

    async def find(self) -> tuple[TaskHead, Chain]:
        """The verified chain that is longest, with the head that named it (unbounded: the caller
        bounds it). :class:`ContentUnavailable` or :class:`TaskError` when the task itself cannot be
        had: its rules are what every chain is checked against. The task is fetched when the first
        head arrives: a peer that answers is connected then, and has the task if it ran it."""
        failure: ContentUnavailable | TaskError | None = None
        if self.listen:  # heads come on the tasks topic, which a node without a task service never joined
            await self.node.subscribe(TASKS_TOPIC)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ask)
            nursery.start_soon(self._find_holders)
            try:
                await self._collect()
            except (ContentUnavailable, TaskError) as exc:  # raised as itself, not in a nursery's group
                failure = exc
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        assert self.best is not None
        return self.best

    async def _collect(self) -> None:
        """Judge heads until one verifies, then those that arrive for HEAD_COLLECT_S more."""
        async for head in self._recv:
            if await self._judge(head):
                break
        with trio.move_on_after(HEAD_COLLECT_S):
            async for head in self._recv:
                await self._judge(head)

    async def _load_rules(self) -> None:
        """The task, by CID (verified as every fetch is), for the rules its chains must follow."""
        if self.rules is not None:
            return
        store = self.content.store
        await self.content.fetch(self.task_cid, timeout=CHAIN_FETCH_TIMEOUT_S, max_bytes=MAX_TASK_BYTES)
        data = await trio.to_thread.run_sync(lambda: store.cat(self.task_cid, max_bytes=MAX_TASK_BYTES + 1))
        task = await trio.to_thread.run_sync(read_task, data)  # its builder not needed; a parse counts the model
        self.rules = ChainRules.of(task, self.task_cid)

    async def _ask(self) -> None:
        while True:
            await self.node.publish(TASKS_TOPIC, HeadRequest(task_cid=self.task_cid))
            await trio.sleep(HEAD_REQUEST_EVERY_S)

    async def _find_holders(self) -> None:
        """Dial the holders the DHT names for the task's head key (none without the DHT): once
        connected, the next head request reaches them."""
        routing = self.content.routing
        if routing is None:
            return
        key = head_key(self.task_cid)
        while True:
            assert self.node.host is not None
            holders = await routing.find(key, exclude=set(self.node.host.get_connected_peers()))
            async with trio.open_nursery() as nursery:
                for info in holders:
                    nursery.start_soon(routing.connect, info)
            await trio.sleep(HEAD_LOOKUP_EVERY_S)

    async def _judge(self, head: TaskHead) -> bool:
        """Verify the chain ``head`` names; True when it verified (kept as the best if longest)."""
        await self._load_rules()
        chain = await self._verify(head)
        if chain is None:
            return False
        if self.best is not None:
            longer, shorter = (chain, self.best[1]) if chain.version > self.best[1].version else (self.best[1], chain)
            try:
                shorter.extension(longer)
            except RecordError as exc:  # two chains that each verify: the longer is taken
                self.refused["fork"] += 1
                logger.warning("task %s: two verified chains fork (%s); taking the longer, v%d", self.task_cid,
                               exc, longer.version)
        if self.best is None or chain.version > self.best[1].version:
            self.best = (head, chain)
        return True

    async def _verify(self, head: TaskHead) -> Chain | None:
        """The chain ``head`` names, fetched and verified, or None (counted by why)."""
        assert self.rules is not None
        store, rules = self.content.store, self.rules
        try:
            await self.content.fetch(head.chain_cid, timeout=CHAIN_FETCH_TIMEOUT_S, max_bytes=MAX_CHAIN_BYTES)
            data = await trio.to_thread.run_sync(lambda: store.cat(head.chain_cid, max_bytes=MAX_CHAIN_BYTES))
            return await trio.to_thread.run_sync(read_chain, self.task_cid, data, rules)
        except ContentUnavailable as exc:
            self.refused["chain_unavailable"] += 1
            logger.warning("head of task %s names a chain nobody served: %s", self.task_cid, exc)
        except RecordError as exc:
            self.refused["bad_chain"] += 1
            logger.warning("refused a chain of task %s (a head claimed model v%d): %s", self.task_cid,
                           head.version, exc)
        return None
