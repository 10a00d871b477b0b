"""Dataset shards: one safetensors file per shard holding ``features`` and ``labels``.

safetensors because shard bytes come from other peers: the format is a JSON header plus raw arrays, so
reading one cannot run code (unlike pickle, ``torch.load`` or ``np.load(allow_pickle=True)``). A shard's
header is checked (:func:`p2ptrain.base.read_header`: bounded, every byte range inside the
file) and compared with the manifest's dtypes, shapes and sample count before any array is built.
"""

from __future__ import annotations

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from p2ptrain.data._manifest import TensorSpec
from p2ptrain.base import TensorFileError, UserError, read_header

KEYS = ("features", "labels")
# numpy's name of a dtype (what manifests say) to the safetensors code.
NUMPY_CODES = {"bool": "BOOL", "uint8": "U8", "uint16": "U16", "int8": "I8", "int16": "I16", "int32": "I32",
               "int64": "I64", "float16": "F16", "float32": "F32", "float64": "F64"}


class ShardError(UserError, ValueError):
    """Shard bytes that do not hold what the manifest promises."""


def encode_shard(features: np.ndarray, labels: np.ndarray) -> bytes:
    if len(features) != len(labels) or len(features) == 0:
        raise ValueError(f"a shard needs as many labels as samples (>0): {len(features)}, {len(labels)}")
    return save({"features": np.ascontiguousarray(features), "labels": np.ascontiguousarray(labels)})


def spec_of(array: np.ndarray) -> TensorSpec:
    """The per-sample spec of a batch array (its first axis is the sample axis)."""
    return TensorSpec(str(array.dtype), tuple(int(n) for n in array.shape[1:]))


def decode_shard(
    data: bytes, features: TensorSpec, labels: TensorSpec, num_samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """Parse shard bytes and check them against the manifest; :class:`ShardError` if anything differs."""
    try:
        header = read_header(data)
    except TensorFileError as exc:
        raise ShardError(f"not a safetensors file: {exc}") from None
    if set(header.tensors) != set(KEYS):
        raise ShardError(f"shard holds {sorted(header.tensors)[:8]}, expected {list(KEYS)}")
    for key, spec in zip(KEYS, (features, labels)):
        info = header.tensors[key]
        if info.dtype != NUMPY_CODES.get(spec.dtype) or info.shape != (num_samples, *spec.shape):
            raise ShardError(
                f"{key} is {info.dtype}{list(info.shape)}, manifest says {spec.dtype}{[num_samples, *spec.shape]}"
            )
    try:
        arrays = load(data)
    except (SafetensorError, ValueError, KeyError) as exc:
        raise ShardError(f"not a safetensors file: {exc}") from None
    return arrays["features"], arrays["labels"]
