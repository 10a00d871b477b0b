"""The `--accept-tasks` memory bomb of issue 27 against a real `node start --accept-tasks` process.

The attacker is the chaos bench's hostile peer (bench/hostile_bounds.py): it serves a real digits
data set and two tasks whose ``initial_model`` is (a) a file that declares 1 GiB and is one leaf
linked everywhere, (b) 16 MiB of distinct leaves under a root that declares 1,000 bytes, and
announces both. Today's code read (a) whole (+1 GiB of RSS) and downloaded and kept (b).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import trio

from p2ptrain.ipfs import BlockStore, parse_cid
from p2ptrain.control import ops as control_ops
from p2ptrain.testing import node_processes
from p2ptrain.wire import TASKS_TOPIC

BENCH = Path(__file__).resolve().parents[2] / "bench"
DEADLINE_S = 180.0  # the victim fetches a data set and two models from the attacker on a loaded box
DECLARED = 1 << 30
FLOOD_CHUNKS = 64  # 16 MiB


def _load(name: str) -> Any:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


hostile = _load("hostile")
bounds = _load("hostile_bounds")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def test_a_task_whose_initial_model_is_a_bomb_is_refused_within_the_model_cards_bound(tmp_path: Path) -> None:
    import numpy as np

    from p2ptrain.data import build_dataset, load_source

    with node_processes(1, tmp_path / "victim", extra_args=["--accept-tasks", "--device", "cpu"]) as (victim,):
        before_mb = peak_rss_mb(victim.proc.pid)
        async with hostile.hostile_peer() as peer:
            with trio.fail_after(DEADLINE_S):
                target = await peer.connect(victim.addr)
                await peer.wait_in_topic(TASKS_TOPIC, [target])
                _, features, labels = load_source("sklearn:digits")
                manifest, _ = await trio.to_thread.run_sync(
                    lambda: build_dataset(peer.store, "digits", (features / 16).astype(np.float32), labels, 2))
                sent = await bounds.model_bomb_tasks(peer, manifest, declared=DECLARED, chunks=FLOOD_CHUNKS)
                tasks = {sent[name]["task_cid"]: name for name in ("model-bomb", "model-flood")}

                def failed() -> dict[str, dict[str, Any]]:
                    assert victim.proc.poll() is None, f"the node exited:\n{victim.read_log()}"
                    listing = victim.client.call(control_ops.TASK_LIST)["tasks"]
                    return {t["task_cid"]: t for t in listing if t["task_cid"] in tasks and t.get("state") == "failed"}

                while len(runs := await trio.to_thread.run_sync(failed)) < len(tasks):
                    await bounds.announce(peer, tasks)  # again: an announcement may precede the mesh
                    await trio.sleep(1.0)

        for task_cid, run in runs.items():
            assert "byte limit" in run["error"], (tasks[task_cid], run["error"])
        assert "declares" in runs[sent["model-bomb"]["task_cid"]]["error"]
        assert "larger than" in runs[sent["model-flood"]["task_cid"]]["error"]
        # The declared gigabyte was never read: the victim's peak RSS grew by far less.
        grown = peak_rss_mb(victim.proc.pid) - before_mb
        assert grown < 256, f"peak RSS grew by {grown:.0f} MB"
        # Nothing of either model is kept: not the repeated leaf, and not the distinct leaves.
        blocks = BlockStore(victim.home / "blocks")
        assert not blocks.has(parse_cid(sent["model-bomb"]["leaf"]))
        assert not blocks.has(parse_cid(sent["model-flood"]["leaf"]))
        assert blocks.size_bytes() < 2 << 20, blocks.size_bytes()  # the data set and the task files
