"""The emulated WAN harness (p2ptrain.testing._wan): links really limited, nothing left behind.

Needs root (namespaces, veth, tc); skipped with the reason otherwise. No timing assertion that
load could break: rates are checked as loose *upper* bounds (a loaded machine only moves less).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from p2ptrain.testing import WanError, cleanup_stale, emulated_wan, parse_rate
from p2ptrain.testing._wan import harness_names

pytestmark = pytest.mark.needs("ip", "tc", root=True)  # tests/conftest.py decides

# Bound on a child process printing its first line (a python start on a loaded 2-core box).
LINE_TIMEOUT_S = 30.0
PORT = 5001
# Counts the bytes it receives on one connection and prints the rate it saw, in bytes per second.
SINK = f"""
import socket, time
server = socket.create_server(("0.0.0.0", {PORT}))
print("listening", flush=True)
conn, _ = server.accept()
received, started = 0, time.monotonic()
while chunk := conn.recv(1 << 20):
    received += len(chunk)
print(received / (time.monotonic() - started), flush=True)
"""
SEND = "import socket, sys; socket.create_connection((sys.argv[1], {port})).sendall(bytes(int(sys.argv[2])))"


def read_line(proc: subprocess.Popen[str], timeout: float = LINE_TIMEOUT_S) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from {proc.args} in {timeout} s"
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def transfer_rate(wan, src: int, dst: int, nbytes: int) -> float:
    """Bytes per second a TCP stream from peer ``src`` to peer ``dst`` moved, as ``dst`` saw it."""
    sink = wan[dst].popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert read_line(sink) == "listening"
    wan[src].run([sys.executable, "-c", SEND.format(port=PORT), wan[dst].ip, str(nbytes)], check=True, timeout=120)
    return float(read_line(sink, 120))


def test_link_rates_limit_upload_and_a_slow_peer_is_slow_both_ways():
    # Peer 2 uploads at 10 Mbit/s and downloads at 100; the others 100 both ways.
    with emulated_wan(3, "100mbit", rates=["100mbit", "100mbit", ("10mbit", "100mbit")]) as wan:
        # 100 Mbit/s is 12.5 MB/s: an unlimited veth would move hundreds of MB/s.
        assert transfer_rate(wan, 0, 1, 8_000_000) < 20e6
        # The slow peer's upload: 1.25 MB/s; its download is the fast one's.
        assert transfer_rate(wan, 2, 0, 1_500_000) < 2e6
        wan.set_rate(0, "10mbit")  # a link that degrades mid-run
        assert transfer_rate(wan, 0, 1, 1_500_000) < 2e6


def test_an_exception_in_the_block_leaves_no_namespace_link_or_process_behind():
    with pytest.raises(RuntimeError, match="the test failed"):
        with emulated_wan(2, "20mbit") as wan:
            prefix = wan.prefix
            sleeper = wan[1].popen(["sleep", "600"])
            assert all(any(n.startswith(prefix) for n in names) for names in harness_names())
            raise RuntimeError("the test failed")
    namespaces, links = harness_names()
    assert [n for n in (*namespaces, *links) if n.startswith(prefix)] == []
    assert sleeper.poll() is not None


def test_what_a_killed_run_left_is_removed_by_the_next_harness_and_a_live_one_is_kept():
    # A test process SIGKILLed inside the block: no finally runs, its namespaces stay.
    code = ("import os, signal; from p2ptrain.testing._wan import emulated_wan\n"
            "with emulated_wan(2) as wan:\n"
            "    print(wan.prefix, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    prefix = killed.stdout.strip()
    assert killed.returncode == -9 and prefix
    assert any(n.startswith(prefix) for n in harness_names()[0])
    with emulated_wan(1) as live:  # a new harness removes a dead owner's leftovers first
        assert not any(n.startswith(prefix) for names in harness_names() for n in names)
        assert cleanup_stale() == []  # this process's live harness is not stale
        assert any(n.startswith(live.prefix) for n in harness_names()[0])


def test_rates_parse_as_tc_reads_them_and_bad_ones_say_why():
    assert parse_rate("100mbit") == 100_000_000 and parse_rate("1gbit") == 10**9 and parse_rate("20Mbit") == 20_000_000
    assert parse_rate("12mbps") == 96_000_000 and parse_rate(5000) == 5000
    with pytest.raises(ValueError, match="not a link rate"):
        parse_rate("fast")
    with pytest.raises(ValueError, match="1 to"):
        with emulated_wan(0):
            pass
    assert isinstance(WanError("x"), RuntimeError)
