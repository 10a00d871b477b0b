"""Finished runs stay findable: after a run ends and all its members but one non-coordinator have
stopped, `p2ptrain model fetch --latest TASK` from a fresh home finds the final model through that
member, with the chain verified. Real `p2ptrain node start` processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.local_nodes import NODE_ARGS
from p2ptrain.net import control_ops
from p2ptrain.net.control import ControlClient
from p2ptrain.testing import node_processes, wait_for
from p2ptrain.training.demo import TASK_TEMPLATE

# A tiny run: 20 steps of the digits MLP, two checkpoints; seconds on one core.
STEPS, CHECKPOINT = 20, 10
# The run, end to end, on a loaded 2-core box (the processes' start is most of it).
RUN_TIMEOUT_S = 150.0


def cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2ptrain.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(300)
def test_the_latest_model_of_a_finished_run_is_fetched_through_any_member(tmp_path: Path) -> None:
    with node_processes(2, tmp_path, extra_args=NODE_ARGS) as procs:
        added = cli("dataset", "add", "sklearn:digits", "--shards", "4", "--home", str(procs[0].home))
        assert added.returncode == 0, added.stderr
        manifest = added.stdout.strip().splitlines()[-1]
        text = TASK_TEMPLATE.format(manifest=manifest, steps=STEPS, checkpoint=CHECKPOINT, density=0.01, peers=8)
        task_cid = ControlClient(procs[0].home, timeout=120).call(control_ops.TASK_PUBLISH, text=text,
                                                                  join=True)["task_cid"]

        def statuses() -> list[dict] | None:
            out = []
            for p in procs:
                try:
                    out.append(ControlClient(p.home, timeout=10).call(control_ops.TASK_STATUS, task_cid=task_cid))
                except Exception:  # noqa: BLE001 - not joined yet
                    return None
            return out if all(s["state"] == "done" for s in out) else None

        done = wait_for(statuses, timeout=RUN_TIMEOUT_S, interval=1.0)
        model_cid = done[0]["latest_model_cid"]
        assert {s["latest_model_cid"] for s in done} == {model_cid} and done[0]["version"] == 2
        # Every member but one that never led stops: no coordinator publishes heads any more.
        coordinator = done[0]["coordinator"]
        keep = next(i for i, p in enumerate(procs) if p.peer_id != coordinator)
        for i, p in enumerate(procs):
            if i != keep:
                p.terminate()

        fresh = tmp_path / "fresh"
        out = tmp_path / "latest.safetensors"
        fetched = cli("model", "fetch", "--latest", task_cid, "-o", str(out), "--home", str(fresh),
                      "--bootstrap", procs[keep].addr, "--json")
        assert fetched.returncode == 0, fetched.stderr
        summary = json.loads(fetched.stdout)
        assert summary["model_cid"] == model_cid and out.stat().st_size == summary["bytes"]
