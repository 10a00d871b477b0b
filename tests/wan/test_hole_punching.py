"""Hole punching (DCUtR) between two private peers behind different emulated NATs whose routers
drop unsolicited packets, as home routers do (``emulated_nat(firewall=True)``): real node
processes, two public relays; the private pair, first connected through a relay, ends up
connected directly. Behind routers that answer with a reset the punch cannot work
(p2ptrain.testing._nat says why): tests/wan/test_training_behind_nat.py trains over the relay there.
"""

from __future__ import annotations

import pytest

from p2ptrain.node import NODE_ARGS
from p2ptrain.testing import emulated_nat, wait_for, wan_node_processes

pytestmark = pytest.mark.needs("ip", "tc", "iptables", root=True)  # tests/conftest.py decides

# Bound on the nodes knowing their reachability, the private ones holding relay slots, meeting
# through a relay and punching (2 s auto-drive period, 3 attempts of up to ~7 s each).
PUNCH_TIMEOUT_S = 90.0


@pytest.mark.timeout(200)
def test_two_private_peers_behind_firewalled_nats_upgrade_their_relayed_connection_to_a_direct_one(tmp_path):
    with emulated_nat(public=2, lans=[1, 1], rate="100mbit", firewall=True) as net, \
            wan_node_processes(net, tmp_path, extra_args=[*NODE_ARGS, "--relay-service"]) as procs:

        def direct():
            s = [p.status() for p in procs]
            private = s[2:]
            ok = (all(x["reachability"] == "private" for x in private) and all(len(x["connected"]) >= 3 for x in private)
                  and not any(x["relay"]["relayed_peers"] for x in private)
                  # The punch is counted when DCUtR returns, a moment after the direct connection
                  # exists: a status read in between saw it direct with nothing counted yet.
                  and sum(x["relay"].get("punched", 0) for x in private) >= 1)
            return s if ok else None

        statuses = wait_for(direct, PUNCH_TIMEOUT_S, interval=0.5)
        # They met through a relay (nothing else reaches a private peer), and a punch replaced it.
        assert sum(s["discovery"]["relayed_dials"] for s in statuses[2:]) >= 1
