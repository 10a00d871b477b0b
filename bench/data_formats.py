"""``dataset add`` of an image folder and a Parquet file, and IPFSDataset reading what it made,
each against the same data read directly (Pillow, pyarrow) in the same run.

    .venv/bin/python bench/data_formats.py                  # 3,000 images to 64x64, 500k Parquet rows
    .venv/bin/python bench/data_formats.py --images 1000 --rows 100000 --repeat 3 --json

Data (made here, nothing is downloaded): an image folder of 10 classes of JPEG and PNG files (half
each, 96-192 px a side), cut at random from scikit-learn's two sample photos; a Parquet file of
``--rows`` rows of 64 float32 features (a fixed-size list column) and an int64 label.

add:    MB/s of input files through ``dataset add``'s path in this process (``read_source`` then
        ``build_source`` into a fresh embedded store: decode, shard, hash, write, fsync) against the
        same files read directly: Pillow ``open`` / ``convert`` / ``ImageOps.fit`` to the same size into
        one uint8 array, or ``pq.read_table`` into numpy. The add's read alone (no store) is shown too.
loader: samples/s of one epoch through ``DataLoader(batch_size=64, shuffle as each does)`` once the
        dataset is in the local store: ``IPFSDataset`` against an ``ImageFolder``-like reader (a file
        list, Pillow decode + the same resize + ``x / 255`` per sample; torchvision's own ``ImageFolder``
        when it imports) and a per-sample pyarrow reader (``iter_batches``, rows yielded one by one),
        and against the decoded arrays in memory (``TensorDataset``: the floor of any per-sample loader).
        Ratios are of the medians of alternating runs; CPU time too (steadier under other users' load).
``torch.set_num_threads(1)``: the loaders are single-process, as on a 2-core machine shared with others.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image, ImageOps
from sklearn.datasets import load_sample_images
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from p2ptrain.data import IPFSDataset, SourceOptions, build_source, read_source
from p2ptrain.ipfs import EmbeddedStore

BATCH = 64


def make_images(root: Path, count: int) -> int:
    """``count`` crops of the sample photos in 10 class folders; returns their total bytes."""
    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    total = 0
    for i in range(count):
        photo = photos[i % len(photos)]
        h, w = (int(v) for v in rng.integers(96, 193, 2))
        top, left = int(rng.integers(0, photo.shape[0] - h)), int(rng.integers(0, photo.shape[1] - w))
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:05d}.{'jpg' if i % 2 else 'png'}"
        Image.fromarray(photo[top:top + h, left:left + w]).save(path, quality=90)
        total += path.stat().st_size
    return total


def make_parquet(path: Path, rows: int) -> int:
    rng = np.random.default_rng(0)
    features = rng.standard_normal((rows, 64), dtype=np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 64)
    pq.write_table(pa.table({"x": column, "y": rng.integers(0, 10, rows)}), path)
    return path.stat().st_size


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def pillow_direct(root: Path, size: int) -> np.ndarray:
    files = sorted(root.glob("*/*"))
    out = np.empty((len(files), 3, size, size), np.uint8)
    for i, path in enumerate(files):
        with Image.open(path) as im:
            fitted = ImageOps.fit(im.convert("RGB"), (size, size), Image.Resampling.BILINEAR)
            out[i] = np.asarray(fitted).transpose(2, 0, 1)
    return out


def pyarrow_direct(path: Path) -> tuple[np.ndarray, np.ndarray]:
    table = pq.read_table(path, columns=["x", "y"])
    x = table.column("x").combine_chunks()
    return x.flatten().to_numpy().reshape(len(x), -1), table.column("y").to_numpy()


def bench_add(name: str, spec: str, options: SourceOptions, direct, input_bytes: int, repeat: int,
              work: Path) -> tuple[dict[str, float], str, EmbeddedStore]:
    homes = iter(range(repeat))
    made: list[tuple[str, EmbeddedStore]] = []

    def add() -> None:
        store = EmbeddedStore(work / f"{name}-home-{next(homes)}")
        made.append((build_source(store, read_source(spec, options), 8)[0], store))

    runs = {"direct": [], "read": [], "add": []}
    for _ in range(repeat):  # alternating, so the machine's drift hits each alike
        runs["direct"].append(timed(direct)[0])
        runs["read"].append(timed(lambda: read_source(spec, options))[0])
        runs["add"].append(timed(add)[0])
    mbs = {k: input_bytes / min(v) / 1e6 for k, v in runs.items()}
    return ({f"{name}_input_MB": input_bytes / 1e6, f"{name}_direct_MBps": mbs["direct"],
             f"{name}_add_read_only_MBps": mbs["read"], f"{name}_add_MBps": mbs["add"],
             f"{name}_add_vs_direct": statistics.median(runs["direct"]) / statistics.median(runs["add"])},
            *made[-1])


class ImageFolderLike(Dataset):
    """What ``torchvision.datasets.ImageFolder`` with Resize/CenterCrop/ToTensor does per sample."""

    def __init__(self, root: Path, size: int) -> None:
        classes = sorted(p.name for p in root.iterdir())
        self.samples = [(p, classes.index(p.parent.name)) for p in sorted(root.glob("*/*"))]
        self.size = size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with Image.open(path) as im:
            pixels = np.asarray(ImageOps.fit(im.convert("RGB"), (self.size, self.size), Image.Resampling.BILINEAR))
        return torch.from_numpy(pixels.transpose(2, 0, 1).astype(np.float32) / 255), label


def image_folder_reader(root: Path, size: int) -> tuple[Dataset, str]:
    try:
        from torchvision import datasets, transforms
    except Exception:  # (not installed, or a build that does not match torch)
        return ImageFolderLike(root, size), "ImageFolder-like (Pillow)"
    transform = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), transforms.ToTensor()])
    return datasets.ImageFolder(str(root), transform=transform), "torchvision ImageFolder"


class PyarrowRows(IterableDataset):
    """Rows of a Parquet file one by one, as a user's pyarrow-backed dataset would yield them."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self):
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=8192, columns=["x", "y"]):
            x = torch.from_numpy(batch.column("x").flatten().to_numpy().reshape(batch.num_rows, -1))
            yield from zip(x.unbind(0), torch.from_numpy(batch.column("y").to_numpy()).unbind(0))


