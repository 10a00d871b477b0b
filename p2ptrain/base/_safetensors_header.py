"""Read and check the header of a safetensors file from the network before any tensor is built.

Shards, model files and optimizer states all arrive as safetensors bytes from other peers. The
format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw bytes. The safetensors library checks much of this itself, but with its own
bounds (a 100 MB header, serde's nesting limit) and its own error types; here every bound is ours and
one error, :class:`TensorFileError`, covers every malformation: a header length past the file, JSON
that is deep or not JSON (:mod:`p2ptrain.base.boundedjson`), a dtype outside :data:`ITEMSIZE`, a shape
whose bytes do not match its range, ranges that overlap, leave gaps or run past the file. Only after
:func:`read_header` accepts the bytes does a caller hand them to safetensors to build tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2ptrain.base import boundedjson

# 16 MiB of header: a model of MAX_TENSORS tensors with long names needs well under 2 MiB.
MAX_HEADER_BYTES = 16 * 1024 * 1024
# Tensors in one file: an optimizer state of our largest registry model (transformer_lm, depth 48:
# ~600 parameters, 2 Adam moments each) has ~1,800; 16,384 leaves room and bounds the work.
MAX_TENSORS = 16_384
# Dimensions of one tensor: our models use at most 4 (conv weights); numpy's own limit is 64.
MAX_DIMS = 8
# A tensor name is a state-dict key ("blocks.47.self_attn.out_proj.weight"): 256 characters is ample.
MAX_NAME_LENGTH = 256
# Metadata: we write one entry (the model card, a few hundred bytes); 16 entries of 64 KiB at most.
MAX_METADATA_ENTRIES = 16
MAX_METADATA_VALUE = 64 * 1024
# The header is an object of objects with a shape list: three levels; four allows nothing deeper.
MAX_HEADER_DEPTH = 4
# Bytes per element of every dtype we read (safetensors' codes); anything else is refused.
ITEMSIZE = {"BOOL": 1, "U8": 1, "U16": 2, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2, "F32": 4,
            "F64": 8}


class TensorFileError(ValueError):
    """Bytes that are not a safetensors file within our bounds."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header: safetensors dtype code, shape, byte range in the data."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def _index(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise TensorFileError(f"{what} must be a non-negative integer")
    return value


def read_header(data: bytes) -> Header:
    """The checked header of safetensors ``data``; :class:`TensorFileError` if anything is off."""
    if len(data) < 8:
        raise TensorFileError("not a safetensors file: shorter than its 8-byte header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        if data[:1] in (b"{", b"["):  # a length with 8 printable bytes: JSON text, e.g. a task given for a model
            raise TensorFileError(f"not a safetensors file: it begins as JSON text ({data[:24]!r}...)")
        raise TensorFileError(f"safetensors header of {header_len} B is over the {MAX_HEADER_BYTES} B limit")
    if 8 + header_len > len(data):
        raise TensorFileError(f"safetensors header of {header_len} B runs past the file's {len(data)} B")
    try:
        raw = boundedjson.loads(data[8 : 8 + header_len], max_depth=MAX_HEADER_DEPTH, what="safetensors header")
    except boundedjson.JSONBoundsError as exc:
        raise TensorFileError(str(exc)) from None
    if type(raw) is not dict:
        raise TensorFileError("safetensors header must be an object")
    metadata = _metadata(raw.pop("__metadata__", {}))
    if len(raw) > MAX_TENSORS:
        raise TensorFileError(f"{len(raw)} tensors, over the limit of {MAX_TENSORS}")
    body = len(data) - 8 - header_len
    tensors = {name: _tensor(name, entry, body) for name, entry in raw.items()}
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != position:
            raise TensorFileError("tensor byte ranges overlap or leave a gap")
        position = info.end
    if position != body:
        raise TensorFileError(f"tensors cover {position} B of the {body} B after the header")
    return Header(tensors, metadata)


def _metadata(value: object) -> dict[str, str]:
    if type(value) is not dict or len(value) > MAX_METADATA_ENTRIES:
        raise TensorFileError(f"__metadata__ must be an object of at most {MAX_METADATA_ENTRIES} strings")
    for key, item in value.items():
        if type(item) is not str or len(key) > MAX_NAME_LENGTH or len(item) > MAX_METADATA_VALUE:
            raise TensorFileError(f"__metadata__ values must be strings of at most {MAX_METADATA_VALUE} characters")
    return value


def _tensor(name: str, entry: object, body: int) -> TensorInfo:
    if len(name) > MAX_NAME_LENGTH:
        raise TensorFileError(f"tensor name of {len(name)} characters, over {MAX_NAME_LENGTH}")
    if type(entry) is not dict or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise TensorFileError(f"tensor {name[:64]!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if type(dtype) is not str or dtype not in ITEMSIZE:
        raise TensorFileError(f"tensor {name[:64]!r}: dtype must be one of {', '.join(sorted(ITEMSIZE))}")
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise TensorFileError(f"tensor {name[:64]!r}: shape must be a list of at most {MAX_DIMS} sizes")
    dims = tuple(_index(n, f"tensor {name[:64]!r}: a size") for n in shape)
    if type(offsets) is not list or len(offsets) != 2:
        raise TensorFileError(f"tensor {name[:64]!r}: data_offsets must be [start, end]")
    start, end = (_index(n, f"tensor {name[:64]!r}: an offset") for n in offsets)
    if not start <= end <= body:
        raise TensorFileError(f"tensor {name[:64]!r}: bytes [{start}, {end}) are outside the file's {body} B of data")
    # Each size is below 2**63 and the product is compared with a range that is below the file size,
    # so the arithmetic stays exact (Python ints) and cheap (at most MAX_DIMS multiplications).
    if math.prod(dims) * ITEMSIZE[dtype] != end - start:
        raise TensorFileError(f"tensor {name[:64]!r}: {dtype}{list(dims)} does not fill its {end - start} B")
    return TensorInfo(dtype, dims, start, end)
