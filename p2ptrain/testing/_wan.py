"""An emulated WAN on one machine: N peers, each in its own network namespace, joined by a bridge,
each peer's link limited in rate both ways. For tests and benchmarks that must see what a real
link's bandwidth does to a run (loopback moves ~1 GB/s; users' peers sit behind 20 Mbit/s-1 Gbit/s).

    with emulated_wan(4, rate="100mbit") as wan:
        proc = wan[0].popen(["python", "-c", "..."])       # runs inside peer 0's namespace
        wan[1].ip                                           # peer 1's address, reachable from every peer

How: ``ip netns add`` per peer, a veth pair per peer (one end in the namespace, named
:data:`IFACE`, the other on a bridge in the root namespace), and a ``tc tbf`` qdisc on *both* ends
of each veth: the namespace end's egress is the peer's upload, the bridge end's egress its
download. The kernels these tests run on have tbf but no netem, so latency and loss are not
emulated: only bandwidth. Addresses come from :data:`SUBNET`, which exists only inside these
namespaces (the root namespace gets no address and no route to it).

Nothing is left behind: every name (namespaces, links, the bridge) starts with a prefix unique to
this process and harness (``pw<pid>_<seq>``); leaving the block (normally, by an exception or by
Ctrl-C) kills every process inside the namespaces and deletes them, and each new harness first
removes what a *dead* process's harness left (:func:`cleanup_stale`: a SIGKILLed test run).
Needs root (``CAP_NET_ADMIN``) and iproute2: :func:`wan_unavailable` says why not, for a skip.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2ptrain.node import READY_TIMEOUT_S
from p2ptrain.node import NodeProcess as _NodeProcess
from p2ptrain.testing._forkserver import NodeProcess

# Every name the harness creates starts with this, then the owner's pid in base 36, "_", and a
# two-character sequence number: what cleanup_stale parses to tell a dead owner's leftovers
# from a live harness's (another test process's, running beside this one).
NAME_ROOT = "pw"
_NAME = re.compile(rf"^{NAME_ROOT}([0-9a-z]+)_([0-9a-z]{{2}})(?:br|[hnp]\d+)?$")
# The interface of a peer inside its namespace (what GLOO_SOCKET_IFNAME names).
IFACE = "wan0"
# Peers' addresses: SUBNET.1, SUBNET.2, ... /24, inside the namespaces only. Two harnesses may use
# the same addresses at once: their namespaces and bridges are disjoint.
SUBNET = "10.231.0"
# A /24 leaves 254 host addresses; a harness of more peers than that would need a second subnet.
MAX_PEERS = 250
# tbf's bucket: at least 128 KiB, so one GSO/TSO super-packet (up to 64 KiB) always fits (tbf
# drops a packet larger than its bucket), and at least 10 ms of the rate, so a 1 Gbit/s link is
# not held back by the timer's granularity. Small enough that a burst at line speed is a few
# percent of a megabyte transfer (measured: 100 Mbit/s moves ~11.5 MB/s through it).
MIN_BURST_BYTES = 128 * 1024
BURST_SECONDS = 0.010
# How long a packet may wait in tbf's queue before it is dropped (tbf's ``latency``): 200 ms holds
# TCP's window at 20 Mbit/s-1 Gbit/s without drops in the measured runs.
QUEUE_LATENCY_MS = 200
# Bound on one ip/tc command (they take milliseconds; a loaded 2-core box can stall a few seconds).
IP_TIMEOUT_S = 30.0
# On teardown, processes still running in a namespace get SIGTERM, then this long, then SIGKILL.
STOP_GRACE_S = 5.0
# Poll interval while waiting for a SIGTERMed process to exit: a process gives no event to wait on.
STOP_POLL_S = 0.05

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
_sequence = itertools.count()


class WanError(RuntimeError):
    """The emulated WAN cannot be set up here (not root, no iproute2, or a command failed)."""


def parse_rate(rate: str | int) -> int:
    """A link rate in bits per second: ``100mbit``, ``1gbit``, ``20mbit``, ``500kbit`` (tc's
    units, powers of 1000), ``12mbps`` (bytes per second, as tc reads it), or an int of bit/s."""
    if isinstance(rate, int):
        if rate <= 0:
            raise ValueError(f"a link rate must be positive, not {rate}")
        return rate
    m = _RATE.match(rate)
    if not m:
        raise ValueError(f"not a link rate: {rate!r} (e.g. 100mbit, 1gbit, 20mbit)")
    bits = float(m.group(1)) * _UNITS[m.group(2).lower()] * (8 if (m.group(3) or "").lower() == "bps" else 1)
    if bits <= 0:
        raise ValueError(f"a link rate must be positive, not {rate!r}")
    return int(bits)


def wan_unavailable() -> str | None:
    """Why an emulated WAN cannot be set up here (one line, for a test's skip), or None if it can."""
    if os.geteuid() != 0:
        return "the emulated WAN needs root (network namespaces, veth, tc): run the tests as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated WAN needs iproute2's `{tool}` on PATH"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode:
        raise WanError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def harness_names() -> tuple[list[str], list[str]]:
    """The namespaces and links on this machine whose name any harness could have made."""
    namespaces = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-o", "link", "show").stdout.splitlines()]
    return [n for n in namespaces if _NAME.match(n)], [n for n in links if _NAME.match(n)]


def _kill_namespace_processes(namespace: str, grace: float) -> None:
    """SIGTERM every process in ``namespace``, then SIGKILL those still there after ``grace`` s."""
    def pids() -> list[int]:
        out = _run("ip", "netns", "pids", namespace, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        running = pids()
        if not running:
            return
        for pid in running:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids() and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)


def _remove(prefix: str, namespaces: Sequence[str], links: Sequence[str], grace: float) -> None:
    """Kill the processes in and delete the namespaces and links of ``prefix``; missing ones are fine."""
    for ns in namespaces:
        if ns.startswith(prefix):
            _kill_namespace_processes(ns, grace)
            _run("ip", "netns", "del", ns, check=False)
    for link in links:  # deleting one end of a veth deletes both; then the bridge
        if link.startswith(prefix) and not link.endswith("br"):
            _run("ip", "link", "del", link, check=False)
    _run("ip", "link", "del", f"{prefix}br", check=False)


def cleanup_stale() -> list[str]:
    """Remove what harnesses of processes that no longer run left behind (a SIGKILLed test run);
    return the prefixes removed. A live process's harness is never touched."""
    namespaces, links = harness_names()
    dead = set()
    for name in (*namespaces, *links):
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1), 36)):
            dead.add(f"{NAME_ROOT}{m.group(1)}_{m.group(2)}")
    for prefix in sorted(dead):
        _remove(prefix, namespaces, links, grace=0.0)
    return sorted(dead)


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


