"""Peers behind NAT are full members (issue 20), in the emulated NAT (p2ptrain.testing._nat): two
public peers (relays, `--relay-service`), two private peers behind one NAT and one behind another
train the demo task, and a fresh private node fetches the model by CID. One run, checked for
reachability (status and heartbeats), reservations, relayed connections, the training and the fetch.
"""

from __future__ import annotations

import json

import pytest

from p2ptrain.node import NODE_ARGS
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.testing import emulated_nat, run_cli as cli, task_status_of as task_status, wait_for, wan_node_processes
from p2ptrain.task import TASK_TEMPLATE

pytestmark = pytest.mark.needs("ip", "tc", "iptables", root=True)  # tests/conftest.py decides

STEPS, CHECKPOINT = 10, 10
# Bound on every node knowing its reachability and every private one holding relay slots, and on
# every node connected to all four others (relayed where nothing else works).
MESH_TIMEOUT_S = 90.0
RUN_TIMEOUT_S = 180.0




@pytest.mark.timeout(400)
def test_two_public_and_three_private_peers_behind_two_nats_train_and_a_private_node_fetches_the_model(
        tmp_path, add_digits):
    with emulated_nat(public=2, lans=[2, 1], rate="100mbit") as net, \
            wan_node_processes(net, tmp_path, extra_args=[*NODE_ARGS, "--relay-service"]) as procs:
        manifest = add_digits(procs[2].home, 5)  # while the mesh forms
        ids = [p.peer_id for p in procs]

        def meshed():
            s = [p.status() for p in procs]
            heard = {p["peer_id"]: p["reachability"] for p in s[0]["peers"]}  # from heartbeats
            ok = (all(x["reachability"] != "unknown" for x in s) and all(len(x["relay"]["reserved_on"]) == 2 for x in s[2:])
                  and all(len(x["connected"]) >= 4 for x in s) and all(heard.get(i, "unknown") != "unknown" for i in ids[1:]))
            return s if ok else None

        statuses = wait_for(meshed, MESH_TIMEOUT_S, interval=0.5)
        assert [s["reachability"] for s in statuses] == ["public"] * 2 + ["private"] * 3
        # Heartbeats carry it: a public peer's view of every other peer.
        view = {p["peer_id"]: p["reachability"] for p in statuses[0]["peers"]}
        assert [view[i] for i in ids[1:]] == ["public", "private", "private", "private"]
        # The lone private peer (LAN 1) and LAN 0's two are connected only through a relay (whichever
        # side dialed: the lower peer ID dials first).
        assert len(statuses[4]["relay"]["relayed_peers"]) == 2
        assert sum(s["discovery"]["relayed_dials"] for s in statuses[2:]) >= 2
        assert all("/p2p-circuit/" in a for a in statuses[4]["relay"]["addrs"])

        text = TASK_TEMPLATE.format(manifest=manifest, steps=STEPS, checkpoint=CHECKPOINT, density=0.01, peers=5)
        text = text.replace("min = 2", "min = 5")  # planned once all five are in: every one trains
        task_cid = ControlClient(procs[2].home, timeout=120).call(control_ops.TASK_PUBLISH, text=text, join=True)["task_cid"]
        done = wait_for(
            lambda: (s := [task_status(p.home, task_cid) for p in procs]) and all(x and x["state"] == "done" for x in s) and s,
            timeout=RUN_TIMEOUT_S, interval=0.5,
        )
        heads = {s["latest_model_cid"] for s in done}
        assert len(heads) == 1, f"members disagree on the final model: {heads}"
        model_cid = heads.pop()
        assert set(ids) <= set(done[0]["members"])

        # A fresh node behind the second NAT fetches the model by CID, bootstrapping from a public peer.
        out = tmp_path / "model.safetensors"
        summary = json.loads(cli("model", "fetch", model_cid, "-o", str(out), "--home", str(tmp_path / "fresh"),
                                 "--bootstrap", procs[0].addr, "--json", launcher=net.private[2].exec_prefix()))
        assert summary["model_cid"] == model_cid and out.stat().st_size == summary["bytes"] > 0
