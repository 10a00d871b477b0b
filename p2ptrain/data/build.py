"""Turn arrays into a published dataset: a seeded train/test split, equal-sized shards, a manifest.

Deterministic on purpose: the same arrays, shard count, fraction and seed give the same shard CIDs and
the same manifest CID on every machine, so peers can check they hold the same dataset by comparing one
string.
"""

from __future__ import annotations

import math

import numpy as np

from p2ptrain.data.manifest import Manifest, ShardRef
from p2ptrain.data.shards import encode_shard, spec_of
from p2ptrain.data.standardize import compute as standardize_stats
from p2ptrain.ipfs.store import ContentStore


def build_dataset(
    store: ContentStore,
    name: str,
    features: np.ndarray,
    labels: np.ndarray,
    num_shards: int,
    test_fraction: float = 0.2,
    seed: int = 0,
    standardize: bool = False,
) -> tuple[str, Manifest]:
    """Store the shards and the manifest; return ``(manifest_cid, manifest)``.

    The train split gets ``num_shards`` shards; the test split (if ``test_fraction`` > 0) is cut into
    shards of the same size, so every shard costs about the same to fetch.
    """
    if len(features) != len(labels):
        raise ValueError("features and labels differ in length")
    if num_shards < 1:
        raise ValueError("num_shards must be at least 1")
    if not 0 <= test_fraction < 1:
        raise ValueError("test_fraction must be in [0, 1)")
    order = np.random.default_rng(seed).permutation(len(features))
    n_test = int(round(len(order) * test_fraction))
    n_train = len(order) - n_test
    if n_train < num_shards:
        raise ValueError(f"{n_train} training samples cannot fill {num_shards} shards")
    shard_size = math.ceil(n_train / num_shards)
    splits = {"train": order[:n_train]}
    if n_test:
        splits["test"] = order[n_train:]
    refs: dict[str, tuple[ShardRef, ...]] = {}
    for split, idx in splits.items():
        count = num_shards if split == "train" else math.ceil(len(idx) / shard_size)
        refs[split] = tuple(
            ShardRef(store.add_bytes(encode_shard(features[part], labels[part]), cid_version=1),
                     len(part))
            for part in np.array_split(idx, count)
        )
    stats = standardize_stats(features[splits["train"]]) if standardize else None
    manifest = Manifest(name, spec_of(features), spec_of(labels), refs, stats)
    return manifest.save(store), manifest
