"""``p2ptrain node start --device cuda``: three real node processes on 127.0.0.1 train a task that
needs CUDA, each on the GPU, and an outsider fetches the confirmed model by CID and evaluates it on
the CPU (``model fetch``, ``model eval --json``).

Skips where torch sees no CUDA device; docs/deploy.md#gpus says on which card and when it last ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from p2ptrain.control import ControlClient, ops as control_ops
from p2ptrain.ipfs import open_store
from p2ptrain.protocol import Chain, ChainRules
from p2ptrain.protocol._lineage import first_parent
from p2ptrain.task import TASK_TEMPLATE, task_from_bytes
from p2ptrain.testing import node_processes, run_cli as cli, task_status_of, wait_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False here)")

STEPS, CHECKPOINT = 200, 50


@pytest.mark.timeout(300)
def test_three_node_processes_train_a_cuda_task_on_the_gpu_and_an_outsider_evaluates_it_on_the_cpu(
    tmp_path: Path,
) -> None:
    with node_processes(3, tmp_path, extra_args=["--device", "cuda"]) as procs:
        manifest = cli("dataset", "add", "sklearn:digits", "--shards", "6", "--home",
                       str(procs[0].home)).splitlines()[-1]
        text = TASK_TEMPLATE.format(manifest=manifest, steps=STEPS, checkpoint=CHECKPOINT, density=0.5, peers=3)
        text = text.replace('name = "demo-digits-mlp"', 'name = "cuda-processes"')
        text = text.replace("min = 2\n", "min = 3\n") + '\n[requirements]\ndevice = "cuda"\n'
        task_cid = ControlClient(procs[0].home, timeout=120).call(control_ops.TASK_PUBLISH, text=text,
                                                                   join=True)["task_cid"]
        for p in procs[1:]:
            ControlClient(p.home, timeout=60).call(control_ops.TASK_JOIN, task_cid=task_cid)

        # Each node advertises the GPU it trains on (its heartbeats' capabilities).
        name = torch.cuda.get_device_name(0)
        for p in procs:
            caps = wait_for(lambda p=p: (c := p.status().get("caps")) and c.get("gpu_name") and c, timeout=60)
            assert caps["device"] == "cuda" and caps["gpu_name"] == name, caps

        final = wait_for(lambda: (s := [task_status_of(p.home, task_cid) for p in procs])
                         and all(x and x["state"] == "done" for x in s) and s, timeout=240, interval=0.5)
        assert len({s["latest_model_cid"] for s in final}) == 1, final
        data = (procs[1].home / "tasks" / task_cid / "chain.jsonl").read_bytes()
        task = task_from_bytes(open_store(procs[1].home).cat(task_cid))
        chain = Chain.from_bytes(task_cid, first_parent(data), data, ChainRules.of(task, task_cid))
        assert [r.record.step for r in chain.records] == list(range(CHECKPOINT, STEPS + 1, CHECKPOINT))
        assert all(len(r.record.members) == 3 for r in chain.records)
        recorded = chain.records[-1].record.metrics["accuracy"]  # the coordinator's, on its GPU
        assert recorded >= 0.85, recorded

        # An outsider with no GPU use of its own: the model by CID, evaluated on the CPU.
        fresh, out = tmp_path / "fresh", tmp_path / "model.safetensors"
        summary = json.loads(cli("model", "fetch", chain.head_cid, "-o", str(out), "--home", str(fresh),
                                 "--bootstrap", procs[2].addr, "--json"))
        assert summary["model_cid"] == chain.head_cid
        result = json.loads(cli("model", "eval", str(out), "--dataset", manifest, "--home", str(fresh),
                                "--bootstrap", procs[2].addr, "--json"))
        assert result["accuracy"] == pytest.approx(recorded, abs=0.02)
