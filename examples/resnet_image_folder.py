"""A torchvision ResNet-18 trained on a folder of images (ROOT/CLASS/*.png|jpg), shared by CID.

Every member reads the same folder into its store (the same files give the same dataset CID), and
``p2ptrain.train`` deals the dataset's shards out among the members. The model is p2ptrain's
``torchvision:resnet18`` builder (weights=None: nothing is downloaded), built from one seed, so
every member starts from the same weights. Needs torchvision beside a torch it was built for
(``pip install torch==2.14.1 torchvision==0.29.1``); with no ``--images``, a folder of
scikit-learn's digits (8x8 grayscale PNGs) is written to stand in for your photos.

    python examples/resnet_image_folder.py --images ./photos --member 0 --members 2 --listen /ip4/127.0.0.1/tcp/4001
    python examples/resnet_image_folder.py --images ./photos --member 1 --members 2 \
        --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/<its id>

The same model as a task that ``node start --accept-tasks`` peers join: ``p2ptrain dataset add ./photos
--image-size 64`` and ``[model] name = "torchvision:resnet18"`` (docs/training.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from _common import parse_args, report, run_member

import p2ptrain
from p2ptrain.data import IPFSDataset, SourceOptions, build_source, read_source
from p2ptrain.ipfs import open_store
from p2ptrain.models import build_model

RUN = "resnet18-images"


def digit_images(root: Path, count: int = 400) -> Path:
    """The first ``count`` digits as grayscale PNGs in ROOT/digitN/: a stand-in image folder."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i in range(count):
        folder = root / f"digit{digits.target[i]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((digits.images[i] * (255 / 16)).astype(np.uint8)).save(folder / f"{i:04d}.png")
    return root


def main() -> None:
    args = parse_args(__doc__, steps=30, run=RUN, extra=[
        ("--images", {"type": Path, "help": "the image folder ROOT/CLASS/*.png|jpg (default: digits written as PNGs)"}),
        ("--image-size", {"type": int, "default": 16, "help": "pixels a side the images are scaled to (default 16)"})])
    try:  # before a minute of reading images: it said so in a traceback once the dataset was stored
        import torchvision  # noqa: F401
    except Exception as exc:  # absent, or built for another torch (an ImportError, or a RuntimeError from its ops)
        raise SystemExit(f"resnet_image_folder.py: needs torchvision beside this torch ({exc}): "
                         "pip install torch==2.14.1 torchvision==0.29.1") from None
    images, size = args.images, args.image_size
    home = Path(args.home)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory() as scratch:
        folder = images or digit_images(Path(scratch) / "digits")
        source = read_source(str(folder), SourceOptions(image_size=(size, size)))
        store = open_store(home)
        manifest_cid, manifest = build_source(store, source, num_shards=4)
    assert manifest.classes is not None
    channels = manifest.features.shape[0]
    model = build_model("torchvision:resnet18", {"num_classes": len(manifest.classes), "in_channels": channels},
                        seed=0)
    test = list(IPFSDataset(manifest_cid, split="test", store=store, shuffle=False))
    test_data = torch.utils.data.TensorDataset(torch.stack([x for x, _ in test]), torch.stack([y for _, y in test]))
    result = p2ptrain.train(model, IPFSDataset(manifest_cid, store=store), test_data=test_data, steps=args.steps,
                            batch_size=16, optimizer=lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
                            run=args.run, home=home, listen=[args.listen], bootstrap=args.bootstrap,
                            min_peers=min(2, args.members), max_peers=args.members, checkpoint_every=10, density=0.05)
    report(model, test_data, member=args.member, model_cid=result.model_cid, run_cid=result.run_cid,
           steps=result.steps, dataset=manifest_cid)


if __name__ == "__main__":
    run_member(main)
