"""The emulated NAT (p2ptrain.testing._nat): a private peer dials out and is seen at its router's
address, nobody dials in, peers of one LAN reach each other, and nothing is left behind.

Needs root (namespaces, veth, iptables); skipped with the reason otherwise.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2ptrain.testing import emulated_nat
from p2ptrain.testing._wan import harness_names

pytestmark = pytest.mark.needs("ip", "tc", "iptables", root=True)  # tests/conftest.py decides

PORT = 5002
# Bound on one connect attempt and one child process (python starts slowly on a loaded box).
CONNECT_TIMEOUT_S = 3.0
CHILD_TIMEOUT_S = 60.0
# Accepts one connection and prints the address it came from.
ECHO_PEER = f"""
import socket
server = socket.create_server(("0.0.0.0", {PORT}))
print("listening", flush=True)
conn, peer = server.accept()
print(peer[0], flush=True)
"""
CONNECT = f"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], {PORT}), timeout={CONNECT_TIMEOUT_S}).close()
    print("connected")
except OSError as exc:
    print("refused", type(exc).__name__)
"""


def dial(net, src, dst) -> tuple[str, str | None]:
    """Whether ``src`` could open a TCP connection to ``dst`` and, if so, the address ``dst`` saw."""
    server = dst.popen([sys.executable, "-c", ECHO_PEER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        done = src.run([sys.executable, "-c", CONNECT, dst.ip], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        if done.stdout.startswith("connected"):
            return "connected", server.stdout.readline().strip()
        return done.stdout.strip(), None
    finally:
        server.kill()
        server.wait(CHILD_TIMEOUT_S)


def test_private_peers_dial_out_through_their_router_and_nobody_dials_in():
    with emulated_nat(public=1, lans=[2, 1], rate="100mbit") as net:
        prefix = net.prefix
        public, (a, b, c) = net.public[0], net.private
        assert [net.lan_of(p) for p in (public, a, b, c)] == [None, 0, 0, 1]
        # Out through the NAT: the public side sees the router's address, not the LAN one.
        assert dial(net, a, public) == ("connected", net.routers[0].ip)
        assert dial(net, c, public) == ("connected", net.routers[1].ip)
        # In: a private address is not routed from the WAN, nor from another LAN.
        assert dial(net, public, a)[0] != "connected"
        assert dial(net, c, a)[0] != "connected"
        # Same LAN: direct, at the LAN address.
        assert dial(net, b, a) == ("connected", b.ip)
    assert not any(n.startswith(prefix) for names in harness_names() for n in names)