def _tbf(rate_bits: int) -> list[str]:
    burst = max(MIN_BURST_BYTES, int(rate_bits / 8 * BURST_SECONDS))
    return ["root", "tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_MS}ms"]


@dataclass
class WanPeer:
    """One peer of an :func:`emulated_wan`: its namespace, address and link rates (bit/s)."""

    index: int
    namespace: str
    ip: str
    upload: int
    download: int
    host_link: str
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    @property
    def iface(self) -> str:
        """The peer's interface inside its namespace (for GLOO_SOCKET_IFNAME and the like)."""
        return IFACE

    def exec_prefix(self) -> list[str]:
        """Put this before a command's argv to run it inside the peer's namespace."""
        return ["ip", "netns", "exec", self.namespace]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` inside the namespace (``ip netns exec`` execs the command: the
        Popen's pid is the command's). Stopped, if still running, when the WAN is torn down."""
        proc = subprocess.Popen([*self.exec_prefix(), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` inside the namespace (pass ``timeout=``: it is not bounded otherwise)."""
        return subprocess.run([*self.exec_prefix(), *argv], **kwargs)


class EmulatedWan(Sequence[WanPeer]):
    """The peers of :func:`emulated_wan`, in order; ``prefix`` names everything it made."""

    def __init__(self, prefix: str, peers: list[WanPeer]) -> None:
        self.prefix = prefix
        self.bridge = f"{prefix}br"
        self._peers = peers

    def __len__(self) -> int:
        return len(self._peers)

    def __getitem__(self, index: int) -> WanPeer:  # type: ignore[override]  # (no slices)
        return self._peers[index]

    def __iter__(self) -> Iterator[WanPeer]:
        return iter(self._peers)

    def set_rate(self, index: int, upload: str | int, download: str | int | None = None) -> None:
        """Change peer ``index``'s link rates now (a link that degrades mid-run)."""
        peer = self._peers[index]
        peer.upload, peer.download = parse_rate(upload), parse_rate(download if download is not None else upload)
        _run("tc", "-n", peer.namespace, "qdisc", "replace", "dev", IFACE, *_tbf(peer.upload))
        _run("tc", "qdisc", "replace", "dev", peer.host_link, *_tbf(peer.download))

    def close(self, grace: float = STOP_GRACE_S) -> None:
        """Stop every process inside and delete the namespaces, links and bridge (idempotent)."""
        for peer in self._peers:
            for proc in peer._procs:
                if proc.poll() is None:
                    proc.terminate()
        namespaces, links = harness_names()
        _remove(self.prefix, namespaces, links, grace)
        for peer in self._peers:
            for proc in peer._procs:
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _rates(n: int, rate: str | int, rates: Sequence[str | int | tuple[str | int, str | int]] | None) -> list[tuple[int, int]]:
    if rates is None:
        return [(parse_rate(rate), parse_rate(rate))] * n
    if len(rates) != n:
        raise ValueError(f"rates: {len(rates)} entries for {n} peers")
    out = []
    for r in rates:
        up, down = r if isinstance(r, tuple) else (r, r)
        out.append((parse_rate(up), parse_rate(down)))
    return out


