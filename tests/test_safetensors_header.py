"""Safetensors headers from the network: bounded, checked against the file before any tensor exists."""

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save

from p2ptrain.data._manifest import TensorSpec
from p2ptrain.data._shards import ShardError, decode_shard
from p2ptrain.base import TensorFileError, read_header
from p2ptrain.base._safetensors_header import MAX_HEADER_BYTES, MAX_TENSORS


def crafted(header, body: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def entry(dtype="F32", shape=(2,), start=0, end=8):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, end]}


def test_a_real_file_reads_back():
    data = save({"a": np.zeros((2, 3), np.float32), "b": np.arange(4), "c": np.zeros(0, np.uint8)},
                metadata={"k": "v"})
    header = read_header(data)
    assert header.metadata == {"k": "v"}
    assert header.tensors["a"].shape == (2, 3) and header.tensors["a"].dtype == "F32"
    assert header.tensors["b"].dtype == "I64"


@pytest.mark.parametrize(
    "data,why",
    [
        (b"\x01\x00", "shorter"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "over the"),
        (struct.pack("<Q", 100) + b"{}", "runs past"),
        # JSON (a task's CID given where a model's goes): said so, not a header of 7.3e18 bytes.
        (b'{"compression": {"density": 0.01}}\n', r"not a safetensors file: it begins as JSON text \(b'\{\"compression"),
        (crafted(b"[" * 100_000), "nested"),
        (crafted(b"{\"a\":" + b"1" * 400 + b"}"), "integer"),
        (crafted([]), "must be an object"),
        (crafted({"a": entry(dtype={})}, b"\0" * 8), "dtype"),
        (crafted({"a": entry(dtype="F8_E4M3", end=2)}, b"\0" * 2), "dtype"),
        (crafted({"a": entry(shape=[2**62, 2**62])}, b"\0" * 8), "does not fill"),
        (crafted({"a": entry(shape=[-1])}, b"\0" * 8), "non-negative"),
        (crafted({"a": entry(shape=[1] * 9)}, b"\0" * 8), "at most 8"),
        (crafted({"a": entry(end=16)}, b"\0" * 8), "outside"),
        (crafted({"a": entry(start=8, end=0)}, b"\0" * 8), "outside"),
        (crafted({"a": entry(), "b": entry()}, b"\0" * 8), "overlap"),
        (crafted({"a": entry(start=8, end=16)}, b"\0" * 16), "overlap or leave a gap"),
        (crafted({"a": entry()}, b"\0" * 12), "cover 8 B of the 12"),
        (crafted({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "exactly"),
        (crafted({"__metadata__": {"k": 1}}), "__metadata__"),
        (crafted({f"t{i}": entry(shape=[0], start=0, end=0) for i in range(MAX_TENSORS + 1)}), "over the limit"),
    ],
)
def test_malformed_headers_are_one_declared_error(data, why):
    with pytest.raises(TensorFileError, match=why):
        read_header(data)


def test_a_shard_whose_header_disagrees_with_the_manifest_is_refused_from_its_header():
    data = save({"features": np.zeros((3, 2), np.float32), "labels": np.arange(3)})
    with pytest.raises(ShardError, match=r"features is F32\[3, 2\], manifest says float64\[3, 2\]"):
        decode_shard(data, TensorSpec("float64", (2,)), TensorSpec("int64", ()), 3)
    with pytest.raises(ShardError, match="nested"):
        decode_shard(crafted(b"[" * 100_000), TensorSpec("float32", (2,)), TensorSpec("int64", ()), 3)
