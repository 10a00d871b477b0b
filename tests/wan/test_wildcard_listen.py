"""Peers that listen on 0.0.0.0 advertise addresses other machines can dial.

Three ``node start`` processes, each in its own network namespace (p2ptrain.testing._wan), all
listening on ``/ip4/0.0.0.0``; B and C know only A. They can find each other only through the
addresses in each other's heartbeats: advertised as ``/ip4/0.0.0.0/…`` (as py-libp2p reports a
wildcard listen address), a dial from C's namespace reached C itself and B and C never connected
(a ring of the three never formed; docs/deploy.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from p2ptrain.testing import NodeProcess, emulated_wan, wait_for
from p2ptrain.testing._wan import NODE_PORT

pytestmark = pytest.mark.needs("ip", "tc", root=True)  # tests/conftest.py decides

CONNECT_TIMEOUT_S = 60.0  # heartbeats every second, a redial within a few: connected in ~10 s here


def test_peers_listening_on_the_wildcard_find_each_other_through_their_advertised_addresses(tmp_path: Path) -> None:
    with emulated_wan(3, "1gbit") as wan:
        procs = []
        for peer in wan:
            home = tmp_path / f"node{peer.index}"
            procs.append(NodeProcess(home, NODE_PORT, ip="0.0.0.0", launcher=peer.exec_prefix()))
        a, b, c = procs
        seed = f"/ip4/{wan[0].ip}/tcp/{NODE_PORT}/p2p/{a.peer_id}"
        b.bootstrap = c.bootstrap = [seed]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.wait_ready()
            status = a.status()
            assert status["addrs"] and not any("/0.0.0.0/" in x for x in status["addrs"]), status["addrs"]
            assert f"/ip4/{wan[0].ip}/tcp/{NODE_PORT}/p2p/{a.peer_id}" in status["addrs"]
            wait_for(lambda: c.peer_id in b.status()["connected"] and b.peer_id in c.status()["connected"],
                     CONNECT_TIMEOUT_S, interval=0.5)
        finally:
            for p in procs:
                p.terminate()
