"""Manifests are canonical, strictly validated, and stored by CID."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.data.build import build_dataset
from p2ptrain.data.manifest import Manifest, ManifestError, ShardRef, TensorSpec
from p2ptrain.data.shards import ShardError, decode_shard, encode_shard
from p2ptrain.ipfs.cid import make_cid
from p2ptrain.ipfs.embedded import EmbeddedStore

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
    from p2ptrain.errors import UserError

    assert issubclass(ManifestError, UserError) and issubclass(ShardError, UserError)
