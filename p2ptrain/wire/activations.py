"""The frames of the stage protocol (``/p2ptrain/pipeline/1.3.0``; 1.2.0 had the same frames without the EVAL
kinds, 1.1.0 and 1.0.0 without the CHECK kinds either): activations and their gradients.

A frame is a 23-byte header (magic ``PP``, version, kind, step, microbatch id, stage, a float32 value
and the number of tensors that follow) and up to :data:`MAX_TENSORS` tensors. A tensor is its
encoding, rank and dimensions, the length of its payload, then the payload:

- ``fp32``: float32 little-endian, exact;
- ``fp16``: float16 (half the bytes; relative error at most 2^-11 in fp16's normal range);
- ``int8``: codes -127..127 with one float32 absmax scale per block of 128 values
  (:mod:`p2ptrain.wire.quantization`: a quarter of the bytes, error at most a block's max / 254);
- ``i64``: int64 little-endian, exact (targets, microbatch ids).

Float tensors decode to float32, whatever crossed the wire. Nothing here is trusted for its size:
:func:`decode_frame` checks the rank, every dimension and the element count against the receiver's
:class:`Limits` before anything is allocated, checks that each payload's claimed length is exactly
what its shape and encoding take and that the frame holds it, refuses trailing bytes, non-finite
values, scales and header values, and raises one error, :class:`ActivationError`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from p2ptrain.base import all_finite
from p2ptrain.wire import quantization

MAGIC = b"PP"
VERSION = 1
# magic, version, kind, step, microbatch id, stage, value, tensors
HEADER = struct.Struct(">2sBBIQHfB")
_TENSOR = struct.Struct(">BB")  # encoding, rank
_DIM = struct.Struct(">I")
_LENGTH = struct.Struct(">Q")
MAX_TENSORS = 2


class ActivationError(ValueError):
    """Bytes that are not a well-formed stage-protocol frame within the receiver's limits (the only
    error of :func:`decode_frame`, and what :func:`encode_frame` raises for a tensor it cannot send)."""


class Kind(IntEnum):
    FORWARD = 1  # stage input -> the stage's output (OUTPUT)
    OUTPUT = 2
    LOSS = 3  # last stage: input and targets, value = the microbatch's weight in the step -> GRAD
    BACKWARD = 4  # stage input and the gradient of its output -> GRAD (the gradient of its input)
    GRAD = 5  # value: the microbatch's loss (answers to LOSS), else 0
    HOLDINGS = 6  # which microbatches of the step has the replica accumulated? -> HELD
    HELD = 7  # one i64 tensor of microbatch ids
    # A second opinion on a LOSS or a BACKWARD (protocol 1.2.0): the same tensors, answered with the
    # same GRAD, but nothing accumulated or held: the replica that gives it is not the one whose
    # gradient the stage sums for that microbatch.
    CHECK_LOSS = 8
    CHECK_BACKWARD = 9
    # An evaluation (protocol 1.3.0), for the test-split metrics of a checkpoint: the stage's input ->
    # OUTPUT, or at the last stage its input and targets -> SCORE; no graph kept, nothing accumulated.
    EVAL = 10
    SCORE = 11  # value: the batch's mean loss; one i64 tensor (correct predictions, predictions)


class Encoding(IntEnum):
    FP32 = 1
    FP16 = 2
    INT8 = 3
    I64 = 4


ENCODINGS = {"fp32": Encoding.FP32, "fp16": Encoding.FP16, "int8": Encoding.INT8}


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts: tensors of at most ``max_rank`` dimensions and ``max_elements``
    values each. The runtime sets it from the task (a stage's largest activation: microbatch x
    context x width); the default, 4M values (a frame of at most 64 MiB), fits the models the
    registry builds at modest microbatches."""

    max_rank: int = 4
    max_elements: int = 1 << 22

    def max_frame_bytes(self) -> int:
        """The longest frame these limits admit (the bound a channel's ``recv`` is given)."""
        per_tensor = _TENSOR.size + self.max_rank * _DIM.size + _LENGTH.size + 8 * self.max_elements
        return HEADER.size + MAX_TENSORS * per_tensor


DEFAULT_LIMITS = Limits()


def frame_bound(tensors: Sequence[tuple[tuple[int, ...], bool]]) -> int:
    """The longest a frame with one tensor of each ``(shape, is_float)`` of ``tensors`` is: 4 bytes a
    value of a float tensor (fp32, the widest float encoding), 8 of another (i64). What a receiver
    that knows a request's shapes reads it within."""
    return HEADER.size + sum(_TENSOR.size + len(shape) * _DIM.size + _LENGTH.size + (4 if is_float else 8) * math.prod(shape)
                             for shape, is_float in tensors)


@dataclass(frozen=True)
class Frame:
    kind: int
    step: int
    microbatch: int
    stage: int
    value: float = 0.0
    tensors: tuple[torch.Tensor, ...] = ()


def payload_size(encoding: int, count: int) -> int:
    """The exact payload length of ``count`` values in ``encoding``."""
    if encoding == Encoding.INT8:
        return quantization.encoded_size(count, "int8")
    return count * {Encoding.FP32: 4, Encoding.FP16: 2, Encoding.I64: 8}[Encoding(encoding)]


