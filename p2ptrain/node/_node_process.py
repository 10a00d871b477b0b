"""``p2ptrain node start`` child processes on this machine, over loopback.

Used by ``p2ptrain demo`` (which must not import :mod:`p2ptrain.testing`) and by
:mod:`p2ptrain.testing` (``node_processes``), so there is one way to launch a local peer and wait
until it answers. Every wait is bounded; a node that fails to start raises with its log attached.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from p2ptrain.base import UserError, load_or_create_identity, peer_id_of
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.node._node_config import prepare_home

# Generous: a node process imports libp2p and torch, which takes tens of seconds on a loaded 2-core box.
READY_TIMEOUT_S = 120.0
# How long wait_ready sleeps between pings of a starting node's control socket: a child process
# gives no event we could wait on, and 20 ms is short next to its seconds of start-up.
READY_POLL_S = 0.02
# ``node start`` flags of a peer that trains on this machine: it joins tasks it hears of, on the
# CPU with one thread (several peers share the cores). The demo's peers and the multi-process tests.
NODE_ARGS = ["--accept-tasks", "--device", "cpu", "--threads", "1"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a child process to listen on.

    Not the kernel's pick (``bind(0)``): that port lies in the ephemeral range, where any other
    process's ``bind(0)`` or outgoing connection may take it in the seconds before the child binds it
    (a peer of a multi-process test then dials a stranger). The port comes from below that range
    (:func:`port_range`), at random, never one this process handed out before; only other callers of
    this function pick there, and parallel ones can be given disjoint slices (``P2PTRAIN_FREE_PORTS``)."""
    low, high = port_range()
    for _ in range(64):
        port = random.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use, or still held by a closed connection
                continue
        _handed_out.add(port)
        if len(_handed_out) > (high - low) // 2:  # a long-lived caller: start over
            _handed_out.clear()
        return port
    with socket.socket() as s:  # the range is full: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Where free_port picks when the ephemeral range starts at Linux's default (32768) or above.
_PORTS_BELOW_EPHEMERAL = 20000
_handed_out: set[int] = set()


def port_range() -> tuple[int, int]:
    """The ports :func:`free_port` picks from: ``P2PTRAIN_FREE_PORTS=LO-HI`` if set (test workers
    each get their own), else 20000 up to the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default)."""
    given = os.environ.get("P2PTRAIN_FREE_PORTS", "")
    if given:
        try:
            low, high = (int(part) for part in given.split("-"))
        except ValueError:
            raise UserError(f"P2PTRAIN_FREE_PORTS={given!r}: expected LO-HI, two port numbers") from None
        if not 1024 <= low <= high <= 65535:
            raise UserError(f"P2PTRAIN_FREE_PORTS={given!r}: expected 1024 <= LO <= HI <= 65535")
        return low, high
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    if ephemeral_low - 1 - _PORTS_BELOW_EPHEMERAL >= 1000:
        return _PORTS_BELOW_EPHEMERAL, ephemeral_low - 1
    return 1024, 65535  # an unusual range: anywhere, still checked free


def port_slice(index: int, count: int) -> str:
    """The ``P2PTRAIN_FREE_PORTS`` value (``LO-HI``) that gives the ``index``-th of ``count``
    parallel callers of :func:`free_port` (a test run's xdist workers) its own part of
    :func:`port_range`, so none picks a port another handed out to a child not yet listening."""
    low, high = port_range()
    size = (high - low + 1) // count
    return f"{low + index * size}-{low + (index + 1) * size - 1}"


class ChildProcess(Protocol):
    """What NodeProcess needs of its child: ``subprocess.Popen``'s handle, or one from
    ``p2ptrain.testing``'s fork server (a child started without re-importing torch)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


class NodeProcess:
    """One ``p2ptrain node start`` child process and its control client. ``popen`` starts it
    (``subprocess.Popen``'s signature); ``p2ptrain.testing.NodeProcess`` starts it from a fork server."""

    popen: Any = subprocess.Popen

    def __init__(self, home: Path, port: int, bootstrap: Sequence[str] = (), extra_args: Sequence[str] = (), *,
                 ip: str = "127.0.0.1", launcher: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        """``ip``: the address it listens on; ``launcher``: argv put before the command (e.g.
        ``ip netns exec NS``, to start it inside a network namespace: p2ptrain.testing._wan);
        ``env``: variables set for the child beside this process's environment."""
        self.home = Path(home)
        prepare_home(self.home)  # a fresh home too: its logs/ takes the child's output
        self.port = port
        self.ip = ip
        self.launcher = list(launcher)
        self.peer_id = peer_id_of(load_or_create_identity(self.home)).to_base58()
        self.addr = f"/ip4/{ip}/tcp/{port}/p2p/{self.peer_id}"
        self.bootstrap = list(bootstrap)
        self.extra_args = list(extra_args)
        self.env = {**os.environ, **env} if env else None
        self.client = ControlClient(self.home, timeout=10.0)
        self.proc: ChildProcess | None = None
        self.started_at = 0.0

    def start(self) -> NodeProcess:
        cmd = [*self.launcher, sys.executable, "-m", "p2ptrain.cli.main", "node", "start", "--home", str(self.home)]
        cmd += ["--listen", f"/ip4/{self.ip}/tcp/{self.port}", *self.extra_args]
        if self.bootstrap:
            cmd += ["--bootstrap", *self.bootstrap]
        self.log = open(self.home / "logs" / "stderr.log", "ab")  # noqa: SIM115 (closed in wait)
        self.started_at = time.monotonic()
        self.proc = type(self).popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
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
            time.sleep(READY_POLL_S)

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
