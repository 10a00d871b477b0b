"""Spin up real p2ptrain peers on loopback, for our tests and for users' own tests.

Four shapes on loopback:

- :func:`local_mesh` (async, trio): N :class:`~p2ptrain.node.Node` objects in this process,
  connected and heartbeating, each seeing the other N-1 before the block starts::

      async with local_mesh(4, tmp_path) as nodes:
          await nodes[0].publish("my/topic", msg)

- :class:`~p2ptrain.node.NodeProcess` / :func:`node_processes` (sync): N ``p2ptrain node start`` processes,
  each ready (its control socket answers) before the call returns; they know each other's
  addresses up front (identities are created and ports reserved before launch), so all start at
  once, as on a real cluster::

      with node_processes(4, tmp_path) as procs:
          procs[0].status()["peers"]

- :func:`local_peers` (async, trio): N full peers (node, content service, task service) in this
  process, to test a task's run end to end in seconds; with :func:`publish_digits_task` and
  :meth:`LocalPeers.wait_until` (see that section's docstrings)::

      async with local_peers(3, tmp_path) as peers:
          task_cid = await publish_digits_task(peers[0])
          for peer in peers:
              await peer.tasks.join(task_cid)
          await peers.wait_until(lambda: peers.status(0, task_cid)["version"] >= 1, 60)
- :func:`connected_hosts` (async, trio): N bare libp2p hosts, every pair connected, for a test of
  one protocol (channels, the collective, Bitswap) without the rest of a node::

      async with connected_hosts(3) as peers:
          collectives = [Collective(p.host) for p in peers]

And beyond loopback, :mod:`p2ptrain.testing._wan` (re-exported here): :func:`emulated_wan` puts N
peers in network namespaces behind rate-limited links (needs root), :func:`wan_node_processes`
starts ``node start`` processes inside them::

      with emulated_wan(4, "100mbit") as wan, wan_node_processes(wan, tmp_path) as procs:
          procs[0].status()["peers"]

Every wait is bounded; a node that fails to start raises with its log attached.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from p2ptrain.base import UserError, short_id
from p2ptrain.node import Node, NodeConfig, READY_TIMEOUT_S, free_port
from p2ptrain.node import NodeProcess as _NodeProcess
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.net import make_host
from p2ptrain.wire import MESSAGES, MessageRegistry

from p2ptrain.testing._wan import (
    EmulatedWan as EmulatedWan,
    WanError as WanError,
    WanPeer as WanPeer,
    cleanup_stale as cleanup_stale,
    emulated_wan as emulated_wan,
    parse_rate as parse_rate,
    wan_node_processes as wan_node_processes,
    wan_unavailable as wan_unavailable,
)
from p2ptrain.testing._nat import EmulatedNat as EmulatedNat, emulated_nat as emulated_nat, nat_unavailable as nat_unavailable
from p2ptrain.testing._chains import (
    attestations_for as attestations_for,
    proven_chain as proven_chain,
    proven_record as proven_record,
    rules_task as rules_task,
    votes_for as votes_for,
)
from p2ptrain.testing._corpus import (  # text files and a tokenizer trained on them, no hub needed
    EOS as EOS,
    STDLIB_FILES as STDLIB_FILES,
    text_corpus as text_corpus,
)
from p2ptrain.testing._forkserver import (  # processes forked from a template that imported torch once
    ForkedProcess as ForkedProcess,
    NodeProcess as NodeProcess,
    run_forked as run_forked,
    start_forked as start_forked,
)
from p2ptrain.testing._scripts import (  # a user's script as N members, one process each
    ScriptMember as ScriptMember,
    last_json as last_json,
    run_script as run_script,
    script_members as script_members,
    start_script as start_script,
)
from p2ptrain.testing._peers import (
    DIGITS_TASK as DIGITS_TASK,
    PEER_STOP_TIMEOUT_S as PEER_STOP_TIMEOUT_S,
    WAIT_FALLBACK_S as WAIT_FALLBACK_S,
    Changes as Changes,
    LocalPeers as LocalPeers,
    local_peers as local_peers,
    publish_digits_task as publish_digits_task,
    wait_until as wait_until,
)

if TYPE_CHECKING:
    from p2ptrain.testing._slow_layers import slow_layers as slow_layers
    from p2ptrain.testing._wan import IFACE as IFACE
else:
    from p2ptrain._exports import lazy_exports

    __getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
    __all__ = sorted([
        *__all__,
        "CLI_TIMEOUT_S",
        "CONNECT_TIMEOUT_S",
        "Changes",
        "DIGITS_TASK",
        "EOS",
        "EmulatedNat",
        "EmulatedWan",
        "ForkedProcess",
        "LOOPBACK",
        "LocalHost",
        "STDLIB_FILES",
        "LocalPeers",
        "NodeProcess",
        "PEER_STOP_TIMEOUT_S",
        "ScriptMember",
        "WAIT_FALLBACK_S",
        "WanError",
        "WanPeer",
        "attestations_for",
        "cleanup_stale",
        "connect",
        "connected_hosts",
        "emulated_nat",
        "emulated_wan",
        "last_json",
        "run_script",
        "script_members",
        "start_forked",
        "start_script",
        "SUBSCRIBED_TIMEOUT_S",
        "subscribed",
        "free_port",
        "local_mesh",
        "local_peers",
        "nat_unavailable",
        "new_host",
        "node_processes",
        "parse_rate",
        "proven_chain",
        "proven_record",
        "publish_digits_task",
        "rules_task",
        "run_cli",
        "run_forked",
        "run_node_processes",
        "task_status_of",
        "text_corpus",
        "votes_for",
        "wait_for",
        "wait_until",
        "wan_node_processes",
        "wan_unavailable",
    ])


@asynccontextmanager
async def local_mesh(
    n: int, base: Path, *, timeout: float = 20.0, messages: MessageRegistry = MESSAGES, **settings: Any
) -> AsyncIterator[list[Node]]:
    """N in-process nodes on 127.0.0.1; all bootstrap from the first; yields once each sees N-1 peers.
    ``settings``: :class:`~p2ptrain.node.NodeConfig` fields of every node (e.g. ``dht=False``)."""
    config = NodeConfig(**settings)
    homes = [Path(base) / f"node{i}" for i in range(n)]
    nodes: list[Node] = []
    async with trio.open_nursery() as nursery:
        try:
            with trio.fail_after(timeout):
                first = Node(homes[0], config, messages=messages)
                await nursery.start(first.run)
                nodes.append(first)
                for home in homes[1:]:
                    node = Node(home, replace(config, bootstrap=first.addrs[:1]), messages=messages)
                    nodes.append(node)
                async with trio.open_nursery() as starting:
                    for node in nodes[1:]:
                        starting.start_soon(nursery.start, node.run)
                for node in nodes:
                    await node.membership.wait_until(lambda m: len(m.alive()) >= n - 1)
            yield nodes
        finally:
            for node in nodes:
                node.stop()


@contextmanager
def node_processes(
    n: int, base: Path, *, extra_args: Sequence[str] = (), ready_timeout: float = READY_TIMEOUT_S
) -> Iterator[list[_NodeProcess]]:
    """N node processes on loopback (:class:`NodeProcess`: forked where the fork server is on), each
    bootstrapping from all the others, started at once."""
    procs: list[_NodeProcess] = []
    for i in range(n):
        home = Path(base) / f"node{i}"
        procs.append(NodeProcess(home, free_port(), extra_args=extra_args))
    with run_node_processes(procs, ready_timeout) as started:
        yield started


@contextmanager
def run_node_processes(procs: list[_NodeProcess], ready_timeout: float = READY_TIMEOUT_S) -> Iterator[list[_NodeProcess]]:
    """Start ``procs`` at once, each bootstrapping from all the others; yield once each is ready;
    stop them all when the block ends (SIGTERM, then SIGKILL)."""
    for p in procs:
        p.bootstrap = [q.addr for q in procs if q is not p]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(ready_timeout)
        yield procs
    except BaseException:
        # pytest shows what a failed test wrote to stderr: each node's story, not just an assert.
        for p in procs:
            sys.stderr.write(f"--- {p.home.name} ({short_id(p.peer_id)}): its last events ---\n{p.events()}\n")
        raise
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.terminate()
            except subprocess.TimeoutExpired:
                pass


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> Any:
    """Poll ``predicate()`` until it returns something truthy (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met in {timeout} s")
        time.sleep(interval)


# One CLI command as a process: it imports torch and libp2p, and a temporary node (``--bootstrap``)
# may take 20 s to reach a peer, on a loaded machine.
CLI_TIMEOUT_S = 180.0


def run_cli(*args: str, launcher: Sequence[str] = (), timeout: float = CLI_TIMEOUT_S) -> str:
    """Run ``p2ptrain ARGS`` as a process (inside a namespace with ``launcher``, e.g.
    ``WanPeer.exec_prefix()``) and return its stdout, stripped; a failure raises AssertionError
    with its stderr, which is what a test wants to see."""
    done = run_forked([*launcher, sys.executable, "-m", "p2ptrain.cli.main", *args], capture_output=True,
                      text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return str(done.stdout).strip()


def task_status_of(home: Path, task_cid: str) -> dict[str, Any] | None:
    """A running node's status of one task (``task status --json``: a
    :class:`~p2ptrain.control.TaskStatus`'s ``to_json``) through its control socket,
    or None while it does not answer it (starting, stopped, killed, or not in the task)."""
    try:
        return ControlClient(home, timeout=10).call(control_ops.TASK_STATUS, task_cid=task_cid)
    except (UserError, OSError):
        return None


# -- N connected libp2p hosts ------------------------------------------------------------------
# Bare hosts (no Node: no pubsub, membership or control socket) for tests of one protocol at a
# time: channels, the collective, Bitswap. One copy instead of one per test file.

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# Bound on starting the hosts and on dialing every pair: each dial is a TCP connect plus a Noise
# handshake on loopback (milliseconds); 30 s leaves room for a loaded 2-core CI box.
CONNECT_TIMEOUT_S = 30.0
# Bound on hearing a peer's subscription (and grafting it): one heartbeat (1 s) when all is well.
SUBSCRIBED_TIMEOUT_S = 30.0


@dataclass
class LocalHost:
    """One running libp2p host of :func:`connected_hosts`, and the scope that runs it."""

    host: IHost
    scope: trio.CancelScope
    _nursery: trio.Nursery

    @property
    def id(self) -> ID:
        return self.host.get_id()

    @property
    def info(self) -> PeerInfo:
        """What another host dials to reach this one."""
        return PeerInfo(self.host.get_id(), self.host.get_addrs())

    async def start(self, service: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``service`` (``nursery.start`` style) for as long as this host runs."""
        return await self._nursery.start(service, *args)

    def kill(self) -> None:
        """Stop the host and its services: its connections close as if its process had died."""
        self.scope.cancel()


async def subscribed(
    pubsub: Any, peers: Iterable[ID], topic: str, *, mesh: bool = False, timeout: float = SUBSCRIBED_TIMEOUT_S
) -> None:
    """Wait until ``pubsub`` (a node's ``.pubsub``, or :func:`p2ptrain.net.make_pubsub`'s) has heard
    each of ``peers`` subscribe to ``topic`` and, with ``mesh``, grafted it into its gossipsub mesh
    for the topic (what it publishes before that may go nowhere); ``timeout`` bounds the whole wait.

    Why not py-libp2p's waits alone: each stops after 5 s of its own, which a loaded machine or a
    pubsub stream made again after a reset (a peer that sent a broken frame) can take."""
    with trio.fail_after(timeout):
        for peer in peers:
            await pubsub.wait_for_subscription(peer, topic, timeout=math.inf)
            if mesh:
                await pubsub.router.wait_for_mesh(peer, topic, timeout=math.inf)


async def connect(a: IHost, b: IHost, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """``a`` dials ``b`` (both running), bounded by ``timeout``."""
    with trio.fail_after(timeout):
        await a.connect(PeerInfo(b.get_id(), b.get_addrs()))


def new_host() -> IHost:
    """A host as a node makes it (:func:`p2ptrain.net.make_host`), fresh key, loopback."""
    return make_host(create_new_key_pair(), [LOOPBACK])


async def _run_host(host: IHost, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with host.run(listen_addrs=[Multiaddr(LOOPBACK)]), trio.open_nursery() as services:
            task_status.started(LocalHost(host, scope, services))
            await trio.sleep_forever()


@asynccontextmanager
async def connected_hosts(
    n: int, *, connected: bool = True, make: Callable[[], IHost] = new_host, timeout: float = CONNECT_TIMEOUT_S,
) -> AsyncIterator[list[LocalHost]]:
    """``n`` running libp2p hosts on 127.0.0.1, every pair connected (unless ``connected=False``).

    Starting and dialing are bounded by ``timeout``; the hosts stop when the block ends. A host's
    ``kill()`` stops it alone, mid-test, as a crash would::

        async with connected_hosts(3) as peers:
            serve_channels(peers[1].host, PROTO, handler)
            async with await open_channel(peers[0].host, peers[1].id, PROTO) as channel:
                await channel.send(b"hello")
            peers[2].kill()
    """
    async with trio.open_nursery() as nursery:
        with trio.fail_after(timeout):
            peers: list[LocalHost] = [await nursery.start(_run_host, make()) for _ in range(n)]
            if connected:
                async with trio.open_nursery() as dials:
                    for i, a in enumerate(peers):
                        for b in peers[i + 1:]:
                            dials.start_soon(a.host.connect, b.info)
        yield peers
        nursery.cancel_scope.cancel()
