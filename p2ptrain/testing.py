"""Spin up real p2ptrain peers on loopback, for our tests and for users' own tests.

Two shapes:

- :func:`local_mesh` (async, trio): N :class:`~p2ptrain.node.Node` objects in this process,
  connected and heartbeating, each seeing the other N-1 before the block starts::

      async with local_mesh(4, tmp_path) as nodes:
          await nodes[0].publish("my/topic", msg)

- :class:`~p2ptrain.local_nodes.NodeProcess` / :func:`node_processes` (sync): N ``p2ptrain node start`` processes,
  each ready (its control socket answers) before the call returns; they know each other's
  addresses up front (identities are created and ports reserved before launch), so all start at
  once, as on a real cluster::

      with node_processes(4, tmp_path) as procs:
          procs[0].status()["peers"]

Every wait is bounded; a node that fails to start raises with its log attached.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import trio

from p2ptrain.local_nodes import READY_TIMEOUT_S, NodeProcess, free_port
from p2ptrain.logs import short_id
from p2ptrain.node import Node


@asynccontextmanager
async def local_mesh(
    n: int, base: Path, *, timeout: float = 20.0, **node_kwargs: Any
) -> AsyncIterator[list[Node]]:
    """N in-process nodes on 127.0.0.1; all bootstrap from the first; yields once each sees N-1 peers."""
    homes = [Path(base) / f"node{i}" for i in range(n)]
    nodes: list[Node] = []
    async with trio.open_nursery() as nursery:
        try:
            with trio.fail_after(timeout):
                first = Node(homes[0], **node_kwargs)
                await nursery.start(first.run)
                nodes.append(first)
                for home in homes[1:]:
                    node = Node(home, bootstrap=first.addrs[:1], **node_kwargs)
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
def node_processes(n: int, base: Path, *, extra_args: Sequence[str] = (), ready_timeout: float = READY_TIMEOUT_S) -> Iterator[list[NodeProcess]]:
    """N node processes on loopback, each bootstrapping from all the others, started at once."""
    procs: list[NodeProcess] = []
    for i in range(n):
        home = Path(base) / f"node{i}"
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        (home / "logs").mkdir(exist_ok=True, mode=0o700)
        procs.append(NodeProcess(home, free_port(), extra_args=extra_args))
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