@contextmanager
def emulated_wan(
    n: int, rate: str | int = "100mbit", *,
    rates: Sequence[str | int | tuple[str | int, str | int]] | None = None,
) -> Iterator[EmulatedWan]:
    """``n`` peers, each in its own network namespace on one bridge, every link limited to
    ``rate`` both ways, or per peer by ``rates`` (a rate, or an ``(upload, download)`` pair per
    peer: one slow peer is ``["100mbit"] * 3 + [("5mbit", "20mbit")]``).

    Everything is removed when the block ends, however it ends; raises :class:`WanError` (with
    :func:`wan_unavailable`'s reason) where namespaces cannot be made::

        with emulated_wan(2, "20mbit") as wan:
            server = wan[0].popen(["python", "-m", "http.server", "8000"])
            wan[1].run(["curl", f"http://{wan[0].ip}:8000/"], timeout=30)
    """
    reason = wan_unavailable()
    if reason:
        raise WanError(reason)
    if not 1 <= n <= MAX_PEERS:
        raise ValueError(f"an emulated WAN has 1 to {MAX_PEERS} peers, not {n}")
    link_rates = _rates(n, rate, rates)
    cleanup_stale()
    owner = _base36(os.getpid())
    while True:  # a sequence number no live harness of this process uses
        prefix = f"{NAME_ROOT}{owner}_{_base36(next(_sequence) % 1296).rjust(2, '0')}"
        namespaces, links = harness_names()
        if not any(name.startswith(prefix) for name in (*namespaces, *links)):
            break
    peers: list[WanPeer] = []
    wan = EmulatedWan(prefix, peers)
    try:
        _run("ip", "link", "add", wan.bridge, "type", "bridge")
        _run("ip", "link", "set", wan.bridge, "up")
        for i, (up, down) in enumerate(link_rates):
            ns, host_end, ns_end = f"{prefix}p{i}", f"{prefix}h{i}", f"{prefix}n{i}"
            peer = WanPeer(i, ns, f"{SUBNET}.{i + 1}", up, down, host_end)
            _run("ip", "netns", "add", ns)
            peers.append(peer)
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _run("ip", "link", "set", ns_end, "netns", ns)
            _run("ip", "-n", ns, "link", "set", ns_end, "name", IFACE)
            _run("ip", "-n", ns, "addr", "add", f"{peer.ip}/24", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "set", host_end, "master", wan.bridge)
            _run("ip", "link", "set", host_end, "up")
            _run("tc", "-n", ns, "qdisc", "add", "dev", IFACE, *_tbf(up))
            _run("tc", "qdisc", "add", "dev", host_end, *_tbf(down))
        yield wan
    finally:
        wan.close()


# ---- p2ptrain nodes inside the WAN ----------------------------------------------------------------

# The TCP port every node listens on inside its own namespace (each namespace has all ports free).
NODE_PORT = 4001


@contextmanager
def wan_node_processes(
    wan: EmulatedWan, base: Path, peers: Sequence[int] | None = None, *, extra_args: Sequence[str] = (),
    ready_timeout: float = READY_TIMEOUT_S,
) -> Iterator[list[_NodeProcess]]:
    """A ``p2ptrain node start`` process in each of ``wan``'s peers (or those of index ``peers``),
    listening on its namespace's address and bootstrapping from all the others, each ready (its
    control socket answers) before the block starts; homes ``<base>/node<i>``. Like
    :func:`p2ptrain.testing.node_processes`, with real links between the nodes::

        with emulated_wan(4, "100mbit") as wan, wan_node_processes(wan, tmp_path) as procs:
            procs[0].status()["peers"]
    """
    from p2ptrain.testing import run_node_processes

    chosen = [wan[i] for i in (peers if peers is not None else range(len(wan)))]
    procs: list[_NodeProcess] = []
    for peer in chosen:
        home = Path(base) / f"node{peer.index}"
        # Forked where the fork server is on (the suite), each child entering its peer's namespace;
        # fresh otherwise (a benchmark). docs/testing.md: why the one NAT failure seen with forked
        # nodes is not held against them.
        procs.append(NodeProcess(home, NODE_PORT, extra_args=extra_args, ip=peer.ip, launcher=peer.exec_prefix()))
    with run_node_processes(procs, ready_timeout) as started:
        yield started
