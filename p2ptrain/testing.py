"""Spin up real p2ptrain peers on loopback, for our tests and for users' own tests.

Two shapes:

- :func:`local_mesh` (async, trio): N :class:`~p2ptrain.node.Node` objects in this process,
  connected and heartbeating, each seeing the other N-1 before the block starts::

      async with local_mesh(4, tmp_path) as nodes:
          await nodes[0].publish("my/topic", msg)

- :class:`NodeProcess` / :func:`node_processes` (sync): N ``p2ptrain node start`` processes,
  each ready (its control socket answers) before the call returns; they know each other's
  addresses up front (identities are created and ports reserved before launch), so all start at
  once, as on a real cluster::

      with node_processes(4, tmp_path) as procs:
          procs[0].status()["peers"]

Every wait is bounded; a node that fails to start raises with its log attached.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import trio

from p2ptrain.errors import UserError
from p2ptrain.identity import load_or_create_identity, peer_id_of
from p2ptrain.net import control_ops
from p2ptrain.net.control import ControlClient
from p2ptrain.node import Node

# Generous: a node process imports libp2p and torch, which takes tens of seconds on a loaded 2-core box.
READY_TIMEOUT_S = 120.0


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeProcess:
    """One ``p2ptrain node start`` child process and its control client."""

    def __init__(self, home: Path, port: int, bootstrap: Sequence[str] = (), extra_args: Sequence[str] = ()) -> None:
        self.home = Path(home)
        self.port = port
        self.peer_id = peer_id_of(load_or_create_identity(self.home)).to_base58()
        self.addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{self.peer_id}"
        self.bootstrap = list(bootstrap)
        self.extra_args = list(extra_args)
        self.client = ControlClient(self.home, timeout=10.0)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> NodeProcess:
        cmd = [sys.executable, "-m", "p2ptrain.cli.main", "node", "start", "--home", str(self.home)]
        cmd += ["--listen", f"/ip4/127.0.0.1/tcp/{self.port}", *self.extra_args]
        if self.bootstrap:
            cmd += ["--bootstrap", *self.bootstrap]
        self.log = open(self.home / "logs" / "stderr.log", "ab")  # noqa: SIM115 (closed in wait)
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until the node's control socket answers (bounded)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.home} exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if self.client.call(control_ops.PING)["started"]:
                    return
            except (UserError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {self.home} not ready in {timeout} s:\n{self.read_log()}")
            time.sleep(0.02)

    def status(self) -> dict[str, Any]:
        return self.client.call(control_ops.STATUS)

    def _log_text(self) -> str:
        try:
            return (self.home / "logs" / "stderr.log").read_text(errors="replace")
        except OSError:
            return ""

    def read_log(self) -> str:
        return self._log_text()[-4000:]

    def events(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the node's log without its per-round progress lines: what a
        failed multi-node test needs to show (elections, plans, failures), which thousands of
        round lines would otherwise push out of view."""
        kept = [line for line in self._log_text().splitlines() if " done with " not in line]
        return "\n".join(kept[-lines:])

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM, then wait (bounded); SIGKILL if it does not stop. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: the node gets no chance to say goodbye (a crash, as far as peers can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self.log.close()
        return code


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
            sys.stderr.write(f"--- {p.home.name} ({p.peer_id[-8:]}): its last events ---\n{p.events()}\n")
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

