"""The demo task trained across 4 `p2ptrain node start` processes, each in its own network
namespace behind a 100 Mbit/s link (p2ptrain.testing._wan), and the model fetched by CID from a
fifth namespace by a node that took no part: what loopback cannot show (real addresses, real link
rates, no shared 127.0.0.1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2ptrain.node import NODE_ARGS
from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.testing import emulated_wan, run_cli as cli, task_status_of as task_status, wait_for, wan_node_processes
from p2ptrain.task import TASK_TEMPLATE

pytestmark = pytest.mark.needs("ip", "tc", root=True)  # tests/conftest.py decides

# Short: the test is about the links, not the accuracy (tests/runtime covers that on loopback).
STEPS, CHECKPOINT = 10, 10
RUN_TIMEOUT_S = 180.0




@pytest.mark.timeout(300)
def test_four_peers_behind_100mbit_links_train_the_demo_and_a_fifth_fetches_the_model_by_cid(
        tmp_path: Path, add_digits) -> None:
    with emulated_wan(5, "100mbit") as wan, wan_node_processes(wan, tmp_path, peers=range(4), extra_args=NODE_ARGS) as procs:
        assert all(p.addr.startswith(f"/ip4/{wan[i].ip}/") for i, p in enumerate(procs))
        manifest = add_digits(procs[0].home, 4)
        text = TASK_TEMPLATE.format(manifest=manifest, steps=STEPS, checkpoint=CHECKPOINT, density=0.01, peers=4)
        text = text.replace("min = 2", "min = 4")  # planned once all four are in: every one trains
        task_cid = ControlClient(procs[0].home, timeout=120).call(control_ops.TASK_PUBLISH, text=text, join=True)["task_cid"]
        statuses = wait_for(
            lambda: (s := [task_status(p.home, task_cid) for p in procs]) and all(x and x["state"] == "done" for x in s) and s,
            timeout=RUN_TIMEOUT_S, interval=0.5,
        )
        heads = {s["latest_model_cid"] for s in statuses}
        assert len(heads) == 1, f"members disagree on the final model: {heads}"
        model_cid = heads.pop()
        # Every member trained: the final record names all four.
        assert {p.peer_id for p in procs} <= set(statuses[0]["members"])

        # Peer 4 took no part: its fresh home fetches the model through its own 100 Mbit/s link.
        out = tmp_path / "model.safetensors"
        summary = json.loads(cli("model", "fetch", model_cid, "-o", str(out), "--home", str(tmp_path / "fresh"),
                                 "--bootstrap", procs[2].addr, "--json", launcher=wan[4].exec_prefix()))
        assert summary["model_cid"] == model_cid and out.stat().st_size == summary["bytes"] > 0