def _encode_tensor(tensor: torch.Tensor, encoding: str) -> bytes:
    if tensor.dtype in (torch.int64, torch.int32, torch.uint8, torch.int16):
        code, payload = Encoding.I64, tensor.detach().to(torch.int64).contiguous().numpy().astype("<i8").tobytes()
    else:
        if encoding not in ENCODINGS:
            raise ActivationError(f"unknown activation encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
        values = tensor.detach().to(torch.float32).contiguous()
        if not all_finite(values):
            raise ActivationError("an activation to send is not finite")
        code = ENCODINGS[encoding]
        if code == Encoding.FP32:
            payload = values.numpy().astype("<f4").tobytes()
        elif code == Encoding.FP16:
            half = values.to(torch.float16)
            if not all_finite(half):
                raise ActivationError("an activation overflows fp16; send it as fp32 or int8")
            payload = half.numpy().astype("<f2").tobytes()
        else:
            payload = quantization.encode(values.reshape(-1), "int8")
    shape = tuple(tensor.shape)
    head = _TENSOR.pack(code, len(shape)) + b"".join(_DIM.pack(d) for d in shape)
    return head + _LENGTH.pack(len(payload)) + payload


def encode_frame(frame: Frame, encoding: str = "fp32") -> bytes:
    """The bytes of ``frame``; float tensors as ``encoding`` (fp32, fp16, int8), integer ones as i64."""
    if len(frame.tensors) > MAX_TENSORS:
        raise ActivationError(f"{len(frame.tensors)} tensors in a frame (at most {MAX_TENSORS})")
    if not math.isfinite(frame.value):
        raise ActivationError("a frame's value is not finite")
    head = HEADER.pack(MAGIC, VERSION, frame.kind, frame.step, frame.microbatch, frame.stage, frame.value,
                       len(frame.tensors))
    return head + b"".join(_encode_tensor(t, encoding) for t in frame.tensors)


def _decode_tensor(data: memoryview, at: int, limits: Limits) -> tuple[torch.Tensor, int]:
    if len(data) - at < _TENSOR.size:
        raise ActivationError("frame ends inside a tensor header")
    code, rank = _TENSOR.unpack_from(data, at)
    at += _TENSOR.size
    if code not in Encoding.__members__.values():
        raise ActivationError(f"unknown tensor encoding {code}")
    if not 1 <= rank <= limits.max_rank:
        raise ActivationError(f"tensor of rank {rank} (1 to {limits.max_rank} allowed)")
    if len(data) - at < rank * _DIM.size + _LENGTH.size:
        raise ActivationError("frame ends inside a tensor's shape")
    shape: list[int] = []
    count = 1
    for _ in range(rank):
        (dim,) = _DIM.unpack_from(data, at)
        at += _DIM.size
        count *= dim
        if dim == 0 or count > limits.max_elements:
            raise ActivationError(f"tensor shape {(*shape, dim)} is empty or over {limits.max_elements} values")
        shape.append(dim)
    (length,) = _LENGTH.unpack_from(data, at)
    at += _LENGTH.size
    expected = payload_size(code, count)
    if length != expected or length > len(data) - at:
        raise ActivationError(
            f"tensor payload claims {length} bytes; its shape takes {expected} and the frame has {len(data) - at}"
        )
    raw = data[at : at + length]
    if code == Encoding.I64:
        out = torch.from_numpy(np.frombuffer(raw, dtype="<i8").astype(np.int64))
    elif code == Encoding.INT8:
        try:
            out = quantization.decode(bytes(raw), count, "int8")
        except quantization.QuantError as error:
            raise ActivationError(f"int8 tensor: {error}") from error
    else:
        dtype = "<f4" if code == Encoding.FP32 else "<f2"
        out = torch.from_numpy(np.frombuffer(raw, dtype=dtype).astype(np.float32))
        if not all_finite(out):
            raise ActivationError("a tensor holds a value that is not finite")
    return out.reshape(shape), at + length


def decode_frame(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """The frame ``data`` holds; :class:`ActivationError` for anything else (see the module's doc)."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise ActivationError(f"frame of {len(view)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, kind, step, microbatch, stage, value, count = HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise ActivationError(f"not a stage-protocol frame (magic {bytes(magic)!r}, version {version})")
    if kind not in Kind.__members__.values():
        raise ActivationError(f"unknown frame kind {kind}")
    if not math.isfinite(value):
        raise ActivationError("a frame's value is not finite")
    if count > MAX_TENSORS:
        raise ActivationError(f"{count} tensors in a frame (at most {MAX_TENSORS})")
    at, tensors = HEADER.size, []
    for _ in range(count):
        tensor, at = _decode_tensor(view, at, limits)
        tensors.append(tensor)
    if at != len(view):
        raise ActivationError(f"{len(view) - at} bytes after the frame's last tensor")
    return Frame(kind, step, microbatch, stage, value, tuple(tensors))
