"""Full peers in one process (node + content service + task service), to test a task's run end to
end in seconds: :func:`local_peers`, :class:`LocalPeers` (status, waits that wake on the run's own
messages, peers added or stopped mid-run) and :func:`publish_digits_task`. Re-exported from
:mod:`p2ptrain.testing`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from p2ptrain.base import short_id
from p2ptrain.node import Node, NodeConfig
from p2ptrain.wire import (
    CoordinatorBeat,
    RoundFailed,
    RoundPlan,
    Signed,
    SignedAttestation,
    SignedModelRecord,
    SignedVote,
    TaskAnnounce,
    TaskHead,
    VoteRequest,
)

if TYPE_CHECKING:  # the runtime imports torch: only local_peers' users pay for it, when they call it
    from libp2p.peer.id import ID

    from p2ptrain.mesh import Membership
    from p2ptrain.run import RunState
    from p2ptrain.services import Peer, TaskOptions

T = TypeVar("T")

# A wait with no event to wake it re-checks its predicate this often: some state (a member's round
# count, a confirmed checkpoint) changes without a message this process hears. 0.25 s: a quarter of
# the default heartbeat, so a condition is seen within a beat of holding, at a negligible CPU cost.
WAIT_FALLBACK_S = 0.25
# How long a peer is given to stop (stop_peer): its goodbye, host close and services' cancellation.
PEER_STOP_TIMEOUT_S = 15.0
# The task of publish_digits_task: a 64 -> 16 -> 10 MLP on sklearn's 8x8 digits, so a round is a few
# milliseconds of compute and ~5 KiB of gradients: a test's time goes into the protocol, not torch.
DIGITS_TASK = """\
name = "{name}"
seed = 0
[model]
name = "mlp"
kwargs = {{ in_features = 64, hidden = [16], out_features = 10 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "sgd"
lr = 0.05
[training]
batch_size = 16
total_steps = {total_steps}
checkpoint_interval = {checkpoint_interval}
[peers]
min = {min_peers}
max = {max_peers}
"""


# What wakes a wait: every message of a task's run (its topic and the tasks topic); not heartbeats,
# which come every second whatever the run does.
TASK_MESSAGE_TYPES: tuple[type, ...] = (CoordinatorBeat, RoundFailed, RoundPlan, SignedAttestation, SignedModelRecord,
                                        SignedVote, TaskAnnounce, TaskHead, VoteRequest)


async def _next_membership_change(node: Node) -> None:
    """Return at the node's next member join or leave (Membership.wait_until re-checks on each)."""
    checks = 0

    def changed(_: Any) -> bool:
        nonlocal checks
        checks += 1
        return checks > 1

    await node.membership.wait_until(changed)


class Changes:
    """Wakes waiters whenever a watched node hears a task message (votes, beats, plans, records,
    attestations, heads) or sees a member join or leave: what :func:`wait_until` sleeps on, so a
    test wakes when the run it watches moves, not on a timer::

        changes = Changes()
        changes.watch(node)  # before or while it runs
        await wait_until(lambda: my_condition(), 30, changes=changes)
    """

    def __init__(self) -> None:
        self._event = trio.Event()
        self._nodes: list[Node] = []

    def watch(self, node: Node) -> None:
        for msg_type in TASK_MESSAGE_TYPES:
            node.on(msg_type, self._heard)
        self._nodes.append(node)

    def _heard(self, signed: Signed[Any], topic: str) -> None:
        self.fire()

    def fire(self) -> None:
        """Wake every waiter now."""
        self._event.set()
        self._event = trio.Event()

    async def wait(self, timeout: float) -> None:
        """Until the next change, or ``timeout`` seconds, whichever comes first."""
        event = self._event
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:

                async def member_change(node: Node) -> None:
                    await _next_membership_change(node)
                    nursery.cancel_scope.cancel()

                for node in self._nodes:
                    if node.host is not None:
                        nursery.start_soon(member_change, node)
                await event.wait()
                nursery.cancel_scope.cancel()


async def wait_until(
    predicate: Callable[[], T | None], timeout: float, *, changes: Changes | None = None,
    interval: float = WAIT_FALLBACK_S, what: str | None = None,
) -> T:
    """Return ``predicate()``'s first truthy value; raise ``TimeoutError`` after ``timeout`` seconds.

    The predicate is checked at once, then after each event of ``changes`` (if given), and after
    ``interval`` seconds with no event (state that changes without a message). ``what`` names the
    condition in the error; a predicate that raises ends the wait with its error::

        await wait_until(lambda: peer.tasks.runs[cid].status().version >= 1, 60, changes=changes,
                         what="the first checkpoint confirmed")
    """
    try:
        with trio.fail_after(timeout):
            while True:
                result = predicate()
                if result:
                    return result
                if changes is not None:
                    await changes.wait(interval)
                else:
                    await trio.sleep(interval)
    except trio.TooSlowError:
        raise TimeoutError(f"{what or 'condition'} not met in {timeout} s") from None


class LocalPeers(Sequence["Peer"]):
    """The full peers of :func:`local_peers`: a sequence of :class:`~p2ptrain.services.Peer`,
    plus what a test of a run needs: start one more (a late joiner), stop one (a member that
    leaves), read a peer's task status, and wait, waking on the peers' task messages."""

    def __init__(self, base: Path, nursery: trio.Nursery, config: NodeConfig,
                 task_options: TaskOptions | None) -> None:
        self.base = Path(base)
        self.changes = Changes()
        self._nursery = nursery
        self._config = config
        self._task_options = task_options
        self._peers: list[Peer] = []
        self._scopes: list[trio.CancelScope] = []

    def __len__(self) -> int:
        return len(self._peers)

    def __getitem__(self, index: int) -> Peer:  # type: ignore[override]  # (no slices)
        return self._peers[index]

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers))

    def running(self) -> list[Peer]:
        """The peers whose node has not been stopped."""
        return [p for p in self._peers if p is not None and not p.node.stopped.is_set()]

    async def join_all(self, task_cid: str) -> list[RunState]:
        """Every peer joins the task ``task_cid`` at once (as members started together would); the
        runs' shared states, in the peers' order. Bound it with ``trio.fail_after``."""
        async with trio.open_nursery() as nursery:
            for peer in self._peers:
                nursery.start_soon(peer.tasks.join, task_cid)
        return [peer.tasks.runs[task_cid].shared for peer in self._peers]

    async def add_peer(self, *, see_all: bool = True) -> Peer:
        """Start one more full peer (home ``<base>/peer<i>``), bootstrapping from every running one;
        with ``see_all``, return once it and they see each other. Bound it with ``trio.fail_after``."""
        self._peers.append(None)  # type: ignore[arg-type]  # filled by _start
        self._scopes.append(trio.CancelScope())
        return await self._start(len(self._peers) - 1, see_all)

    async def restart_peer(self, index: int, *, see_all: bool = True) -> Peer:
        """Start peer ``index`` again on its home after :meth:`stop_peer` (a restarted machine: the
        same identity and disk, a new node and services, no run until it joins one), bootstrapping
        from every running peer. Bound it with ``trio.fail_after``."""
        if not self._peers[index].node.stopped.is_set():
            raise RuntimeError(f"peer{index} is running: stop it first")
        self._scopes[index] = trio.CancelScope()
        return await self._start(index, see_all)

    async def _start(self, index: int, see_all: bool) -> Peer:
        from p2ptrain.services import make_peer

        bootstrap = [addr for p in self.running() if p is not None for addr in p.node.addrs[:1]]
        node = Node(self.base / f"peer{index}", replace(self._config, bootstrap=bootstrap))
        peer = make_peer(node, self._task_options)
        self.changes.watch(node)
        self._peers[index] = peer
        scope = self._scopes[index]

        async def run(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await node.run(task_status=task_status)

        await self._nursery.start(run)
        if see_all:
            await self.wait_connected()
        return peer

    async def wait_connected(self) -> None:
        """Until every running peer sees every other as alive (unbounded: bound it yourself)."""
        running = self.running()
        for peer in running:
            others = {p.node.peer_id for p in running if p is not peer}
            await peer.node.membership.wait_until(functools.partial(_sees, others))

    async def stop_peer(self, index: int) -> None:
        """Stop peer ``index``'s node (its goodbye sent, its tasks cancelled) and wait until it is
        down, at most PEER_STOP_TIMEOUT_S (then cancelled)."""
        node = self._peers[index].node
        node.stop()
        with trio.move_on_after(PEER_STOP_TIMEOUT_S):
            await node.stopped.wait()
        self._scopes[index].cancel()

    def status(self, index: int, task_cid: str) -> dict[str, Any]:
        """What ``p2ptrain task status --json`` shows on peer ``index`` ({} before it joined): the
        JSON a test of a node process reads too (``task_status_of``); ``run.status()`` is the
        typed :class:`~p2ptrain.control.TaskStatus` it comes from."""
        run = self._peers[index].tasks.runs.get(task_cid)
        return run.status().to_json() if run is not None else {}

    def describe(self) -> str:
        """One line per peer and task it runs: what a failed test needs to see first."""
        keys = ("state", "error", "synced", "term", "coordinator", "round", "step", "version", "members",
                "rounds_done", "rejected")
        lines = []
        for i, peer in enumerate(self._peers):
            stopped = " (stopped)" if peer.node.stopped.is_set() else ""
            runs = peer.tasks.runs.items()
            if not runs:
                lines.append(f"peer{i} {short_id(peer.node.peer_id)}{stopped}: no task")
            for task_cid, run in runs:
                status = run.status().to_json()
                status["coordinator"] = short_id(status["coordinator"]) if status["coordinator"] else "-"
                status["members"] = [short_id(m) for m in status["members"]]
                shown = ", ".join(f"{k}={status.get(k)}" for k in keys)
                lines.append(f"peer{i} {short_id(peer.node.peer_id)}{stopped} task {task_cid[:12]}: {shown}")
        return "--- local peers ---\n" + "\n".join(lines) + "\n"

    async def wait_until(self, predicate: Callable[[], T | None], timeout: float, what: str | None = None) -> T:
        """:func:`wait_until`, woken by these peers' task messages and membership changes."""
        return await wait_until(predicate, timeout, changes=self.changes, what=what)

    async def wait_done(self, task_cid: str, timeout: float, indices: Sequence[int] | None = None,
                        what: str | None = None) -> list[dict[str, Any]]:
        """The ``task status --json`` of peers ``indices`` (all of them by default) once the run is
        done on every one; an ``AssertionError`` with the run's error as soon as one has failed,
        rather than a timeout that hides it."""
        return await self._wait_all(task_cid, lambda s: s.get("state") == "done", timeout, indices,
                                    what, "the run done")

    async def wait_version(self, task_cid: str, version: int, timeout: float, indices: Sequence[int] | None = None,
                           what: str | None = None) -> list[dict[str, Any]]:
        """As :meth:`wait_done`, once every one has confirmed model ``version`` (or a later one)."""
        return await self._wait_all(task_cid, lambda s: s.get("version", 0) >= version, timeout, indices,
                                    what, f"model v{version} confirmed")

    async def _wait_all(self, task_cid: str, ready: Callable[[dict[str, Any]], bool], timeout: float,
                        indices: Sequence[int] | None, what: str | None, default: str) -> list[dict[str, Any]]:
        chosen = list(range(len(self))) if indices is None else list(indices)

        def reached() -> list[dict[str, Any]] | None:
            statuses = [self.status(i, task_cid) for i in chosen]
            for i, s in zip(chosen, statuses, strict=True):
                assert s.get("state") != "failed", f"peer{i}: {s.get('error')}"
            return statuses if all(ready(s) for s in statuses) else None

        return await self.wait_until(reached, timeout, what=what or f"{default} on peers {chosen}")


@asynccontextmanager
async def local_peers(
    n: int, base: Path, *, timeout: float = 60.0, task_options: TaskOptions | None = None, **settings: Any
) -> AsyncIterator[LocalPeers]:
    """N full p2ptrain peers in this process (``runtime.peer.make_peer``: a node with its content
    and task services) on 127.0.0.1, each bootstrapping from the ones before; yields once each sees
    the other N-1 (all within ``timeout`` seconds). ``settings`` are each node's
    :class:`~p2ptrain.node.NodeConfig` fields (e.g. ``heartbeat_interval``); ``task_options``
    is a ``runtime.tasks.TaskOptions``. On exit every node is stopped. A test of a run::

        async with local_peers(3, tmp_path) as peers:
            task_cid = await publish_digits_task(peers[0], total_steps=30, checkpoint_interval=3, min_peers=3)
            for peer in peers:  # the first plan waits for all three (min_peers)
                await peer.tasks.join(task_cid)

            def at_v1() -> list[dict[str, Any]] | None:
                statuses = [peers.status(i, task_cid) for i in range(len(peers))]
                return statuses if all(s.get("version", 0) >= 1 for s in statuses) else None

            statuses = await peers.wait_until(at_v1, 60, what="every member at model v1")
            assert len({s["chain"][0]["model_cid"] for s in statuses}) == 1
    """
    settings.setdefault("dht", False)  # peers bootstrap from each other: no DHT walks to pay for
    async with trio.open_nursery() as nursery:
        peers = LocalPeers(base, nursery, NodeConfig(**settings), task_options)
        try:
            with trio.fail_after(timeout):
                for _ in range(n):
                    await peers.add_peer(see_all=False)
                await peers.wait_connected()
            yield peers
        except BaseException:
            # pytest shows what a failed test wrote to stderr: where each peer's runs stood.
            sys.stderr.write(peers.describe())
            raise
        finally:
            for peer in peers:
                peer.node.stop()
            with trio.move_on_after(PEER_STOP_TIMEOUT_S):
                for peer in peers:
                    await peer.node.stopped.wait()
            nursery.cancel_scope.cancel()


async def publish_digits_task(
    peer: Peer, *, name: str = "digits", shards: int = 4, total_steps: int = 12, checkpoint_interval: int = 4,
    min_peers: int = 1, max_peers: int = 8, extra: str = "", initial_model: str | None = None,
) -> str:
    """Add sklearn's digits (``shards`` train shards) to ``peer``'s store and store a tiny task on
    it (:data:`DIGITS_TASK`); return the task's CID, which any connected peer can
    ``await peer.tasks.join(task_cid)`` (joining fetches the task and its data from the mesh).

    ``extra``: TOML appended to the task file, e.g. ``"[requirements]\\nmin_memory_mb = 1024\\n"``;
    ``initial_model``: the CID of the model the run starts from (the task's ``initial_model``).
    Nothing is announced: joins by CID are what a test controls. Needs scikit-learn.
    """
    import numpy as np

    from p2ptrain.data import build_dataset, load_source
    from p2ptrain.task import load_task, task_bytes

    store = peer.content.store

    def build() -> str:
        source, features, labels = load_source("sklearn:digits")
        manifest, _ = build_dataset(store, source, (features / 16.0).astype(np.float32), labels, shards,
                                    test_fraction=0.2)
        text = DIGITS_TASK.format(name=name, manifest=manifest, total_steps=total_steps,
                                  checkpoint_interval=checkpoint_interval, min_peers=min_peers, max_peers=max_peers)
        text += extra
        if initial_model is not None:  # a top-level key: before the first table
            text = f'initial_model = "{initial_model}"\n' + text
        cid = store.add_bytes(task_bytes(load_task(text)))
        store.pin_add(cid)
        return cid

    return await trio.to_thread.run_sync(build)


def _sees(others: set[ID], membership: Membership) -> bool:
    """Whether ``membership`` holds every one of ``others`` alive."""
    return others <= {r.peer_id for r in membership.alive()}