class AllSplits(IterableDataset):
    """Every split of a dataset, one after the other: the same samples the direct readers see."""

    def __init__(self, cid: str, store: EmbeddedStore) -> None:
        manifest = IPFSDataset(cid, store=store).manifest
        self.parts = [IPFSDataset(cid, split=s, store=store) for s in manifest.splits]

    def __iter__(self):
        for part in self.parts:
            yield from part


def drain(dataset, shuffle: bool) -> int:
    return sum(len(y) for _, y in DataLoader(dataset, batch_size=BATCH, shuffle=shuffle))


def bench_loader(name: str, readers: dict[str, tuple[object, bool]], repeat: int) -> dict[str, float]:
    """samples/s of each reader (name -> (dataset, shuffle in DataLoader)), alternating runs."""
    counts = {k: drain(ds, shuffle) for k, (ds, shuffle) in readers.items()}  # warm: caches, page cache
    assert len(set(counts.values())) == 1, counts
    wall = {k: [] for k in readers}
    cpu = {k: [] for k in readers}
    for _ in range(repeat):
        for k, (ds, shuffle) in readers.items():
            w, c = timed(lambda: drain(ds, shuffle))
            wall[k].append(w)
            cpu[k].append(c)
    samples = next(iter(counts.values()))
    out = {f"{name}_{k}_sps": samples / min(v) for k, v in wall.items()}
    for k in readers:
        if k != "ipfs":
            out[f"{name}_ipfs_vs_{k}"] = statistics.median(wall[k]) / statistics.median(wall["ipfs"])
            out[f"{name}_ipfs_vs_{k}_cpu"] = statistics.median(cpu[k]) / statistics.median(cpu["ipfs"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3000, help="images in the folder (default 3000)")
    parser.add_argument("--image-size", type=int, default=64, help="side the images are scaled to (default 64)")
    parser.add_argument("--rows", type=int, default=500_000, help="rows of the Parquet file (default 500000)")
    parser.add_argument("--repeat", type=int, default=5, help="alternating runs of each measure (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # the pyarrow reader's views
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-data-") as tmp:
        work = Path(tmp)
        size = args.image_size
        image_bytes = make_images(work / "images", args.images)
        stats, cid, store = bench_add("images", str(work / "images"), SourceOptions(image_size=(size, size)),
                                      lambda: pillow_direct(work / "images", size), image_bytes, args.repeat, work)
        out.update(stats)
        folder, kind = image_folder_reader(work / "images", size)
        out["images_baseline"] = kind
        arrays = list(AllSplits(cid, store))
        memory = TensorDataset(torch.stack([x for x, _ in arrays]), torch.stack([y for _, y in arrays]))
        out.update(bench_loader("images", {"ipfs": (AllSplits(cid, store), False), "folder": (folder, True),
                                           "memory": (memory, True)}, args.repeat))

        table_bytes = make_parquet(work / "table.parquet", args.rows)
        stats, cid, store = bench_add("parquet", str(work / "table.parquet"), SourceOptions(label="y"),
                                      lambda: pyarrow_direct(work / "table.parquet"), table_bytes, args.repeat, work)
        out.update(stats)
        memory = TensorDataset(*(torch.from_numpy(a.copy()) for a in pyarrow_direct(work / "table.parquet")))
        out.update(bench_loader("parquet", {"ipfs": (AllSplits(cid, store), False),
                                            "pyarrow": (PyarrowRows(work / "table.parquet"), False),
                                            "memory": (memory, True)}, args.repeat))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for key, value in out.items():
        print(f"{key:<40} {value:,.2f}" if isinstance(value, float) else f"{key:<40} {value}")


if __name__ == "__main__":
    main()
