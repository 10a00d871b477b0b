"""Turn arrays into a published dataset: a seeded train/test split, equal-sized shards, a manifest.

Deterministic on purpose: the same arrays, shard count, fraction and seed give the same shard CIDs and
the same manifest CID on every machine, so peers can check they hold the same dataset by comparing one
string.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from p2ptrain.base import ArgumentError
from p2ptrain.data._manifest import Manifest, Pixels, ShardRef, Tokens
from p2ptrain.data._shards import encode_shard, spec_of
from p2ptrain.data._source import Source
from p2ptrain.data._standardize import compute as standardize_stats, pixel_stats
from p2ptrain.ipfs import ContentStore


def build_dataset(
    store: ContentStore,
    name: str,
    features: np.ndarray,
    labels: np.ndarray,
    num_shards: int,
    test_fraction: float = 0.2,
    seed: int = 0,
    standardize: bool = False,
    *,
    classes: tuple[str, ...] | None = None,
    pixels: Pixels | Literal["train"] | None = None,
    tokens: Tokens | None = None,
) -> tuple[str, Manifest]:
    """Store the shards and the manifest; return ``(manifest_cid, manifest)``.

    The train split gets ``num_shards`` shards; the test split (if ``test_fraction`` > 0) is cut into
    shards of the same size, so every shard costs about the same to fetch. ``classes``, ``pixels``
    and ``tokens`` go into the manifest as they are (:mod:`p2ptrain.data._manifest`), except
    ``pixels="train"``: the train split's per-channel statistics.
    """
    if len(features) != len(labels):
        raise ValueError("features and labels differ in length")
    if num_shards < 1:
        raise ValueError("num_shards must be at least 1")
    if not 0 <= test_fraction < 1:
        raise ValueError("test_fraction must be in [0, 1)")
    _check_fields(name, features, labels, classes, pixels, tokens)
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
    if pixels == "train":
        pixels = pixel_stats(features, splits["train"])
    manifest = Manifest(name, spec_of(features), spec_of(labels), refs, stats, classes, pixels, tokens)
    return manifest.save(store), manifest


def build_source(
    store: ContentStore,
    source: Source,
    num_shards: int,
    test_fraction: float = 0.2,
    seed: int = 0,
    *,
    name: str | None = None,
    standardize: bool = False,
    normalize: Pixels | Literal["train"] | None = None,
) -> tuple[str, Manifest]:
    """:func:`build_dataset` of what a reader made (:mod:`p2ptrain.data._read_source`): its tokenizer is
    stored first (the manifest names it by CID); an image source gets ``pixels`` (``normalize``, or
    plain ``x / 255``). The manifest is checked before any shard is stored, so a source the manifest
    would refuse (a class name, a vocabulary) writes nothing."""
    tokens = None
    if source.vocab_size is not None:
        tokenizer = None
        if source.tokenizer is not None:
            tokenizer = store.add_bytes(source.tokenizer, cid_version=1, only_hash=True)
        tokens = Tokens(source.vocab_size, tokenizer)
    pixels: Pixels | Literal["train"] | None = None
    if source.images:
        if standardize:
            raise ArgumentError("{standardize} is per feature, for tables and arrays: an image folder takes {normalize}")
        channels = source.features.shape[1]
        pixels = normalize or Pixels((0.0,) * channels, (1.0,) * channels)
    elif normalize is not None:
        raise ArgumentError("{normalize} is for image folders (tables and arrays: {standardize})")
    built = build_dataset(store, name or source.name, source.features, source.labels, num_shards, test_fraction,
                          seed, standardize, classes=source.classes, pixels=pixels, tokens=tokens)
    if source.tokenizer is not None:
        store.add_bytes(source.tokenizer, cid_version=1)
    return built


def dataset_cids(manifest_cid: str, manifest: Manifest) -> list[str]:
    """Every CID a dataset consists of: its shards, its tokenizer, its manifest (what to pin)."""
    shards = [ref.cid for refs in manifest.splits.values() for ref in refs]
    tokenizer = [manifest.tokens.tokenizer] if manifest.tokens and manifest.tokens.tokenizer else []
    return shards + tokenizer + [manifest_cid]


# Stands in for the shards while the manifest's other fields are checked (the empty file's CIDv1).
_NO_SHARD = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"


def _check_fields(name: str, features: np.ndarray, labels: np.ndarray, classes: tuple[str, ...] | None,
                  pixels: Pixels | Literal["train"] | None, tokens: Tokens | None) -> None:
    """Refuse (ManifestError) what the manifest would refuse, before any shard is stored."""
    if pixels == "train":
        channels = features.shape[1] if features.ndim == 4 else 1
        pixels = Pixels((0.0,) * channels, (1.0,) * channels)
    Manifest(name, spec_of(features), spec_of(labels), {"train": (ShardRef(_NO_SHARD, 1),)}, None, classes,
             pixels, tokens).to_json()
