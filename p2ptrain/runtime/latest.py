"""Finding the latest confirmed model of a task from a fresh home: ask, then verify what is told.

``model fetch --latest TASK`` from a home that never took part in the run asks the mesh (a
:class:`~p2ptrain.wire.messages.HeadRequest` on the tasks topic, again every HEAD_REQUEST_EVERY_S)
and hears :class:`~p2ptrain.wire.messages.TaskHead` answers: from the coordinator of a run under
way, or from any member of a run that is over (:mod:`p2ptrain.runtime.head_answers`). Anyone can
publish a head, so none is believed as told: the chain it names is fetched (bounded) and
re-verified, every record signed by the coordinator it names, each the child of the one before, of
this task; the head's model must be the chain's head, and each record's signer one of that record's
members. Of the heads that verify, the longest chain wins, and two verified chains that disagree at a
version they both hold (a fork) are refused: the fetch fails rather than pick one.

Holders are found through the Kad-DHT too: a node that holds a task's chain (a member of its run,
also after the run and after a restart) announces :func:`head_key` of the task, and the fetcher
looks that key up and dials the holders it names, so its requests reach a holder that shares no
pubsub mesh with the node it bootstrapped from. What a holder then answers is verified as above.

What a fresh home cannot check: that the signers were *elected* (the vote certificates are not
kept in the chain). So a peer that forged a whole chain of its own for the task would be believed
if no honest holder answered; docs/training.md says so.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import trio

from p2ptrain.ipfs.cid import InvalidCID, parse_cid
from p2ptrain.ipfs.store import ContentUnavailable
from p2ptrain.mesh.providers import derived_key
from p2ptrain.node import Node
from p2ptrain.runtime.content import ContentService
from p2ptrain.training.records import MAX_CHAIN_BYTES, Chain, RecordError, record_from_bytes
from p2ptrain.wire import Signed
from p2ptrain.wire.messages import HeadRequest, TaskHead
from p2ptrain.wire.topics import TASKS_TOPIC

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
# Distinct heads remembered as judged; past this, new ones are dropped (counted "busy"): a flood of
# made-up heads cannot grow the fetcher's memory without end.
MAX_SEEN_HEADS = 1024
# Each chain fetch stops after this long (a head naming content nobody serves).
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
    out: list[str] = []
    tasks = Path(home) / "tasks"
    if not tasks.is_dir():
        return out
    for entry in sorted(tasks.iterdir()):
        try:
            parse_cid(entry.name)
        except InvalidCID:
            continue
        if (entry / "chain.jsonl").is_file():
            out.append(entry.name)
            if len(out) >= MAX_ANNOUNCED_TASKS:
                break
    return out


@dataclass
class LatestFinder:
    """Asks for ``task_cid``'s head and verifies the answers; ``refused`` counts the heads not believed."""

    node: Node
    content: ContentService
    task_cid: str
    refused: Counter[str] = field(default_factory=Counter)
    best: tuple[TaskHead, Chain] | None = None

    def __post_init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[TaskHead](MAX_QUEUED_HEADS)
        self._seen: set[tuple[str, str]] = set()  # (chain CID, model CID) already judged
        self.node.on(TaskHead, self._on_head)

    @property
    def judged(self) -> int:
        """Distinct heads judged so far (at most MAX_SEEN_HEADS)."""
        return len(self._seen)

    def forget_judged(self) -> None:
        """Forget which heads were judged, keeping the best: a finder that lives as long as a
        server (``model serve --latest``, serve/temporary.py) calls this now and then, so
        MAX_SEEN_HEADS bounds its memory, not how many checkpoints it can follow."""
        self._seen.clear()

    def _on_head(self, signed: Signed[TaskHead], topic: str) -> None:
        head = signed.msg
        if head.task_cid != self.task_cid or head.version < 1 or (head.chain_cid, head.model_cid) in self._seen:
            return
        if len(self._seen) >= MAX_SEEN_HEADS:
            self.refused["busy"] += 1
            return
        self._seen.add((head.chain_cid, head.model_cid))
        try:
            self._send.send_nowait(head)
        except trio.WouldBlock:
            self.refused["busy"] += 1

    async def find(self) -> tuple[TaskHead, Chain]:
        """The verified head with the longest chain (unbounded: the caller bounds it)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ask)
            nursery.start_soon(self._find_holders)
            async for head in self._recv:
                chain = await self._verify(head)
                if chain is None:
                    continue
                if self.best is None or chain.version > self.best[1].version:
                    self.best = (head, chain)
                break
            with trio.move_on_after(HEAD_COLLECT_S):
                async for head in self._recv:
                    chain = await self._verify(head)
                    if chain is not None and chain.version > self.best[1].version:  # type: ignore[index]
                        self.best = (head, chain)
            nursery.cancel_scope.cancel()
        assert self.best is not None
        return self.best

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

    async def _verify(self, head: TaskHead) -> Chain | None:
        """The chain ``head`` names, fetched and re-verified, or None (counted by why)."""
        store = self.content.store
        try:
            await self.content.fetch(head.chain_cid, timeout=CHAIN_FETCH_TIMEOUT_S, max_bytes=MAX_CHAIN_BYTES)
            data = await trio.to_thread.run_sync(lambda: store.cat(head.chain_cid, max_bytes=MAX_CHAIN_BYTES))
            chain = await trio.to_thread.run_sync(_verified_chain, self.task_cid, data)
            if (chain.version, chain.head_cid) != (head.version, head.model_cid):
                raise RecordError(f"the head says model v{head.version} {head.model_cid}, its chain "
                                  f"ends at v{chain.version} {chain.head_cid}")
            if self.best is not None:
                longer, shorter = (chain, self.best[1]) if chain.version >= self.best[1].version else (self.best[1], chain)
                shorter.extension(longer)  # a different record at a version both hold: a fork
        except ContentUnavailable as exc:
            self.refused["chain_unavailable"] += 1
            logger.warning("head of task %s (model v%d) names a chain nobody served: %s", self.task_cid,
                           head.version, exc)
            return None
        except RecordError as exc:
            if str(exc).startswith("fork"):
                raise
            self.refused["bad_chain"] += 1
            logger.warning("refused a head of task %s (model v%d): %s", self.task_cid, head.version, exc)
            return None
        return chain


def _verified_chain(task_cid: str, data: bytes) -> Chain:
    """Rebuild ``data`` as the chain of ``task_cid`` (signatures, versions, parents: Chain.from_bytes),
    each record signed by one of its own members."""
    lines = data.splitlines()
    if not lines:
        raise RecordError("an empty chain")
    chain = Chain.from_bytes(task_cid, record_from_bytes(lines[0]).record.parent, data)
    for signed in chain.records:
        record = signed.record
        if record.coordinator not in record.members:
            raise RecordError(f"model record v{record.version} is signed by a peer not among its members")
    return chain
