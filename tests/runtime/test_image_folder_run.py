"""A run on a dataset added from an image folder: PNG files written here become uint8 shards by CID
(with the train split's pixel statistics in the manifest), and two real loopback peers train the
registry's ``cnn`` on them; every checkpoint is confirmed and the test accuracy is a digit reader's.

The whole path a user takes with their own photos, at the size of scikit-learn's digits (8x8).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from PIL import Image
from sklearn.datasets import load_digits

from p2ptrain.testing import LocalPeers, local_peers
from p2ptrain.protocol import Chain, read_chain

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

DEADLINE_S = 150.0
STEPS, CHECKPOINT = 60, 20

TASK = """\
name = "digit-images-cnn"
seed = 0
[model]
name = "cnn"
kwargs = {{ in_channels = 1, image_size = 8, channels = [8, 16], num_classes = 10 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.01
[training]
batch_size = 32
total_steps = {steps}
checkpoint_interval = {checkpoint}
[compression]
density = 0.1
[peers]
min = 2
max = 2
"""  # both peers join every run: its first term need not wait for more


def write_image_folder(root: Path) -> None:
    digits = load_digits()
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        folder = root / f"digit{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((pixels * (255 / 16)).astype(np.uint8)).save(folder / f"{i:04d}.png")


async def _publish(peers: LocalPeers, folder: Path) -> str:
    from p2ptrain.data import build_source, read_source
    from p2ptrain.task import load_task, task_bytes

    store = peers[0].content.store

    def build() -> str:
        write_image_folder(folder)
        manifest, _ = build_source(store, read_source(str(folder)), 4, normalize="train")
        cid = store.add_bytes(task_bytes(load_task(TASK.format(manifest=manifest, steps=STEPS,
                                                               checkpoint=CHECKPOINT))))
        store.pin_add(cid)
        return cid

    return await trio.to_thread.run_sync(build)


def _chain(peer: Any, task_cid: str) -> Chain:
    data = (peer.node.home / "tasks" / task_cid / "chain.jsonl").read_bytes()
    return read_chain(task_cid, data)


async def test_two_peers_train_a_cnn_on_an_image_folder_added_by_cid(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with local_peers(2, tmp_path / "peers") as peers:
            task_cid = await _publish(peers, tmp_path / "images")
            await peers.join_all(task_cid)

            final = await peers.wait_done(task_cid, DEADLINE_S - 30, range(2), what="the run done on both peers")
            assert len({s["latest_model_cid"] for s in final}) == 1
            records = [r.record for r in _chain(peers[1], task_cid).records]
            assert [r.step for r in records] == [20, 40, 60] and all(len(r.members) == 2 for r in records)
            # Loss falls from checkpoint to checkpoint; the model reads held-out digits.
            assert records[0].metrics["loss"] > records[-1].metrics["loss"], [r.metrics for r in records]
            assert records[-1].metrics["accuracy"] >= 0.8, records[-1].metrics
