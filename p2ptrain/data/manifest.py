"""The dataset manifest: what a dataset CID names — splits of shards by CID, with sample counts and specs.

A manifest is canonical JSON (sorted keys, no spaces, UTF-8) stored as a file in the content store, so
its CID names exactly one manifest and peers that build the same dataset get the same CID. It arrives
from the network, so :meth:`Manifest.from_json` is strict: known keys only, bounded sizes, depth, counts
and numbers, dtypes from an allow-list, valid CIDs, and bytes that are not in canonical form are refused
(two encodings of one manifest would make two CIDs). Every way to fail is one :class:`ManifestError`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from p2ptrain import boundedjson
from p2ptrain.errors import UserError
from p2ptrain.ipfs.cid import InvalidCID, cid_str, parse_cid
from p2ptrain.ipfs.store import ContentStore
from p2ptrain.ipfs.unixfs import FileTooLarge

SCHEMA = "p2ptrain.dataset"
VERSION = 1
# 4 MiB: 100,000 shard entries of ~70 B each fit, with room.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
# Shards over all splits: 100,000 shards of 10 MiB is a 1 TB dataset.
MAX_SHARDS = 100_000
# Dimensions of one sample (an image is 3); numpy allows 64.
MAX_DIMS = 8
# Elements of one sample: 2**24 (a 3x2048x2048 image is 12.6M); a shard's header is checked against
# this shape, so a larger sample could only be refused later, after its shard was fetched.
MAX_SAMPLE_ELEMENTS = 1 << 24
# Samples of one shard: 2**31, so sample counts and their sums over MAX_SHARDS stay exact everywhere.
MAX_SHARD_SAMPLES = 1 << 31
# A manifest nests four levels (manifest > splits > list > shard); eight refuse any bomb early.
MAX_DEPTH = 8
# Features a manifest may carry standardization for (a mean and a std each): 65,536 take about
# 1.6 MB of canonical JSON, within MAX_MANIFEST_BYTES; wider samples (images) are not what
# per-feature standardization is for.
MAX_STANDARDIZE_FEATURES = 1 << 16
DTYPES = frozenset(
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"}
)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ManifestError(UserError, ValueError):
    """Bytes that are not a valid dataset manifest (the CLI prints it as one line)."""


@dataclass(frozen=True)
class TensorSpec:
    """The dtype and per-sample shape of one array of every shard."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardRef:
    cid: str
    num_samples: int


