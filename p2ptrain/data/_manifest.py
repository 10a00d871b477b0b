"""The dataset manifest: what a dataset CID names — splits of shards by CID, with sample counts and specs.

A manifest is canonical JSON (sorted keys, no spaces, UTF-8) stored as a file in the content store, so
its CID names exactly one manifest and peers that build the same dataset get the same CID. It arrives
from the network, so :meth:`Manifest.from_json` is strict: known keys only, bounded sizes, depth, counts
and numbers, dtypes from an allow-list, valid CIDs, and bytes that are not in canonical form are refused
(two encodings of one manifest would make two CIDs). Every way to fail is one :class:`ManifestError`.

Optional fields describe what the numbers mean; each is absent from the JSON when unused, so a
manifest without it keeps the bytes (and CID) it had before the field existed: ``standardize``
(per-feature statistics readers apply), ``classes`` (the name of each label), ``pixels`` (features are
uint8 images, readers scale them) and ``tokens`` (features are token ids: the vocabulary size and the
CID of the tokenizer that made them).
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from p2ptrain.base import UserError, boundedjson
from p2ptrain.ipfs import ContentStore, FileTooLarge, InvalidCID, cid_str, parse_cid

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
    {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "bool"}
)
# Label names (an image folder's class folders, a table's string labels): ImageNet-21k has ~21,000.
MAX_CLASSES = 1 << 16
MAX_CLASS_NAME = 256
# Token vocabulary: the largest in use are ~256,000 (Gemma); token ids stay exact in int32.
MAX_VOCAB = 1 << 21
# The smallest dtype that holds every id of a vocabulary up to each size (what `dataset add` writes).
TOKEN_DTYPES = {"uint8": 1 << 8, "uint16": 1 << 16, "int32": MAX_VOCAB}
# The optional fields (the module docstring says what each is).
OPTIONAL = frozenset({"standardize", "classes", "pixels", "tokens"})
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
class Pixels:
    """Features are uint8 images ``(channels, height, width)``; readers yield float32
    ``(x / 255 - mean[c]) / std[c]`` per channel (mean 0 and std 1: pixels in [0, 1]). Set by
    ``dataset add`` of an image folder (``--normalize``: the train split's statistics)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class Tokens:
    """Features and labels are token ids below ``vocab_size`` (labels: the next token at every
    position). ``tokenizer``: the CID of the ``tokenizer.json`` that made them (any peer decodes
    with the same file); ``None``: the ids are bytes."""

    vocab_size: int
    tokenizer: str | None = None


@dataclass(frozen=True)
class Manifest:
    name: str
    features: TensorSpec
    labels: TensorSpec
    splits: dict[str, tuple[ShardRef, ...]]
    # Optional, and absent from the JSON when None: manifests from before it keep their bytes and CIDs.
    standardize: Standardize | None = None
    classes: tuple[str, ...] | None = None
    pixels: Pixels | None = None
    tokens: Tokens | None = None

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
        } | self._optional()

    def _optional(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.standardize is not None:
            out["standardize"] = {"mean": list(self.standardize.mean), "std": list(self.standardize.std)}
        if self.classes is not None:
            out["classes"] = list(self.classes)
        if self.pixels is not None:
            out["pixels"] = {"mean": list(self.pixels.mean), "std": list(self.pixels.std)}
        if self.tokens is not None:
            out["tokens"] = {"vocab_size": self.tokens.vocab_size} | (
                {"tokenizer": self.tokens.tokenizer} if self.tokens.tokenizer is not None else {})
        return out

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
    raw = _keys(raw, "manifest", keys | (OPTIONAL & set(raw)) if isinstance(raw, dict) else keys)
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
            refs.append(ShardRef(_cid(shard["cid"], f"{where}.cid"),
                                 _int(shard["num_samples"], f"{where}.num_samples", 1, MAX_SHARD_SAMPLES)))
        splits[split] = tuple(refs)
    features, labels = _spec(raw["features"], "features"), _spec(raw["labels"], "labels")
    standardize = _standardize(raw["standardize"], features) if "standardize" in raw else None
    classes = _classes(raw["classes"], labels) if "classes" in raw else None
    pixels = _pixels(raw["pixels"], features) if "pixels" in raw else None
    tokens = _tokens(raw["tokens"], features, labels) if "tokens" in raw else None
    if pixels is not None and standardize is not None:
        raise ManifestError("pixels and standardize are two ways to scale features: give one")
    return Manifest(raw["name"], features, labels, splits, standardize, classes, pixels, tokens)


def _cid(value: Any, where: str) -> str:
    try:
        cid = cid_str(parse_cid(value)) if isinstance(value, str) else None
    except InvalidCID as exc:
        raise ManifestError(f"{where}: {exc}") from None
    if cid is None or cid != value:  # (null passed here once)
        raise ManifestError(f"{where} must be a CID in canonical text form")
    return cid


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


def _classes(value: Any, labels: TensorSpec) -> tuple[str, ...]:
    if labels != TensorSpec("int64", ()):
        raise ManifestError("classes name int64 labels, one per sample")
    if type(value) is not list or not 1 <= len(value) <= MAX_CLASSES:
        raise ManifestError(f"classes must be a list of 1 to {MAX_CLASSES} names")
    for name in value:
        if (type(name) is not str or not 1 <= len(name) <= MAX_CLASS_NAME
                or any(unicodedata.category(c) in ("Cc", "Cs") for c in name)):
            raise ManifestError(f"a class name must be 1-{MAX_CLASS_NAME} printable characters")
    if len(set(value)) != len(value):
        raise ManifestError("class names must be distinct")
    return tuple(value)


def _pixels(obj: Any, features: TensorSpec) -> Pixels:
    obj = _keys(obj, "pixels", {"mean", "std"})
    if features.dtype != "uint8" or len(features.shape) != 3:
        raise ManifestError("pixels describe uint8 features of shape [channels, height, width]")
    channels = features.shape[0]
    std = _floats(obj["std"], "pixels.std", channels, 0.0)
    if not all(s > 0 for s in std):
        raise ManifestError("pixels.std must be positive")
    return Pixels(_floats(obj["mean"], "pixels.mean", channels, -math.inf), std)


def _tokens(obj: Any, features: TensorSpec, labels: TensorSpec) -> Tokens:
    keys = {"vocab_size"}
    obj = _keys(obj, "tokens", keys | ({"tokenizer"} & set(obj)) if isinstance(obj, dict) else keys)
    vocab = _int(obj["vocab_size"], "tokens.vocab_size", 2, MAX_VOCAB)
    for where, spec in (("features", features), ("labels", labels)):
        if spec.dtype not in TOKEN_DTYPES or len(spec.shape) != 1:
            raise ManifestError(f"tokens: {where} must be a sequence of {', '.join(TOKEN_DTYPES)} ids")
        if vocab > TOKEN_DTYPES[spec.dtype]:
            raise ManifestError(f"tokens: a vocabulary of {vocab} does not fit {where} of {spec.dtype}")
    if features.shape != labels.shape:
        raise ManifestError("tokens: features and labels must be sequences of one length")
    tokenizer = _cid(obj["tokenizer"], "tokens.tokenizer") if "tokenizer" in obj else None
    return Tokens(vocab, tokenizer)
