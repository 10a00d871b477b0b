"""Manifests are canonical, strictly validated, and stored by CID."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.data import Manifest, ManifestError, Pixels, build_dataset
from p2ptrain.data._manifest import ShardRef, TensorSpec, Tokens
from p2ptrain.data._shards import ShardError, decode_shard, encode_shard
from p2ptrain.ipfs import EmbeddedStore, make_cid

SHARD = make_cid(b"shard").encode("base32")
GOOD = Manifest(
    "toy",
    TensorSpec("float32", (2, 3)),
    TensorSpec("int64", ()),
    {"train": (ShardRef(SHARD, 10),)},
)


def test_round_trip_through_the_store(tmp_path):
    store = EmbeddedStore(tmp_path)
    cid = GOOD.save(store)
    assert Manifest.load(store, cid) == GOOD
    assert GOOD.save(store) == cid  # canonical: same manifest, same CID


def mutate(**changes):
    raw = GOOD.to_dict()
    raw.update(changes)
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "data,why",
    [
        (json.dumps(GOOD.to_dict(), indent=1).encode(), "canonical"),
        (mutate(extra=1), "exactly the keys"),
        (mutate(version=2), "version 1"),
        (mutate(name="../etc"), "name"),
        (mutate(splits={}), "non-empty"),
        (mutate(splits={"train": [{"cid": "Qmnope", "num_samples": 1}]}), "cid"),
        (mutate(splits={"train": [{"cid": SHARD, "num_samples": 0}]}), "num_samples"),
        (mutate(splits={"train": [{"cid": SHARD, "num_samples": True}]}), "num_samples"),
        (mutate(features={"dtype": "object", "shape": []}), "dtype"),
        (mutate(features={"dtype": "float32", "shape": [1] * 9}), "shape"),
        (b"\xff", "not JSON"),
    ],
)
def test_invalid_manifests_are_refused(data, why):
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(data)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4)))
@settings(max_examples=200, deadline=None)
def test_arbitrary_json_is_a_manifest_error(value):
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def test_shards_are_checked_against_the_manifest():
    x, y = np.zeros((4, 2, 3), np.float32), np.arange(4)
    data = encode_shard(x, y)
    got_x, got_y = decode_shard(data, GOOD.features, GOOD.labels, 4)
    assert np.array_equal(got_x, x) and np.array_equal(got_y, y)
    with pytest.raises(ShardError, match="manifest says"):
        decode_shard(data, GOOD.features, GOOD.labels, 5)
    with pytest.raises(ShardError, match="manifest says"):
        decode_shard(data, TensorSpec("float64", (2, 3)), GOOD.labels, 4)
    with pytest.raises(ShardError, match="safetensors"):
        decode_shard(b"\x00" * 16, GOOD.features, GOOD.labels, 4)


def test_build_is_deterministic_and_splits_everything(tmp_path):
    x = np.arange(100, dtype=np.float32).reshape(50, 2)
    y = np.arange(50)
    cid1, manifest = build_dataset(EmbeddedStore(tmp_path / "a"), "toy", x, y, 3, 0.2)
    cid2, _ = build_dataset(EmbeddedStore(tmp_path / "b"), "toy", x, y, 3, 0.2)
    assert cid1 == cid2
    assert len(manifest.shards("train")) == 3
    assert manifest.num_samples("train") == 40 and manifest.num_samples("test") == 10
    with pytest.raises(ManifestError, match="no split 'valid'"):
        manifest.shards("valid")


def _with_name(value: bytes) -> bytes:
    """GOOD's canonical bytes with the name's JSON replaced by ``value`` (bytes crafted by hand)."""
    data = GOOD.to_json()
    assert b'"name":"toy"' in data
    return data.replace(b'"name":"toy"', b'"name":' + value)


@pytest.mark.parametrize(
    "data,why",
    [
        (b"[" * 100_000, "nested"),  # was RecursionError
        (_with_name(b"[" * 50_000 + b"]" * 50_000), "nested"),  # was RecursionError
        (_with_name(b"1" + b"0" * 400), "integer"),
        (mutate(features={"dtype": {}, "shape": []}), "dtype"),  # was TypeError: unhashable
        (mutate(features={"dtype": [], "shape": []}), "dtype"),
        (mutate(features={"dtype": "float32", "shape": [65536, 65536, 65536]}), "elements per sample"),
        (mutate(splits={"train": [{"cid": SHARD, "num_samples": 2**40}]}), "num_samples"),
        (mutate(version=True), "version 1"),
        (mutate(name="toy\n"), "name"),
    ],
)
def test_hostile_manifests_are_one_declared_error(data, why):
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(data)


def test_a_manifest_error_is_a_user_error_for_the_cli():
    from p2ptrain.base import UserError

    assert issubclass(ManifestError, UserError) and issubclass(ShardError, UserError)


# --- what the numbers mean: classes, pixels, tokens ------------------------------------------------

IMAGES = Manifest("imgs", TensorSpec("uint8", (3, 4, 4)), TensorSpec("int64", ()), {"train": (ShardRef(SHARD, 10),)},
                  classes=("cat", "dog"), pixels=Pixels((0.5, 0.4, 0.3), (0.2, 0.2, 0.25)))
TEXT = Manifest("text", TensorSpec("uint16", (16,)), TensorSpec("uint16", (16,)), {"train": (ShardRef(SHARD, 10),)},
                tokens=Tokens(50_257, SHARD))


def test_optional_fields_round_trip_and_are_absent_when_unused(tmp_path):
    store = EmbeddedStore(tmp_path)
    for manifest in (IMAGES, TEXT, Manifest("bytes", TensorSpec("uint8", (8,)), TensorSpec("uint8", (8,)),
                                            {"train": (ShardRef(SHARD, 1),)}, tokens=Tokens(256))):
        assert Manifest.load(store, manifest.save(store)) == manifest
    assert set(GOOD.to_dict()) == {"schema", "version", "name", "features", "labels", "splits"}


def _change(manifest: Manifest, **changes) -> bytes:
    raw = manifest.to_dict()
    raw.update(changes)
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize("data,why", [
    (_change(IMAGES, classes=[]), "1 to 65536 names"),
    (_change(IMAGES, classes=["cat", "cat"]), "distinct"),
    (_change(IMAGES, classes=["cat", "d\x00g"]), "printable"),
    (_change(IMAGES, classes=["x" * 257]), "printable"),
    (_change(IMAGES, labels={"dtype": "float32", "shape": []}), "int64 labels"),
    (_change(IMAGES, pixels={"mean": [0, 0, 0], "std": [1, 0, 1]}), "positive"),
    (_change(IMAGES, pixels={"mean": [0, 0], "std": [1, 1]}), "one per feature"),
    (_change(IMAGES, features={"dtype": "float32", "shape": [3, 4, 4]}), "uint8 features"),
    (_change(IMAGES, standardize={"mean": [0.0] * 48, "std": [1.0] * 48}), "give one"),
    (_change(TEXT, tokens={"vocab_size": 70_000, "tokenizer": SHARD}), "does not fit features of uint16"),
    (_change(TEXT, tokens={"vocab_size": 1}), "vocab_size"),
    (_change(TEXT, tokens={"vocab_size": 300, "tokenizer": "Qmnope"}), "tokenizer"),
    (_change(TEXT, tokens={"vocab_size": 300, "extra": 1}), "exactly the keys"),
    (_change(TEXT, labels={"dtype": "uint16", "shape": [15]}), "one length"),
    (_change(TEXT, features={"dtype": "float32", "shape": [16]}), "sequence of"),
])
def test_invalid_optional_fields_are_refused(data, why):
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(data)


def test_a_shard_with_labels_or_tokens_outside_the_manifest_is_unusable(tmp_path):
    """A shard from the network whose labels exceed the classes (or ids the vocabulary) would stop a
    training step with an index error: IPFSDataset refuses it as ShardUnavailable instead."""
    from p2ptrain.data import IPFSDataset
    from p2ptrain.data._ipfs_dataset import ShardUnavailable

    store = EmbeddedStore(tmp_path)
    _, built = build_dataset(store, "ids", np.arange(20, dtype=np.uint8).reshape(10, 2),
                             np.arange(10), 1, test_fraction=0)
    lying = Manifest("ids", built.features, built.labels, built.splits, classes=("a", "b", "c"))
    with pytest.raises(ShardUnavailable, match=r"labels hold values outside \[0, 3\)"):
        list(IPFSDataset(lying.save(store), store=store))
    tokens = np.arange(40, dtype=np.uint8).reshape(10, 4)
    _, built = build_dataset(store, "t", tokens, tokens, 1, test_fraction=0)
    lying = Manifest("t", built.features, built.labels, built.splits, tokens=Tokens(32))
    with pytest.raises(ShardUnavailable, match=r"features hold values outside \[0, 32\)"):
        list(IPFSDataset(lying.save(store), store=store))