@dataclass(frozen=True)
class Standardize:
    """Per-feature mean and standard deviation of the train split, flattened in sample order: readers
    (``IPFSDataset``, so training and ``model eval``) map ``x`` to ``(x - mean) / std`` (a feature
    with std 0 to ``x - mean``). Set by ``dataset add --standardize``."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class Manifest:
    name: str
    features: TensorSpec
    labels: TensorSpec
    splits: dict[str, tuple[ShardRef, ...]]
    # Optional, and absent from the JSON when None: manifests from before it keep their bytes and CIDs.
    standardize: Standardize | None = None

    def num_samples(self, split: str) -> int:
        return sum(s.num_samples for s in self.shards(split))

    def shards(self, split: str) -> tuple[ShardRef, ...]:
        try:
            return self.splits[split]
        except KeyError:
            raise ManifestError(
                f"dataset {self.name!r} has no split {split!r} (it has {', '.join(self.splits)})"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "name": self.name,
            "features": {"dtype": self.features.dtype, "shape": list(self.features.shape)},
            "labels": {"dtype": self.labels.dtype, "shape": list(self.labels.shape)},
            "splits": {
                split: [{"cid": s.cid, "num_samples": s.num_samples} for s in shards]
                for split, shards in self.splits.items()
            },
        } | ({"standardize": {"mean": list(self.standardize.mean), "std": list(self.standardize.std)}}
             if self.standardize is not None else {})

    def to_json(self) -> bytes:
        """The canonical encoding; validated, so a manifest we write is one we would accept."""
        data = boundedjson.canonical(self.to_dict())
        Manifest.from_json(data)
        return data

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            raw = boundedjson.loads(data, max_depth=MAX_DEPTH, what="manifest")
        except boundedjson.JSONBoundsError as exc:
            raise ManifestError(str(exc)) from None
        manifest = _parse(raw)
        if boundedjson.canonical(raw) != data:
            raise ManifestError("manifest is not in canonical JSON form (sorted keys, no spaces)")
        return manifest

    def save(self, store: ContentStore) -> str:
        """Store the manifest and return its CID."""
        return store.add_bytes(self.to_json(), cid_version=1)

    @classmethod
    def load(cls, store: ContentStore, cid: str) -> Manifest:
        """Read and check the manifest under ``cid``; a file over the manifest limit is refused unread."""
        try:
            data = store.cat(cid, max_bytes=MAX_MANIFEST_BYTES)
        except FileTooLarge:
            raise ManifestError(f"manifest {cid} is over the {MAX_MANIFEST_BYTES} B limit") from None
        return cls.from_json(data)


def _keys(obj: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where} must be an object")
    if set(obj) != keys:
        raise ManifestError(f"{where} must have exactly the keys {sorted(keys)}, not {sorted(obj)}")
    return obj


def _int(value: Any, where: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ManifestError(f"{where} must be an integer from {low} to {high}")
    return value


def _spec(obj: Any, where: str) -> TensorSpec:
    obj = _keys(obj, where, {"dtype", "shape"})
    if type(obj["dtype"]) is not str or obj["dtype"] not in DTYPES:
        raise ManifestError(f"{where}.dtype must be one of {sorted(DTYPES)}")
    shape = obj["shape"]
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise ManifestError(f"{where}.shape must be a list of at most {MAX_DIMS} sizes")
    dims = tuple(_int(n, f"{where}.shape", 1, MAX_SAMPLE_ELEMENTS) for n in shape)
    if math.prod(dims) > MAX_SAMPLE_ELEMENTS:
        raise ManifestError(f"{where}.shape has more than {MAX_SAMPLE_ELEMENTS} elements per sample")
    return TensorSpec(obj["dtype"], dims)


def _parse(raw: Any) -> Manifest:
    keys = {"schema", "version", "name", "features", "labels", "splits"}
    raw = _keys(raw, "manifest", keys | ({"standardize"} & set(raw)) if isinstance(raw, dict) else keys)
    if raw["schema"] != SCHEMA or type(raw["version"]) is not int or raw["version"] != VERSION:
        raise ManifestError(f"not a {SCHEMA} version {VERSION} manifest")
    if not isinstance(raw["name"], str) or not _NAME.fullmatch(raw["name"]):
        raise ManifestError("name must be 1-64 characters of letters, digits, '.', '_', '-'")
    if not isinstance(raw["splits"], dict) or not raw["splits"]:
        raise ManifestError("splits must be a non-empty object")
    splits: dict[str, tuple[ShardRef, ...]] = {}
    total = 0
    for split, shards in raw["splits"].items():
        if not _NAME.fullmatch(split):
            raise ManifestError(f"split name {split!r} is not allowed")
        if not isinstance(shards, list) or not shards:
            raise ManifestError(f"split {split!r} must be a non-empty list of shards")
        total += len(shards)
        if total > MAX_SHARDS:
            raise ManifestError(f"more than {MAX_SHARDS} shards")
        refs = []
        for i, shard in enumerate(shards):
            where = f"splits.{split}[{i}]"
            shard = _keys(shard, where, {"cid", "num_samples"})
            try:
                cid = cid_str(parse_cid(shard["cid"])) if isinstance(shard["cid"], str) else None
            except InvalidCID as exc:
                raise ManifestError(f"{where}.cid: {exc}") from None
            if cid is None or cid != shard["cid"]:  # (null passed here once)
                raise ManifestError(f"{where}.cid must be a CID in canonical text form")
            refs.append(ShardRef(cid, _int(shard["num_samples"], f"{where}.num_samples", 1, MAX_SHARD_SAMPLES)))
        splits[split] = tuple(refs)
    features = _spec(raw["features"], "features")
    standardize = _standardize(raw["standardize"], features) if "standardize" in raw else None
    return Manifest(raw["name"], features, _spec(raw["labels"], "labels"), splits, standardize)


def _floats(value: Any, where: str, count: int, low: float) -> tuple[float, ...]:
    if type(value) is not list or len(value) != count:
        raise ManifestError(f"{where} must be a list of {count} numbers (one per feature)")
    if not all(type(v) in (int, float) and math.isfinite(v) and v >= low for v in value):
        raise ManifestError(f"{where} must hold finite numbers" + (f" >= {low}" if low > -math.inf else ""))
    return tuple(float(v) for v in value)


def _standardize(obj: Any, features: TensorSpec) -> Standardize:
    obj = _keys(obj, "standardize", {"mean", "std"})
    count = math.prod(features.shape)
    if count > MAX_STANDARDIZE_FEATURES:
        raise ManifestError(f"standardize: {count} features exceed {MAX_STANDARDIZE_FEATURES}")
    return Standardize(_floats(obj["mean"], "standardize.mean", count, -math.inf),
                       _floats(obj["std"], "standardize.std", count, 0.0))
