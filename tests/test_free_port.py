"""free_port: listening ports for child processes, picked where nothing else on the machine picks.

A multi-process test once failed in CI with one member dialing the other's port for 60 s: a port the
kernel picked (``bind(0)``) lies in the ephemeral range, where any process's ``bind(0)`` or outgoing
connection can take it before the child binds it.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from p2ptrain.base import UserError
from p2ptrain.node import free_port, port_range, port_slice


def ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_default_range_lies_below_the_kernels_ephemeral_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("P2PTRAIN_FREE_PORTS", raising=False)
    low, high = port_range()
    assert 1024 <= low < high < ephemeral_low()
    ports = [free_port() for _ in range(200)]
    assert all(low <= p <= high for p in ports)
    assert len(set(ports)) == len(ports), "a port handed out twice"
    with socket.socket() as s:  # free indeed: a listener binds it
        s.bind(("127.0.0.1", ports[-1]))
        s.listen()


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setenv("P2PTRAIN_FREE_PORTS", f"{taken}-{taken}")
        assert port_range() == (taken, taken)
        port = free_port()  # the slice is full: the kernel's pick, still free
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("value", ["20000", "a-b", "30000-20000", "80-90", "20000-70000"])
def test_a_bad_range_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("P2PTRAIN_FREE_PORTS", value)
    with pytest.raises(UserError, match="P2PTRAIN_FREE_PORTS"):
        port_range()


def test_test_workers_get_disjoint_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("P2PTRAIN_FREE_PORTS", raising=False)
    low, high = port_range()
    slices = [tuple(int(p) for p in port_slice(i, 6).split("-")) for i in range(6)]
    assert slices[0][0] == low and slices[-1][1] <= high
    assert all(a[1] < b[0] for a, b in zip(slices, slices[1:]))
    assert all(hi - lo >= 1000 for lo, hi in slices)
