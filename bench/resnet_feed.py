"""ResNet-18 training steps fed by ``IPFSDataset`` from an image folder's dataset, against the same
decoded images in memory (``TensorDataset``), in the same run.

    /work/venv-tv/bin/python bench/resnet_feed.py                 # 1,000 images at 64x64, 3 repeats
    /work/venv-tv/bin/python bench/resnet_feed.py --images 2000 --batches 30 --repeat 5 --json

Needs torchvision beside its torch (a venv with ``torch==2.14.1 torchvision==0.29.1``: the project's
venv pins torch 2.13.0 CPU, beside which PyPI's torchvision does not import). Data: the image folder
of bench/data_formats.py (JPEG and PNG crops of scikit-learn's two sample photos, 10 classes), added
with ``dataset add``'s path (``read_source`` + ``build_source``) into an embedded store in a temporary
folder; nothing is downloaded. Each measure is ``--batches`` training steps of p2ptrain's
``torchvision:resnet18`` builder (weights=None, 10 classes; SGD, batch 32, cross-entropy) on the CPU,
the batches drawn from a ``DataLoader`` over one of the two datasets (shuffled as each does); samples/s
is over the steps' wall time, data loading included. Runs alternate; ratios are of the medians.
``torch.set_num_threads(1)``: a 2-core machine shared with others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from data_formats import make_images  # bench/: the same folder as the data-format bench
from torch.utils.data import DataLoader, TensorDataset

from p2ptrain.data import IPFSDataset, SourceOptions, build_source, read_source
from p2ptrain.ipfs import EmbeddedStore
from p2ptrain.models import build_model

BATCH = 32


def steps_per_s(model: torch.nn.Module, loader: DataLoader, batches: int) -> float:
    """Samples per second of ``batches`` training steps with batches from ``loader``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    seen = 0
    start = time.perf_counter()
    while seen < batches * BATCH:
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            seen += len(x)
            if seen >= batches * BATCH:
                break
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1000, help="images in the folder (default 1000)")
    parser.add_argument("--image-size", type=int, default=64, help="side the images are scaled to (default 64)")
    parser.add_argument("--batches", type=int, default=20, help="training steps per measure (default 20)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs of each measure (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_images(work / "images", args.images)
        store = EmbeddedStore(work / "home")
        source = read_source(str(work / "images"), SourceOptions(image_size=(args.image_size, args.image_size)))
        cid, _ = build_source(store, source, 8)
        shared = IPFSDataset(cid, store=store)
        xs, ys = zip(*shared)  # decoded once, the same float32 pixels IPFSDataset yields
        memory = TensorDataset(torch.stack(xs), torch.stack(ys))
        loaders = {"ipfs": DataLoader(shared, batch_size=BATCH, drop_last=True),
                   "memory": DataLoader(memory, batch_size=BATCH, shuffle=True, drop_last=True)}
        model = build_model("torchvision:resnet18", {"num_classes": 10}, seed=0)
        steps_per_s(model, loaders["memory"], 2)  # warm-up: allocator, kernels
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        for _ in range(args.repeat):
            for name, loader in loaders.items():
                rates[name].append(steps_per_s(model, loader, args.batches))
    result = {
        "images": args.images, "image_size": args.image_size, "train_samples": len(memory),
        "ipfs_samples_per_s": max(rates["ipfs"]), "memory_samples_per_s": max(rates["memory"]),
        "ratio_ipfs_to_memory": statistics.median(rates["ipfs"]) / statistics.median(rates["memory"]),
        "runs": rates, "torch": torch.__version__,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"ResNet-18 steps fed by IPFSDataset: {result['ipfs_samples_per_s']:.1f} samples/s; "
          f"by a TensorDataset in memory: {result['memory_samples_per_s']:.1f} samples/s; "
          f"ratio of medians {result['ratio_ipfs_to_memory']:.3f}")


if __name__ == "__main__":
    main()
