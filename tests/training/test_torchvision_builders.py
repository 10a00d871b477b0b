"""``torchvision:NAME`` builders (issue 30): built with weights=None and a seeded initialisation,
within the parameter cap, on image-folder data as IPFSDataset yields it; a ResNet-18 task trains
across two peers.

Skipped where torchvision does not import: the project's venv pins torch 2.13.0 (CPU), beside
which PyPI's torchvision fails to load ('operator torchvision::nms does not exist'). Validated in a
venv with torch 2.14.1 and torchvision 0.29.1 (docs/training.md has the command).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import trio

torchvision = pytest.importorskip("torchvision", reason="torchvision does not import beside this torch "
                                                        "(pip install torch==2.14.1 torchvision==0.29.1 in a venv)")

from p2ptrain.data import IPFSDataset, build_source, read_source, SourceOptions  # noqa: E402
from p2ptrain.models import MAX_MODEL_FILE_BYTES, build_model, check_model, model_file_limit  # noqa: E402
from p2ptrain.models._torchvision import MODELS  # noqa: E402
from p2ptrain.task import load_task, task_bytes  # noqa: E402
from p2ptrain.testing import local_peers  # noqa: E402

pytestmark = pytest.mark.usefixtures("quick_timers")  # tests/conftest.py: the protocol's idle waits shortened

RUN_S = 240.0


def test_every_curated_model_is_counted_within_the_cap_and_built_without_a_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # where a weights download would land
    for name in MODELS:
        n = check_model(f"torchvision:{name}", {"num_classes": 7, "in_channels": 1})
        assert 0 < n and model_file_limit(f"torchvision:{name}", {"num_classes": 7}) <= MAX_MODEL_FILE_BYTES
    a = build_model("torchvision:resnet18", {"num_classes": 5, "in_channels": 1}, seed=3)
    b = build_model("torchvision:resnet18", {"num_classes": 5, "in_channels": 1}, seed=3)
    c = build_model("torchvision:resnet18", {"num_classes": 5, "in_channels": 1}, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.state_dict()["conv1.weight"], c.state_dict()["conv1.weight"])
    assert a.state_dict()["conv1.weight"].shape[1] == 1 and a.state_dict()["fc.weight"].shape[0] == 5
    assert sum(p.numel() for p in a.parameters()) == check_model("torchvision:resnet18",
                                                                 {"num_classes": 5, "in_channels": 1})
    a.eval()
    images = torch.rand(2, 1, 16, 16)
    assert a(images).shape == (2, 5)
    assert torch.equal(a(images), a(images.flatten(1)))  # flat square images, as tabular pixels arrive
    assert not (tmp_path / "torch-home").exists()


def _digit_images(root: Path, count: int = 200) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in range(count):
        folder = root / f"digit{digits.target[i]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * (255 / 16)).astype(np.uint8)).save(folder / f"{i:04d}.png")


TASK = """\
name = "resnet18-digits"
seed = 0
[model]
name = "torchvision:resnet18"
kwargs = {{ num_classes = 10, in_channels = 1 }}
[dataset]
manifest = "{manifest}"
[optimizer]
name = "adam"
lr = 0.001
[training]
batch_size = 16
total_steps = 6
checkpoint_interval = 3
[peers]
min = 2
max = 2
"""


@pytest.mark.timeout(RUN_S + 60)
async def test_a_resnet18_task_on_an_image_folder_trains_across_two_peers(tmp_path: Path) -> None:
    _digit_images(tmp_path / "digits")
    with trio.fail_after(RUN_S):
        async with local_peers(2, tmp_path / "peers") as peers:
            store = peers[0].content.store

            def publish() -> str:
                source = read_source(str(tmp_path / "digits"), SourceOptions(image_size=(16, 16)))
                manifest, _ = build_source(store, source, 2)
                x, _ = next(iter(IPFSDataset(manifest, store=store)))
                assert x.shape == (1, 16, 16) and x.dtype == torch.float32  # what the model is fed
                cid = store.add_bytes(task_bytes(load_task(TASK.format(manifest=manifest))))
                store.pin_add(cid)
                return cid

            task_cid = await trio.to_thread.run_sync(publish)
            await peers.join_all(task_cid)
            final = await peers.wait_until(
                lambda: all(peers.status(i, task_cid).get("state") == "done" for i in range(2))
                and [peers.status(i, task_cid) for i in range(2)], RUN_S - 30, what="both members done")
    assert len({s["latest_model_cid"] for s in final}) == 1 and final[0]["step"] == 6
    assert final[0]["loss"] is not None and np.isfinite(final[0]["loss"])
