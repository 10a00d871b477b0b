"""Content layer speed: the embedded importer's add MB/s and the IPFS data loader's samples/s.

Everything is measured in one run against a baseline taken in the same run, because the machine is
shared and noisy; report the ratios. Fetch MB/s between two nodes is in the sibling bench/exchange.py.

    .venv/bin/python bench/content.py                    # 256 MiB add, 200k-sample loader, table
    .venv/bin/python bench/content.py --mib 64 --samples 50000 --repeat 3 --json

add:    ``hashlib.sha256`` over the same bytes (the floor any verified importer pays), then our importer
        with ``only_hash`` (CIDs only, like ``ipfs add -n``) and with the blocks written to a store
        (fsync per block), then ``cat`` of the stored file (every block read back and verified).
loader: the same float32 arrays as N shards, read through ``DataLoader(batch_size=256)`` from local
        ``.npy`` files (the baseline: ``np.load`` + the same shuffle and per-sample yield) and from
        ``IPFSDataset`` once its shards are cached in the store (verified safetensors via ``cat``).
Speeds are the best of ``--repeat`` runs; the two loaders alternate so drift hits both alike, and their
ratio is of the medians. With ``num_workers=0`` the CPU-time ratio is printed too: it is far less
sensitive to other users' load.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from p2ptrain.data import IPFSDataset, build_dataset
from p2ptrain.ipfs import EmbeddedStore

MIB = 1 << 20


def best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_add(mib: int, repeat: int, work: Path) -> dict[str, float]:
    data = os.urandom(mib * MIB)
    src = work / "blob.bin"
    src.write_bytes(data)
    mbs = lambda seconds: mib * MIB / seconds / 1e6  # noqa: E731
    out = {"sha256_MBps": mbs(best_time(lambda: hashlib.sha256(data).digest(), repeat))}
    hasher = EmbeddedStore(work / "hash-only")
    out["add_only_hash_MBps"] = mbs(best_time(lambda: hasher.add_file(src, only_hash=True), repeat))

    homes = iter(range(repeat))
    stored: list[tuple[EmbeddedStore, str]] = []

    def add_to_store() -> None:
        store = EmbeddedStore(work / f"store-{next(homes)}")  # a fresh store: every block is written
        stored.append((store, store.add_file(src)))

    out["add_store_MBps"] = mbs(best_time(add_to_store, repeat))
    store, cid = stored[-1]
    out["cat_MBps"] = mbs(best_time(lambda: store.cat(cid), repeat))
    assert store.cat(cid) == data
    return out


class LocalNpyDataset(IterableDataset):
    """The baseline: shards as local .npy files, same shard/sample shuffle and yield as IPFSDataset."""

    def __init__(self, files: list[tuple[Path, Path]], seed: int = 0) -> None:
        self.files, self.seed, self.epoch = files, seed, 0

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        ids = list(rng.permutation(len(self.files)))
        worker = get_worker_info()
        if worker is not None:
            ids = ids[worker.id :: worker.num_workers]
        for index in ids:
            xf, yf = self.files[index]
            features = torch.from_numpy(np.load(xf, allow_pickle=False))
            labels = torch.from_numpy(np.load(yf, allow_pickle=False))
            order = torch.from_numpy(
                np.random.default_rng([self.seed, self.epoch, index]).permutation(len(labels))
            )
            features, labels = features[order], labels[order]
            yield from zip(features.unbind(0), labels.unbind(0))


def drain(dataset, workers: int) -> int:
    count = 0
    for _, y in DataLoader(dataset, batch_size=256, num_workers=workers):
        count += len(y)
    return count


def bench_loader(samples: int, dim: int, shards: int, repeat: int, workers: int, work: Path):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((samples, dim), dtype=np.float32)
    labels = rng.integers(0, 10, samples)
    store = EmbeddedStore(work / "data-home")
    cid, manifest = build_dataset(store, "bench", features, labels, shards, test_fraction=0)
    # The baseline reads exactly the shards the manifest names, as .npy files.
    files = []
    dataset = IPFSDataset(cid, store=store)
    for i in range(shards):
        x, y = dataset.load_shard(i)
        files.append((work / f"x{i}.npy", work / f"y{i}.npy"))
        np.save(files[-1][0], x.numpy())
        np.save(files[-1][1], y.numpy())
    local = LocalNpyDataset(files)
    assert drain(dataset, workers) == drain(local, workers) == samples  # warm: caches and page cache
    wall: dict[str, list[float]] = {"local": [], "ipfs": []}
    cpu: dict[str, list[float]] = {"local": [], "ipfs": []}
    for _ in range(repeat):
        for name, ds in (("local", local), ("ipfs", dataset)):
            w0, c0 = time.perf_counter(), time.process_time()
            drain(ds, workers)
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    median = statistics.median
    out = {
        f"loader_local_npy_sps_w{workers}": samples / min(wall["local"]),
        f"loader_ipfs_cached_sps_w{workers}": samples / min(wall["ipfs"]),
        # Ratios of medians over the alternating runs: one lucky or unlucky run on a shared machine
        # moves a ratio of minimums by ±10%.
        f"loader_ratio_w{workers}": median(wall["local"]) / median(wall["ipfs"]),
    }
    if workers == 0:
        # All work is in this process (the prefetch thread included), so CPU time is a steadier
        # measure than wall time on a machine others are loading.
        out["loader_ratio_cpu_w0"] = median(cpu["local"]) / median(cpu["ipfs"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="file size for add (MiB)")
    parser.add_argument("--samples", type=int, default=200_000, help="loader samples")
    parser.add_argument("--dim", type=int, default=64, help="features per sample (float32)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", default="0,2", help="DataLoader num_workers values to try")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-") as tmp:
        work = Path(tmp)
        results.update(bench_add(args.mib, args.repeat, work))
        for workers in (int(w) for w in args.workers.split(",")):
            results.update(bench_loader(args.samples, args.dim, args.shards, args.repeat, workers,
                                        work))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for key, value in results.items():
        print(f"{key:<32}{value:>14,.2f}")


if __name__ == "__main__":
    main()
